"""The integration core: installation undo, shared patches, the adapter registry and the matrix it assembles."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bufreuse.config import BufReuseConfig
from bufreuse.integrations import core
from bufreuse.integrations.core import Installation
from bufreuse.integrations.registry import ADAPTERS, adapter
from bufreuse.integrations.requirements import REQUIREMENTS

ROOT = Path(__file__).parents[1]

# The report order check-config printed before the rows moved into the adapters.
KEY_ORDER = [
    "dispatcher",
    "static_bound",
    "ep_overlap",
    "quantized_experts",
    "deepep_output_token",
    "grouped_gemm",
    "te_grouped_output",
    "no_fused_group_mlp_offload",
    "no_expert_input_offload",
    "no_hybridep_probs_on_input",
    "no_per_layer_cuda_graphs",
    "no_paged_stash",
    "no_te_cpu_offload",
    "no_graphed_delayed_wgrad",
    "tokens_known",
    "unfused_permute",
    "expert_output_writer",
    "no_shared_expert_overlap",
    "no_cuda_graphs",
    "dispatch_slots",
]


class _Thing:
    def method(self) -> str:
        return "class"


def _installation() -> Installation:
    return Installation(pool=None, knobs=BufReuseConfig(), tokens=8)  # type: ignore[arg-type]


def test_matrix_keeps_report_order_and_unique_keys() -> None:
    assert [r.key for r in REQUIREMENTS] == KEY_ORDER


def test_every_adapter_row_is_in_the_matrix_and_applies_to_its_path_only() -> None:
    keys = {r.key for r in REQUIREMENTS}
    for a in ADAPTERS:
        rows = a.requirements()
        assert rows, f"adapter {a.name} owns no requirement rows"
        assert {r.key for r in rows} <= keys
        assert all(r.paths == {a.path} for r in rows), a.name
        assert all(r.buffers <= core.BOTH for r in rows)


def test_registry_adapters_satisfy_the_protocol() -> None:
    for a in ADAPTERS:
        for name in ("name", "path", "buffers", "dispatcher", "label"):
            assert hasattr(a, name), f"{a.name} lacks {name}"
        for name in ("supports", "requirements", "check", "hook"):
            assert callable(getattr(a, name)), f"{a.name}.{name}"
    assert [a.name for a in ADAPTERS] == ["hybridep", "te", "alltoall"]
    assert adapter("te").buffers == {"expert"}
    with pytest.raises(KeyError, match="registered: hybridep, te, alltoall"):
        adapter("deepep")


def test_installation_override_uninstall_restores_instance_and_class_attributes() -> None:
    thing = _Thing()
    thing.own = 1  # type: ignore[attr-defined]
    inst = _installation()
    inst.override(thing, "method", lambda: "hooked")
    inst.override(thing, "own", 2)
    assert thing.method() == "hooked" and thing.own == 2  # type: ignore[attr-defined]
    inst.uninstall()
    assert thing.method() == "class" and thing.own == 1  # type: ignore[attr-defined]
    assert "method" not in vars(thing)
    inst.uninstall()  # idempotent
    assert thing.method() == "class"


def test_shared_patches_stay_until_the_last_installation_uninstalls() -> None:
    undone: list[str] = []
    first, second = _installation(), _installation()
    with first:
        first.activate()
        second.activate()
        core.shared_patch(lambda: undone.append("shared"))
        assert core.shared_patches_applied() and len(core.active_installations()) == 2
    assert undone == [] and core.shared_patches_applied()
    second.uninstall()
    assert undone == ["shared"] and not core.shared_patches_applied() and core.active_installations() == []


def test_adapters_for_gives_each_buffer_to_the_first_supporting_adapter(monkeypatch) -> None:
    from bufreuse.integrations import megatron

    class Fake:
        def __init__(self, name: str, buffers: set[str], ok: bool) -> None:
            self.name, self.buffers, self.ok = name, frozenset(buffers), ok
            self.path, self.dispatcher, self.label = "alltoall", True, name

        def supports(self, layer: object) -> bool:
            return self.ok

    fakes = (Fake("a", {"dispatch"}, True), Fake("b", {"dispatch", "expert"}, True), Fake("c", {"expert"}, True))
    monkeypatch.setattr(megatron, "ADAPTERS", fakes)
    layer, inst = object(), _installation()
    assert [a.name for a in megatron._adapters_for(layer, inst)] == ["a", "b"]  # b takes what a left: expert
    assert inst._owners == {(id(layer), "dispatch"): "a", (id(layer), "expert"): "b"}
    fakes[0].ok = False
    inst = _installation()
    assert [a.name for a in megatron._adapters_for(layer, inst)] == ["b"]
    assert set(inst._owners.values()) == {"b"}


def test_expert_output_writer_row_needs_sequential_mlp_or_te_out() -> None:
    from bufreuse.integrations.features import Features
    from bufreuse.integrations.requirements import check

    on = Features(deepep_output_token=False, deepep_detail="", te_grouped_output=True, te_detail="te out=")
    off = Features(deepep_output_token=False, deepep_detail="", te_grouped_output=False, te_detail="no TE")
    knobs = BufReuseConfig(moe_hybridep_num_expert_output_buffers=2)
    base = {
        "moe_token_dispatcher_type": "alltoall",
        "hidden_size": 8,
        "num_moe_experts": 2,
        "expert_model_parallel_size": 2,
        "overlap_moe_expert_parallel_comm": True,
    }  # fmt: skip  (at EP x ETP = 1, or without EP overlap, the ring is unused: nothing is asked)

    def unmet(cfg: dict, feats: Features) -> dict:
        report = check(cfg, knobs, seq_length=4, micro_batch_size=1, features=feats)
        return {i.key: i.note for i in report.unmet}

    assert "expert_output_writer" not in unmet({**base, "moe_grouped_gemm": False}, off)
    assert "expert_output_writer" not in unmet({**base, "moe_grouped_gemm": True}, on)
    assert unmet({**base, "moe_grouped_gemm": True}, off)["expert_output_writer"] == "no TE"
    assert "expert_output_writer" not in unmet({**base, "moe_grouped_gemm": True, "expert_model_parallel_size": 1}, off)


def test_install_refusals_name_the_field_for_deferred_readers() -> None:
    # EP = 1 configs: the dispatch ring is exercised (production leaves it unused there and refuses nothing)
    ring = {"moe_hybridep_reuse_dispatch_output_buffers": True, "moe_bufreuse_ring_identity_dispatch": True}
    assert not core.install_refusals(
        {"delay_wgrad_compute": True, "cuda_graph_impl": "full_iteration", "num_moe_experts": 1},
        BufReuseConfig(moe_hybridep_reuse_dispatch_output_buffers=True),
        "alltoall",
    )
    knobs = BufReuseConfig(**ring, moe_hybridep_num_dispatch_output_buffers=2)
    got = core.install_refusals(
        {"fine_grained_activation_offloading": True, "offload_modules": ["expert_fc1"], "delay_wgrad_compute": True,
         "cuda_graph_impl": "full_iteration", "num_moe_experts": 1},
        knobs,
        "alltoall",
    )  # fmt: skip
    assert [g.split(":")[0] for g in got] == ["[dispatch/ring] no_expert_input_offload"]
    assert "offload_modules" in got[0]
    graphed = {"delay_wgrad_compute": True, "cuda_graph_impl": "full_iteration", "num_moe_experts": 1}
    got = core.install_refusals(graphed, knobs, "alltoall")
    assert [g.split(":")[0] for g in got] == ["[dispatch/ring] no_graphed_delayed_wgrad"]
    assert "delay_wgrad_compute" in got[0]
    assert not core.install_refusals({"delay_wgrad_compute": True, "num_moe_experts": 1}, knobs, "alltoall")
    assert core.install_refusals({"overlap_dispatch_backward_with_experts_wgrad": True, "cuda_graph_impl": "local"},
                                 knobs, "hybridep")  # fmt: skip
    control = BufReuseConfig(**ring, moe_bufreuse_dispatch_policy="record-stream")
    assert not core.install_refusals(graphed, control, "alltoall")  # allocator keeps it alive


def test_core_and_requirements_import_without_torch_or_megatron() -> None:
    code = (
        "import sys, bufreuse.integrations.requirements, bufreuse.integrations.megatron; "
        "bad = [m for m in ('torch', 'megatron') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
