"""The schedule harness, GPU half: the ``local`` and real-TE ``te`` rows of ``schedule_harness.ROWS`` on one GPU.

Real megatron-core 0.19.2 ``MoELayer`` called as a module (router, dropless all-to-all dispatcher at
EP = 1, ``layer(x)``); ``te`` rows use ``get_gpt_layer_with_transformer_engine_spec`` (``TEGroupedMLP``
over TE's ``GroupedLinear``, non-fused on Hopper: the expert ring goes through ``out=``). FP8 rows
run the forward in megatron's ``get_fp8_context`` (``hybrid``; ``delayed`` / ``tensorwise`` =
current scaling). Recompute rows set ``recompute_granularity='selective'`` + ``recompute_modules=['moe']``
(megatron's own checkpoint). The control and the ring run each get a freshly built layer from the
same seeds (FP8 scaling state would otherwise carry over from one run to the other). Every row's
outcome ("bit-equal", or the error it raised) goes to ``$OUT/megatron-gpu-summary.json`` under
``harness`` (with each ring's release rule and its observed deferred releases, which must agree:
``Installation.release_check``), with the hooked sites' allocation count after warm-up on the real-TE path under
``harness_te_allocations``. Run with scripts/gpu-tests.sh (``BUFREUSE_REQUIRE_TE=1``).
"""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from megatron_cpu import install_exercising_rings as install  # noqa: E402  (EP = 1: see its docstring)
from schedule_harness import (  # noqa: E402
    MODES,
    ORDERS,
    Row,
    alloc_stacks,
    compare,
    control_is_deterministic,
    dispatch_stage_allocs,
    guard,
    layer_allocs,
    mode_env,
    rows_for,
    write_summary,
)

from bufreuse.config import BufReuseConfig  # noqa: E402
from bufreuse.errors import ConfigError  # noqa: E402
from bufreuse.integrations.requirements import validate  # noqa: E402
from bufreuse.pool import BufferPool, EarlyReuseError  # noqa: E402

pytestmark = pytest.mark.gpu
SEQ, MBS, HIDDEN, FFN = 256, 2, 512, 1024
TOKENS = SEQ * MBS
RESULTS: dict[str, dict] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def parallel():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    ps.destroy_model_parallel()
    write_summary("harness", RESULTS)


def _params(row: Row) -> dict:
    topk = 1 if row.probs_on_input else min(2, row.experts)
    kw: dict = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=8,
        num_moe_experts=row.experts,
        moe_router_topk=topk,
        moe_router_pre_softmax=topk == 1,
        moe_token_dispatcher_type="alltoall",
        moe_apply_probs_on_input=row.probs_on_input,
        moe_grouped_gemm=row.spec == "te",
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    if row.recompute:
        kw.update(recompute_granularity="selective", recompute_modules=["moe"])
    if row.fp8:
        kw.update(fp8="hybrid", fp8_recipe={"delayed": "delayed", "current": "tensorwise"}[row.fp8])
    if row.delayed_wgrad == "overlap_dispatch_backward_with_experts_wgrad":
        kw[row.delayed_wgrad] = True  # constructible at EP = 1 with TE
    return kw


