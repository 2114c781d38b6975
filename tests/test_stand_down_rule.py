"""The stand-down rule, seen and right (issue 45 item 4): the EP group's backend read at install, a pre-release torch
judged by what it does, the fp32-probs cast at expert TP > 1, and a warning when an enabled ring stands down.

Expected verdicts are written out from megatron-core 0.19.2's and torch's own lines (quoted in each test), not
recomputed from the rule's code.
"""

from __future__ import annotations

import warnings

import pytest

from bufreuse import config
from bufreuse.config import BufReuseConfig, TorchAssumption, sync_collectives_on_current_stream, unused_rings

BOTH = BufReuseConfig(moe_hybridep_reuse_dispatch_output_buffers=True, moe_hybridep_num_expert_output_buffers=2)
# one local expert (EP 8 of 8 experts), expert TP 2: the combine reduce-scatters the FC2 output over expert TP
ETP2 = {"moe_token_dispatcher_type": "alltoall", "num_moe_experts": 8, "moe_router_topk": 2,
        "expert_model_parallel_size": 8, "expert_tensor_parallel_size": 2}  # fmt: skip


# -- the fp32-probs cast before the expert-TP reduce-scatter -------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expert_used"),
    [
        ({"bf16": True}, True),  # probs in bf16 (router dtype unset: type_as(logits)): .to() is a no-op, RS reads FC2
        ({"bf16": True, "moe_router_dtype": "fp32"}, False),  # bf16 -> fp32: a copy, RS reads the copy
        ({"bf16": True, "moe_router_dtype": "fp64"}, False),
        ({"moe_router_dtype": "fp32"}, True),  # fp32 activations, fp32 probs: no copy
        ({"moe_router_dtype": "fp64"}, False),  # fp32 -> fp64: a copy
    ],
)
def test_the_fp32_probs_cast_at_expert_tp_2_copies_the_fc2_output(extra: dict, expert_used: bool) -> None:
    """NCCL that records streams (torch < 2.8): the FC2 output is recorded on NCCL's stream only if the reduce-scatter
    reads it itself. ``combine_preprocess`` hands it ``hidden_states.to(self.probs.dtype)``: the same tensor when the
    dtypes agree, a copy made on the compute stream when they differ (then freed at once, nothing pending)."""
    unused = unused_rings({**ETP2, **extra}, BOTH, "alltoall", records_streams=True)
    assert ("expert" not in unused) is expert_used, unused
    assert "dispatch" not in unused  # the dispatch output is recorded on NCCL's stream either way
    if not expert_used:
        assert "moe_router_dtype=fp" in unused["expert"] and "nothing waits pending-free" in unused["expert"]
    # at expert TP 1 there is no reduce-scatter and no cast: the FC2 output goes to the all-to-all itself
    etp1 = {**ETP2, **extra, "expert_tensor_parallel_size": 1}
    assert "expert" not in unused_rings(etp1, BOTH, "alltoall", records_streams=True)


def test_the_cast_is_megatrons_line() -> None:
    """The rule reads megatron-core 0.19.2's ``combine_preprocess`` (all-to-all dispatcher): at expert TP > 1 it
    reduce-scatters the FC2 output cast to the probs' dtype, and the router's probs follow ``moe_router_dtype``."""
    import inspect

    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe import moe_utils, router
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    src = inspect.getsource(D.combine_preprocess)
    assert "if self.tp_size > 1:" in src and "hidden_states.to(self.probs.dtype)" in src
    assert "moe_router_dtype == 'fp32'" in inspect.getsource(router.Router.gating)
    assert "probs = probs.type_as(logits)" in inspect.getsource(moe_utils.topk_routing_with_score_function)


# -- the backend -----------------------------------------------------------------------------------------------


def test_gloo_stands_down_and_a_backend_the_rule_does_not_know_keeps_the_rings() -> None:
    """EP 8 of 8 experts (one local expert: the combine's all-to-all reads the FC2 output itself), bf16, expert TP 1.
    gloo never records (the host waits for its side stream); an unknown backend is assumed to (rings kept)."""
    ep8 = {**ETP2, "expert_tensor_parallel_size": 1, "bf16": True}
    assert set(unused_rings({**ep8, "distributed_backend": "gloo"}, BOTH, "alltoall", records_streams=True)) == {
        "dispatch", "expert"}  # fmt: skip
    assert unused_rings({**ep8, "distributed_backend": "ucc"}, BOTH, "alltoall", records_streams=False) == {}
    # positive controls: NCCL that records keeps both, NCCL that does not leaves both unused
    assert unused_rings(ep8, BOTH, "alltoall", records_streams=True) == {}
    assert set(unused_rings(ep8, BOTH, "alltoall", records_streams=False)) == {"dispatch", "expert"}


