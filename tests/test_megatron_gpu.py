"""The hooks on a real megatron-core ``MoELayer`` on one GPU (EP = 1; run with scripts/gpu-tests.sh).

At EP = 1 the all-to-all is an identity and everything runs on one stream, so these tests prove
correctness of the hooks, not memory savings (that needs EP > 1, see docs/megatron.md):
identical outputs and gradients with and without rings over interleaved forwards/backwards,
no allocations from the hooked sites after warm-up, the ``ScheduleNode(free_input=True)`` skip,
and a slow consumer on another stream. A JSON summary goes to ``$OUT/megatron-gpu-summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from bufreuse.config import BufReuseConfig  # noqa: E402
from bufreuse.integrations.megatron import install  # noqa: E402
from bufreuse.pool import BufferPool  # noqa: E402

SEQ, MBS, HIDDEN, FFN = 1024, 2, 1024, 2048
TOKENS = SEQ * MBS
SUMMARY: dict = {}
SCHEDULE = ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def parallel():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    ps.destroy_model_parallel()
    out = os.environ.get("OUT")
    if out:
        Path(out, "megatron-gpu-summary.json").write_text(json.dumps(SUMMARY, indent=1, default=str))


def _layer(num_experts: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    topk = min(2, num_experts)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=8,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_router_pre_softmax=topk == 1,
        moe_token_dispatcher_type="alltoall",
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False).submodules.mlp(config=cfg).cuda()


def _inputs(n: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(7)
    return [torch.randn(SEQ, MBS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(n)]


def _run_schedule(layer, xs: list) -> tuple[list, list, dict]:
    """Interleaved 1F1B-like schedule; returns outputs, input grads and parameter grads."""
    layer.zero_grad(set_to_none=True)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    outs: dict[int, object] = {}
    for step in SCHEDULE:
        i = int(step[1:])
        if step[0] == "F":
            outs[i], _ = layer(leaves[i])
        else:
            g = torch.Generator(device="cuda").manual_seed(100 + i)
            outs[i].backward(torch.randn(outs[i].shape, device="cuda", dtype=outs[i].dtype, generator=g))
    torch.cuda.synchronize()
    params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return [outs[i].detach() for i in range(len(xs))], [x.grad for x in leaves], params


def _max_diff(a: list, b: list) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def _knobs(slots: int) -> BufReuseConfig:
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=slots,
        moe_hybridep_num_expert_output_buffers=slots,
    )


@pytest.mark.parametrize("num_experts", [8, 1])
def test_rings_match_control_interleaved_microbatches(parallel, num_experts: int) -> None:
    layer = _layer(num_experts)
    xs = _inputs(4)
    ref = _run_schedule(layer, xs)
    ref2 = _run_schedule(layer, xs)
    tol = max(_max_diff(ref[0], ref2[0]), _max_diff(ref[1], ref2[1]))
    pool = BufferPool("cuda")
    with install(layer, pool, _knobs(3), tokens=TOKENS), pool.autograd_guard():
        got = _run_schedule(layer, xs)
    diffs = {
        "out": _max_diff(ref[0], got[0]),
        "input_grad": _max_diff(ref[1], got[1]),
        "param_grad": _max_diff(list(ref[2].values()), [got[2][k] for k in ref[2]]),
    }
    stats = {k: dataclasses.asdict(v) for k, v in pool.stats().items()}
    SUMMARY[f"match_{num_experts}_experts"] = {"control_run_to_run": tol, "ring_vs_control": diffs, "stats": stats}
    assert set(got[2]) == set(ref[2])
    assert all(d <= tol for d in diffs.values()), (diffs, tol)
    for name, s in pool.stats().items():
        assert s.acquisitions == len(xs) and s.releases == len(xs), (name, s)
    peaks = {k: v.peak_held for k, v in pool.stats().items()}
    if num_experts == 1:  # the bf16 expert GEMM and the unpermute save the slots: held until backward
        assert peaks == {"dispatch_output": 2, "expert_fc2_output": 2}
    else:  # the local-expert sorts copy: both slots released in forward
        assert peaks == {"dispatch_output": 1, "expert_fc2_output": 1}


def _alloc_frames(snapshot: dict) -> list[list[str]]:
    out = []
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["action"] == "alloc":
                out.append([f"{f['filename']}:{f['name']}" for f in e.get("frames", [])])
    return out


def _allocs_at(frames: list[list[str]], needles: tuple[str, ...]) -> int:
    return sum(1 for stack in frames if any(n in f for f in stack for n in needles))


def test_hooked_sites_allocate_nothing_after_warmup(parallel) -> None:
    layer = _layer(8)
    xs = _inputs(4)
    mem = torch.cuda.memory
    _run_schedule(layer, xs)  # control warm-up
    mem._record_memory_history(max_entries=200_000)
    _run_schedule(layer, xs)
    control = _alloc_frames(mem._snapshot())
    mem._record_memory_history(enabled=None)
    pool = BufferPool("cuda")
    with install(layer, pool, _knobs(2), tokens=TOKENS):
        _run_schedule(layer, xs)  # warm-up with rings
        mem._record_memory_history(max_entries=200_000)
        _run_schedule(layer, xs)
        ring = _alloc_frames(mem._snapshot())
        mem._record_memory_history(enabled=None)
    control_cat = _allocs_at(control, ("experts.py:forward",))
    hooked = _allocs_at(ring, ("alltoall.py:forward",))
    SUMMARY["allocations"] = {"control_experts_forward": control_cat, "ring_hooked_sites": hooked}
    assert control_cat > 0, "the probe sees the control's expert-output allocations"
    assert hooked == 0


def test_schedule_node_free_input_skips_ring_storage(parallel) -> None:
    from megatron.core.pipeline_parallel.utils import ScheduleNode

    layer = _layer(8)

    def node() -> ScheduleNode:
        return ScheduleNode(lambda t: t * 2, torch.cuda.current_stream(), torch.cuda.Event(), free_input=True)

    pool = BufferPool("cuda")
    with install(layer, pool, _knobs(2), tokens=TOKENS):
        slot = pool.acquire("dispatch_output", (16, HIDDEN))
        slot.fill_(1)
        plain = torch.ones(16, HIDDEN, device="cuda", dtype=torch.bfloat16)
        out = node().forward((slot,))
        node().forward((plain,))
        torch.cuda.synchronize()
        kept = slot.untyped_storage().size()
        assert kept > 0 and bool((slot == 1).all()) and bool((out == 2).all())
        assert plain.untyped_storage().size() == 0
        pool.release("dispatch_output", slot)
    throwaway = BufferPool("cuda")
    throwaway.register("dispatch_output", policy="ring", num_slots=1, max_shape=(16, HIDDEN), dtype=torch.bfloat16)
    victim = throwaway.acquire("dispatch_output")
    node().forward((victim,))  # hooks uninstalled: megatron frees the ring storage
    SUMMARY["schedule_node"] = {"kept_bytes": kept, "freed_without_hooks": victim.untyped_storage().size() == 0}
    assert victim.untyped_storage().size() == 0


def test_slow_consumer_on_other_stream_still_matches(parallel, monkeypatch) -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    layer = _layer(8)
    xs = _inputs(4)
    with torch.no_grad():
        ref = [layer(x)[0] for x in xs]
        tol = _max_diff(ref, [layer(x)[0] for x in xs])
    for name in ("dispatch_postprocess", "combine_preprocess"):
        orig = getattr(D, name)

        def slow(self, *a, _orig=orig, **k):
            torch.cuda._sleep(20_000_000)  # ~10 ms on the consumer's stream before the final read
            return _orig(self, *a, **k)

        monkeypatch.setattr(D, name, slow)
    pool = BufferPool("cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    main = torch.cuda.current_stream()
    got = []
    with install(layer, pool, _knobs(1), tokens=TOKENS), torch.no_grad():
        for i, x in enumerate(xs):
            s = streams[i % 2]
            s.wait_stream(main)
            with torch.cuda.stream(s):
                got.append(layer(x)[0])
        for s in streams:
            main.wait_stream(s)
    torch.cuda.synchronize()
    diff = _max_diff(ref, got)
    waits = {k: v.gpu_waits for k, v in pool.stats().items()}
    SUMMARY["slow_consumer"] = {"max_diff": diff, "control_run_to_run": tol, "gpu_waits": waits}
    assert diff <= tol
    assert pool.stats()["dispatch_output"].gpu_waits >= 1