def build_layer(row: Row):
    """A fresh layer for ``row`` from fixed seeds (control and ring runs get identical ones)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(**_params(row))
    if row.spec == "te":
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=row.experts, moe_grouped_gemm=True)
    else:
        spec = get_gpt_layer_local_spec(num_experts=row.experts, moe_grouped_gemm=False)
    if row.delayed_wgrad == "delay_wgrad_compute":
        # megatron's config check wants EP overlap (EP > 1) for it; set after the check, before the TE
        # modules are built (TEGroupedLinear hands it to TE's GroupedLinear at construction)
        cfg.delay_wgrad_compute = True
    if "graphs" in row.tags:
        cfg.cuda_graph_impl = "full_iteration"
    return spec.submodules.mlp(config=cfg).cuda()


def _forward(layer, x):
    if layer.config.fp8:
        from megatron.core.fp8_utils import get_fp8_context

        with get_fp8_context(layer.config):
            return layer(x)[0]
    return layer(x)[0]


def run_order(layer, xs: list, order: str) -> tuple[list, list, dict]:
    layer.zero_grad(set_to_none=True)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    outs: dict[int, torch.Tensor] = {}
    for step in ORDERS[order]:
        i = int(step[1:])
        if step[0] == "F":
            outs[i] = _forward(layer, leaves[i])
        elif step[0] == "W":
            layer.backward_dw()  # delayed weight gradients of microbatch i
        else:
            g = torch.Generator(device="cuda").manual_seed(100 + i)
            outs[i].backward(torch.randn(outs[i].shape, device="cuda", dtype=outs[i].dtype, generator=g))
    torch.cuda.synchronize()
    params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return [outs[i].detach() for i in sorted(outs)], [x.grad for x in leaves], params


def _inputs(n: int = 4) -> list:
    g = torch.Generator(device="cuda").manual_seed(7)
    return [torch.randn(SEQ, MBS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(n)]


def _knobs(row: Row) -> BufReuseConfig:
    """Both rings at the row's depth, exercised at EP = 1 (validate() and install() read the same knobs)."""
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=row.depth,
        moe_hybridep_num_expert_output_buffers=row.depth,
        moe_bufreuse_ring_identity_dispatch=True,
        moe_bufreuse_ring_single_rank_expert=True,
    )


def _row_marks(row: Row) -> list:
    return [pytest.mark.te] if row.spec == "te" else []