# -- a pre-release torch, judged by what it does -------------------------------------------------------------

WAITS = '''
def all_to_all_single(output, input, group=None, async_op=False):
    work = group.all_to_all_single(output, input, [], [], opts)
    if async_op:
        return work
    else:
        work.wait()

def barrier():
    pass
'''
SYNCED_IN_CPP = '''
def all_to_all_single(output, input, group=None, async_op=False):
    work = group.all_to_all_single(output, input, [], [], opts)
    if async_op:
        return work
    elif (
        work is not None
    ):  # Backward compatible with backends that don't sync at CPP level
        work.wait()
'''


def test_the_probe_reads_whether_a_synchronous_all_to_all_is_left_to_the_backend() -> None:
    assert sync_collectives_on_current_stream(SYNCED_IN_CPP) is True
    assert sync_collectives_on_current_stream(WAITS) is False
    assert sync_collectives_on_current_stream("def all_reduce():\n    elif work is not None: pass\n") is None
    # the torch installed here (2.13) has pytorch#150398's guard in its own distributed_c10d.py
    pytest.importorskip("torch")
    assert sync_collectives_on_current_stream() is True


@pytest.mark.parametrize(("behaves_like", "records"), [("2.8", False), ("2.7", True)])
def test_an_installed_pre_release_is_judged_by_the_probe_and_says_which_way(monkeypatch, behaves_like, records) -> None:
    """``2.8.0a0+git...`` (a container build between 2.7 and 2.8): its version string alone counts as 2.7 (records,
    rings kept); the probe decides instead, and the reason names the way it went."""
    monkeypatch.setattr(config, "_installed_torch", lambda: "2.8.0a0+git5fe6bb1")
    monkeypatch.setattr(config, "sync_collectives_on_current_stream", lambda source=None: behaves_like == "2.8")
    monkeypatch.delenv("TORCH_NCCL_AVOID_RECORD_STREAMS", raising=False)
    judged = config.torch_assumption()
    assert judged.current_stream is (behaves_like == "2.8") and judged.records_streams() is records
    assert f"as {behaves_like} does" in judged.text() and "judged by what it does" in judged.text()
    assert config.nccl_records_streams() is records  # the default (installed) judgement follows the probe too
    ep2 = {**ETP2, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1, "bf16": True}
    unused = unused_rings(ep2, BOTH, "alltoall")
    if records:
        assert "dispatch" not in unused  # recorded on NCCL's stream: the ring replaces a pending free
    else:
        assert "as 2.8 does" in unused["dispatch"]
    # the string alone (an --torch-version option, nothing probed) stays conservative: counted as 2.7
    assert TorchAssumption("2.8.0a0+git5fe6bb1", "option").records_streams({}) is True
    # a release is judged by its number, not probed
    monkeypatch.setattr(config, "_installed_torch", lambda: "2.7.1")
    assert config.torch_assumption().current_stream is None


# -- install(): the EP group's backend, and a warning when an enabled ring stands down -------------------------


def _ep2_layer():
    from megatron_cpu import cpu_moe_layer

    layer = cpu_moe_layer(8, "alltoall", 32)
    layer.token_dispatcher.ep_size = 2  # what a pg_collection with a 2-rank EP group gives megatron
    layer.config.expert_model_parallel_size = 2
    return layer


def test_install_judges_the_ep_groups_real_backend(parallel, monkeypatch) -> None:
    """At torch 2.7 (NCCL records streams) the dispatch output of an EP 2 all-to-all waits pending-free on NCCL's
    stream, so the ring is worth it there; the group here is gloo (the host waits for its side stream), so the ring
    stands down, naming gloo. Positive control: the same layer with its group read as NCCL keeps the ring."""
    from bufreuse.integrations import megatron
    from bufreuse.pool import BufferPool

    monkeypatch.setattr(config, "_installed_torch", lambda: "2.7.1")
    monkeypatch.delenv("TORCH_NCCL_AVOID_RECORD_STREAMS", raising=False)
    knobs = BufReuseConfig(moe_hybridep_reuse_dispatch_output_buffers=True, moe_hybridep_num_dispatch_output_buffers=2)
    layer = _ep2_layer()
    assert megatron.ep_backend(layer) == "gloo"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", megatron.RingStandDownWarning)
        with megatron.install(layer, BufferPool("cpu"), knobs, tokens=16) as inst:
            assert "gloo" in inst.unused["dispatch_output"] and inst.layers == 0
        monkeypatch.setattr(megatron, "ep_backend", lambda layer: "nccl")
        pool = BufferPool("cpu")
        with megatron.install(_ep2_layer(), pool, knobs, tokens=16) as inst:
            assert inst.unused == {} and pool.names() == ["dispatch_output"]


def test_an_enabled_ring_that_stands_down_warns_once_with_its_reason(parallel, monkeypatch) -> None:
    from megatron_cpu import cpu_moe_layer

    from bufreuse.integrations import megatron
    from bufreuse.pool import BufferPool

    monkeypatch.setattr(megatron, "_WARNED", set())
    knobs = BufReuseConfig(moe_hybridep_reuse_dispatch_output_buffers=True)
    with pytest.warns(megatron.RingStandDownWarning, match=r"ring 'dispatch_output' enabled but stands down .*EP = 1"):
        megatron.install(cpu_moe_layer(8, "alltoall", 32), BufferPool("cpu"), knobs, tokens=16).uninstall()
    with warnings.catch_warnings(record=True) as again:  # a second model chunk (or install): no second warning
        warnings.simplefilter("always")
        megatron.install(cpu_moe_layer(8, "alltoall", 32), BufferPool("cpu"), knobs, tokens=16).uninstall()
    assert not [w for w in again if issubclass(w.category, megatron.RingStandDownWarning)]
    # knobs off: nothing enabled, nothing to stand down, nothing said
    monkeypatch.setattr(megatron, "_WARNED", set())
    with warnings.catch_warnings(record=True) as off:
        warnings.simplefilter("always")
        megatron.install(cpu_moe_layer(8, "alltoall", 32), BufferPool("cpu"), BufReuseConfig(), tokens=16).uninstall()
    assert not [w for w in off if issubclass(w.category, megatron.RingStandDownWarning)]


# -- plan and check-config show the verdict ------------------------------------------------------------------

# EP 2 all-to-all (4 local experts: the sort copies both buffers), 1F1B over 4 microbatches, 2 MoE layers; torch >= 2.8
# NCCL: both rings stand down. The keep knob is the twin where both are used.
PLAN_FIELDS = {
    "moe_token_dispatcher_type": "alltoall", "num_moe_experts": 8, "moe_router_topk": 2,
    "expert_model_parallel_size": 2, "num_layers": 2, "hidden_size": 64, "seq_length": 16, "micro_batch_size": 1,
    "num_microbatches": 4, "bf16": True,
    "moe_hybridep_reuse_dispatch_output_buffers": True, "moe_hybridep_num_dispatch_output_buffers": 4,
    "moe_hybridep_num_expert_output_buffers": 4,
}  # fmt: skip


def _no_records(monkeypatch) -> None:
    monkeypatch.setattr(config, "nccl_records_streams", lambda *args, **kwargs: False)


def test_plan_keeps_the_modelled_control_queue_of_a_ring_that_stands_down(monkeypatch) -> None:
    """The model's pending-free count (every buffer record_stream'ed) is the same whether the rule keeps the ring or
    not: it is the model's, not the rule's. A stood-down ring shows it with the verdict beside it."""
    from bufreuse.plan import plan_config

    _no_records(monkeypatch)
    down = {b.buffer: b for b in plan_config(PLAN_FIELDS).buffers}
    kept = {b.buffer: b for b in plan_config({**PLAN_FIELDS, "moe_bufreuse_keep_unused_rings": True}).buffers}
    for buf in ("dispatch", "expert"):
        assert down[buf].unused and not kept[buf].unused
        assert down[buf].pending_count == kept[buf].pending_count > 0  # the model's figure, not zeroed by the rule
        assert down[buf].to_dict()["verdict"].startswith("stands down: ") and kept[buf].to_dict()["verdict"] == "used"
        assert down[buf].persistent_bytes == 0 < kept[buf].persistent_bytes


def _args_file(tmp_path, fields: dict) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text("".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in fields.items()))
    return str(path)


def test_plan_and_check_config_say_every_ring_stands_down(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from bufreuse.cli.app import app

    _no_records(monkeypatch)
    runner = CliRunner()
    cfg = _args_file(tmp_path, PLAN_FIELDS)
    out = " ".join(runner.invoke(app, ["plan", cfg]).output.split())
    assert out.count("modelled; rule: none waits (stands down)") == 2, out
    assert "dispatch_output: release after" in out and "stands down (install() hooks nothing):" in out
    res = runner.invoke(app, ["check-config", cfg])
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "enabled, but every ring stands down: dispatch: " in text, text
    assert "can be enabled" not in text
    data = __import__("json").loads(runner.invoke(app, ["check-config", cfg, "--json"]).output)
    assert data["all_stand_down"] and set(data["stood_down"]) == {"dispatch", "expert"}
    # positive control: with the keep knob nothing stands down, and check-config says it can be enabled
    kept = _args_file(tmp_path, {**PLAN_FIELDS, "moe_bufreuse_keep_unused_rings": True})
    text = " ".join(runner.invoke(app, ["check-config", kept]).output.split())
    assert "can be enabled" in text and "stands down" not in text, text