GPU_ROWS = [pytest.param(r, id=r.name, marks=_row_marks(r)) for r in rows_for("local", "te")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("row", GPU_ROWS)
def test_schedule_row_matches_control_or_is_refused_by_name_gpu(parallel, row: Row, mode: str) -> None:
    key = f"{row.name}/{mode}"
    RESULTS[key] = {"expect": row.expect, "outcome": "not run"}
    knobs, xs = _knobs(row), _inputs()
    if row.expect.startswith("refused:"):
        layer = build_layer(row)
        with pytest.raises(ConfigError, match=row.expect.split(":", 1)[1]) as e:
            validate(layer.config, knobs, seq_length=SEQ, micro_batch_size=MBS)
        assert row.delayed_wgrad in str(e.value)
        with pytest.raises(ConfigError, match=row.delayed_wgrad):
            install(layer, BufferPool("cuda"), knobs, tokens=TOKENS)
        RESULTS[key]["outcome"] = f"refused: {e.value}"
        return
    ref = run_order(build_layer(row), xs, row.order)
    control_is_deterministic(row.name, mode, ref, run_order(build_layer(row), xs, row.order))
    layer = build_layer(row)
    with mode_env(mode):
        pool = BufferPool("cuda")
        assert pool.debug is (mode == "debug")
        try:
            with install(layer, pool, knobs, tokens=TOKENS) as inst, guard(pool, mode):
                got = run_order(layer, xs, row.order)
        except EarlyReuseError as e:
            RESULTS[key]["outcome"] = f"EarlyReuseError: {e}"
            pool.reset()
            assert row.expect.startswith("early-reuse:"), f"[{key}] unexpected {e}"
            assert f"to at least {row.expect.split(':', 1)[1]}" in str(e), str(e)
            return
        except Exception as e:
            RESULTS[key]["outcome"] = f"{type(e).__name__}: {e}"
            raise
    assert not row.expect.startswith("early-reuse:"), f"[{key}] expected an EarlyReuseError, the run finished"
    problems = compare(row.name, mode, ref, got)
    stats = {k: dataclasses.asdict(v) for k, v in pool.stats().items()}
    disagreements = inst.release_check()
    release = {
        name: {
            "rule": rule.point.value,
            "recompute": rule.recompute,
            "reason": rule.reason,
            "deferred": stats[name]["deferred_releases"],
            "acquisitions": stats[name]["acquisitions"],
        }
        for name, rule in inst.expected_release.items()
    }
    RESULTS[key].update(
        outcome=problems or "bit-equal",
        stats=stats,
        release=release,
        release_disagreements=[str(d) for d in disagreements],
    )
    assert not problems, "\n".join(problems)
    mult = 2 if row.recompute else 1
    for name, s in pool.stats().items():
        assert s.acquisitions == s.releases == mult * len(xs), (key, name, s)
    # The observed release (by fact) agrees with the planner's rule (bufreuse.plan.rules).
    assert set(inst.expected_release) == set(stats)
    assert not disagreements, "\n".join(map(str, disagreements))


def _fc2_call_lines() -> set[int]:
    """Lines of megatron's ``TEGroupedMLP.forward`` that call ``linear_fc2`` (FC1 and the backward dgrads
    go through TE's ``_validate_or_alloc_output`` too; only the FC2 forward output is the ring's)."""
    import inspect

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    lines, start = inspect.getsourcelines(TEGroupedMLP.forward)
    found = {start + i for i, text in enumerate(lines) if "self.linear_fc2)(" in text or "self.linear_fc2(" in text}
    assert found, "megatron's TEGroupedMLP.forward no longer calls linear_fc2 visibly; update the probe"
    return found


def _count_fc2_forward(stacks: list[list[tuple[str, str, int]]], fc2_lines: set[int]) -> int:
    def hit(st: list[tuple[str, str, int]]) -> bool:
        te_alloc = any(f.endswith("grouped_linear.py") and n == "_validate_or_alloc_output" for f, n, _ in st)
        at_fc2 = any(f.endswith("moe/experts.py") and n == "forward" and ln in fc2_lines for f, n, ln in st)
        return te_alloc and at_fc2

    return sum(1 for st in stacks if hit(st))


@pytest.mark.te
@pytest.mark.parametrize("fp8", [None, "delayed"])
def test_real_te_hooked_sites_allocate_nothing_after_warmup(parallel, fp8: str | None) -> None:
    """TE's FC2 output (``_validate_or_alloc_output`` under megatron's FC2 call) allocates 0 times with rings;
    the dispatch stage allocates no more than the control's. Counted at megatron's and TE's frames, with the
    control's count first (positive control), never by bufreuse's own function names."""
    row = Row(name=f"te-e8-alloc-{fp8 or 'bf16'}", spec="te", experts=8, order="1f1b", dtype="bfloat16", fp8=fp8)
    fc2_lines = _fc2_call_lines()
    mem, xs = torch.cuda.memory, _inputs()
    layer = build_layer(row)

    def recorded() -> list:
        mem._record_memory_history(max_entries=200_000)
        try:
            run_order(layer, xs, row.order)
            return alloc_stacks(mem._snapshot())
        finally:
            mem._record_memory_history(enabled=None)

    run_order(layer, xs, row.order)  # control warm-up
    control = recorded()
    pool = BufferPool("cuda", debug=False)
    with install(layer, pool, _knobs(row), tokens=TOKENS):
        run_order(layer, xs, row.order)  # warm-up with rings
        before = {k: v.acquisitions for k, v in pool.stats().items()}
        ring = recorded()
        hooked = {k for k, v in pool.stats().items() if v.acquisitions > before.get(k, 0)}
    fc2 = layer.experts.linear_fc2
    counts = {
        "control_te_fc2_output": _count_fc2_forward(control, fc2_lines),
        "ring_te_fc2_output": _count_fc2_forward(ring, fc2_lines),
        "control_dispatch_stage": dispatch_stage_allocs(control),
        "ring_dispatch_stage": dispatch_stage_allocs(ring),
        "ring_layer_total": layer_allocs(ring),
        "hooked": sorted(hooked),
    }
    write_summary(f"harness_te_allocations_{fp8 or 'bf16'}", {**counts, "fc2_class": type(fc2).__name__})
    forwards = sum(1 for step in ORDERS[row.order] if step[0] == "F")
    assert counts["control_te_fc2_output"] >= forwards, counts  # the probe sees TE allocate each FC2 output
    assert counts["ring_layer_total"] > 0, counts  # the recording ran during the ring arm
    assert "expert_fc2_output" in hooked, counts  # TE's FC2 output is a ring here
    assert counts["ring_te_fc2_output"] == 0, counts
    if "dispatch_output" in hooked:  # EP = 1: the all-to-all returns its input; the hook must add nothing
        assert counts["ring_dispatch_stage"] <= counts["control_dispatch_stage"], counts
