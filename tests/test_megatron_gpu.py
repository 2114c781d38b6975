"""The hooks on a real megatron-core ``MoELayer`` on one GPU (EP = 1; run with scripts/gpu-tests.sh).

At EP = 1 the all-to-all is an identity and everything runs on one stream, so these tests prove
correctness of the hooks, not memory savings (that needs EP > 1, see docs/megatron.md):
identical outputs and gradients with and without rings over interleaved forwards/backwards,
no allocations from the hooked sites after warm-up, the ``ScheduleNode(free_input=True)`` skip,
a slow consumer on another stream, and full-iteration CUDA graphs (megatron-core's own
``FullCudaGraphWrapper`` as patched by ``install``, and a plain ``torch.cuda.graph`` loop with
``capture_iteration``): replays and eager iterations after them equal the eager control.
A JSON summary goes to ``$OUT/megatron-gpu-summary.json``.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from megatron_cpu import install_exercising_rings as install  # noqa: E402  (EP = 1: see its docstring)
from schedule_harness import (  # noqa: E402
    MODES,
    alloc_stacks,
    compare,
    control_is_deterministic,
    dispatch_stage_allocs,
    expert_output_allocs,
    guard,
    layer_allocs,
    mode_env,
    write_summary,
)

from bufreuse.config import BufReuseConfig  # noqa: E402
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
    for key, value in SUMMARY.items():
        write_summary(key, value)


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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_experts", [8, 1])
def test_rings_match_control_interleaved_microbatches(parallel, num_experts: int, mode: str) -> None:
    """Issue 13's schedule F0 F1 B0 F2 B1 F3 B2 B3 with 3 slots, production mode (no guard) and debug mode."""
    layer = _layer(num_experts)
    xs = _inputs(4)
    ref = _run_schedule(layer, xs)
    ref2 = _run_schedule(layer, xs)
    tol = max(_max_diff(ref[0], ref2[0]), _max_diff(ref[1], ref2[1]))
    with mode_env(mode):
        pool = BufferPool("cuda")
        assert pool.debug is (mode == "debug")
        with install(layer, pool, _knobs(3), tokens=TOKENS), guard(pool, mode):
            got = _run_schedule(layer, xs)
    diffs = {
        "out": _max_diff(ref[0], got[0]),
        "input_grad": _max_diff(ref[1], got[1]),
        "param_grad": _max_diff(list(ref[2].values()), [got[2][k] for k in ref[2]]),
    }
    stats = {k: dataclasses.asdict(v) for k, v in pool.stats().items()}
    problems = compare(f"match_{num_experts}_experts", mode, ref, got)
    SUMMARY[f"match_{num_experts}_experts_{mode}"] = {
        "control_run_to_run": tol, "ring_vs_control": diffs, "bit_equal": not problems, "stats": stats}  # fmt: skip
    assert set(got[2]) == set(ref[2])
    assert tol == 0.0, f"the control is not deterministic run to run (max diff {tol}); bit-equality cannot be judged"
    control_is_deterministic(f"match_{num_experts}_experts", mode, ref, ref2)  # parameter grads too
    assert not problems, "\n".join(problems)
    for name, s in pool.stats().items():
        assert s.acquisitions == len(xs) and s.releases == len(xs), (name, s)
    peaks = {k: v.peak_held for k, v in pool.stats().items()}
    if num_experts == 1:  # the bf16 expert GEMM and the unpermute save the slots: held until backward
        assert peaks == {"dispatch_output": 2, "expert_fc2_output": 2}
    else:  # the local-expert sorts copy: both slots released in forward
        assert peaks == {"dispatch_output": 1, "expert_fc2_output": 1}


def _recorded(layer, xs) -> list:
    """Allocation stacks of one schedule run (after the caller's warm-up), innermost frame first."""
    mem = torch.cuda.memory
    mem._record_memory_history(max_entries=200_000)
    try:
        _run_schedule(layer, xs)
        return alloc_stacks(mem._snapshot())
    finally:
        mem._record_memory_history(enabled=None)


def test_hooked_sites_allocate_nothing_after_warmup(parallel) -> None:
    """Counted at the sites where the control allocates (megatron's frames), not by bufreuse's function names.

    Positive control first: the same probe counts the control's expert outputs (``SequentialMLP``'s
    ``torch.cat``, one per forward). Then, for each ring the installation acquired from during the recorded
    run, its site allocates nothing. At EP = 1 megatron's all-to-all returns its input, so the control
    allocates nothing under ``MoELayer.dispatch``: there the check is that the hook adds no allocation.
    """
    layer = _layer(8)
    xs = _inputs(4)
    forwards = sum(1 for step in SCHEDULE if step[0] == "F")
    _run_schedule(layer, xs)  # control warm-up
    control = _recorded(layer, xs)
    pool = BufferPool("cuda")
    with install(layer, pool, _knobs(2), tokens=TOKENS):
        _run_schedule(layer, xs)  # warm-up with rings
        before = {k: v.acquisitions for k, v in pool.stats().items()}
        ring = _recorded(layer, xs)
        hooked = {k for k, v in pool.stats().items() if v.acquisitions > before.get(k, 0)}
    counts = {
        "control_expert_output": expert_output_allocs(control),
        "ring_expert_output": expert_output_allocs(ring),
        "control_dispatch_stage": dispatch_stage_allocs(control),
        "ring_dispatch_stage": dispatch_stage_allocs(ring),
        "ring_layer_total": layer_allocs(ring),
        "hooked": sorted(hooked),
    }
    SUMMARY["allocations"] = counts
    assert counts["control_expert_output"] >= forwards, counts  # the probe sees the control's FC2 outputs
    assert counts["ring_layer_total"] > 0, counts  # the recording ran during the ring arm
    assert "expert_fc2_output" in hooked, counts  # SequentialMLP's output is a ring here
    assert counts["ring_expert_output"] == 0, counts
    if "dispatch_output" in hooked:
        assert counts["ring_dispatch_stage"] <= counts["control_dispatch_stage"], counts


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
    assert tol == 0.0, f"the control is not deterministic run to run (max diff {tol}); bit-equality cannot be judged"
    assert diff == 0.0
    assert pool.stats()["dispatch_output"].gpu_waits >= 1


# --- full-iteration CUDA graphs (drop-and-pad: the dropless dispatcher syncs token counts to the host) ---

GRAPH_MICROBATCHES = 2


@pytest.fixture
def graphable_rng(parallel):
    """Megatron's RNG tracker in its graph-safe mode, as its training init sets it for cuda_graph_impl != none."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
    yield
    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def _pad_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=8,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
        cuda_graph_impl="full_iteration",
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    return get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False).submodules.mlp(config=cfg).cuda()


def _iteration_data(n: int, seed: int) -> list[list[dict]]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def t():
        return torch.randn(SEQ, MBS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)

    return [[{"x": t(), "dy": t()} for _ in range(GRAPH_MICROBATCHES)] for _ in range(n)]


def _fwd_bwd(*, model, data_iterator, num_microbatches, seq_length, forward_only):
    """A forward_backward_func for FullCudaGraphWrapper: F0 B0 F1 B1; returns outputs and all grads.

    ``torch.autograd.grad`` returns the gradients (no AccumulateGrad into ``.grad``), so a captured
    iteration's results are graph-owned tensors that every replay rewrites.
    """
    it = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for _ in range(num_microbatches):
        batch = next(it)
        x = batch["x"].detach().requires_grad_(True)
        out, _ = model(x)
        grads = torch.autograd.grad(out, [x, *params], batch["dy"], allow_unused=True)
        results.append([out.detach(), *(g for g in grads if g is not None)])
    return results


def _flat(results) -> list:
    return [t.clone() for mb in results for t in mb]


def _eager(layer, data) -> list:
    return _flat(_fwd_bwd(model=layer, data_iterator=iter(data), num_microbatches=GRAPH_MICROBATCHES,
                          seq_length=SEQ, forward_only=False))  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["ring", "stream-ordered"])
def test_full_iteration_graph_megatron_wrapper_replays_match_eager(graphable_rng, policy: str, mode: str) -> None:
    """megatron-core's FullCudaGraphWrapper (patched by install) captures one iteration; replays and eager match."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader, get_shared_capture_stream

    from bufreuse.integrations.graphs import GraphPhases
    from bufreuse.integrations.requirements import validate
    from bufreuse.pool import Phase

    layer = _pad_layer()
    # As Megatron-LM's DDP set-up does for cuda_graph_impl="full_iteration": each parameter's
    # AccumulateGrad node is created (and kept) on the capture stream, so a node kept alive from an
    # eager iteration does not tie the capture to the legacy default stream (the first H200 run of
    # this test without it failed at capture: cudaErrorStreamCaptureImplicit from AccumulateGrad).
    capture = get_shared_capture_stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        grad_accs = [p.expand_as(p).grad_fn.next_functions[0][0] for p in layer.parameters() if p.requires_grad]
    torch.cuda.current_stream().wait_stream(capture)
    slots = 2  # ring slots; the stream-ordered policy holds none (the knob only switches expert reuse on)
    knobs = BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=slots,
        moe_hybridep_num_expert_output_buffers=slots,
        moe_bufreuse_dispatch_policy=policy,
        moe_bufreuse_expert_policy=policy,
        moe_bufreuse_ring_identity_dispatch=True,  # EP = 1: validate what install_exercising_rings uses
        moe_bufreuse_ring_single_rank_expert=True,
    )
    validate(layer.config, knobs, seq_length=SEQ, micro_batch_size=MBS)
    warmup, iters = 2, 6
    data = _iteration_data(iters + 1, seed=11)
    ref = [_eager(layer, d) for d in data]  # control: eager, no hooks
    tol = _max_diff(ref[0], _eager(layer, data[0]))
    orig_call = FullCudaGraphWrapper.__dict__["__call__"]
    StaticBufferLoader.static_buffers["training"].clear()
    with mode_env(mode):
        pool = BufferPool("cuda")
    wrapper = FullCudaGraphWrapper(_fwd_bwd, cuda_graph_warmup_steps=warmup)
    wrapper.reset_cuda_graph()
    got, phases = [], []
    try:
        with install(layer, pool, knobs, tokens=TOKENS) as inst, guard(pool, mode):
            for d in data[:iters]:
                res = wrapper(model=layer, data_iterator=iter(d), num_microbatches=GRAPH_MICROBATCHES,
                              seq_length=SEQ, forward_only=False)  # fmt: skip
                got.append(_flat(res))
                phases.append(pool.phase.value)
            GraphPhases(inst).before_eager()  # eager again after the replays
            phases.append(pool.phase.value)
            got.append(_eager(layer, data[iters]))
        torch.cuda.synchronize()
    finally:
        wrapper.reset_cuda_graph()
        StaticBufferLoader.static_buffers["training"].clear()
    diffs = [_max_diff(r, g) for r, g in zip(ref, got, strict=True)]
    stats = {k: dataclasses.asdict(v) for k, v in pool.stats().items()}
    SUMMARY[f"full_iteration_graph_{policy}_{mode}"] = {
        "control_run_to_run": tol, "max_diff_per_iteration": diffs, "phases": phases, "stats": stats,
        "captured_at_iteration": warmup, "replays": iters - warmup,
    }  # fmt: skip
    assert grad_accs and FullCudaGraphWrapper.__dict__["__call__"] is orig_call  # uninstall restored it
    assert phases == ["eager"] * warmup + ["graphed"] * (iters - warmup) + ["eager"], phases
    assert pool.phase is Phase.EAGER
    assert tol == 0.0, f"the eager control is not deterministic run to run (max diff {tol})"
    assert all(d == 0.0 for d in diffs), diffs
    # acquisitions happen in eager iterations and once in the capture; replays reuse the baked slots
    calls = (warmup + 1 + 1) * GRAPH_MICROBATCHES
    for name, s in pool.stats().items():
        assert s.acquisitions == s.releases == calls, (name, s)
        if policy == "ring":
            assert s.peak_held <= slots and s.persistent_bytes > 0


@pytest.mark.parametrize("mode", MODES)
def test_full_iteration_graph_own_capture_loop_with_eager_between_replays(graphable_rng, mode: str) -> None:
    """A user's own torch.cuda.graph loop with capture_iteration / GraphPhases: eager use between replays."""
    from bufreuse.integrations.graphs import GraphPhases, capture_iteration

    layer = _pad_layer()
    stream = torch.cuda.Stream()
    # As in the wrapper test (and Megatron-LM's DDP set-up): the AccumulateGrad nodes are created on the
    # capture stream and kept, so a node that an eager iteration keeps alive (the router's aux-loss
    # tracker holds its graph) never ties the capture to the legacy default stream. Without this the
    # H200 failed at capture with cudaErrorStreamCaptureImplicit when this test ran after the others.
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grad_accs = [p.expand_as(p).grad_fn.next_functions[0][0] for p in layer.parameters() if p.requires_grad]
    torch.cuda.current_stream().wait_stream(stream)
    data = _iteration_data(8, seed=23)
    ref = [_eager(layer, d) for d in data]
    tol = _max_diff(ref[0], _eager(layer, data[0]))
    with mode_env(mode):
        pool = BufferPool("cuda")
    static = [{k: v.clone() for k, v in mb.items()} for mb in data[0]]
    graph = torch.cuda.CUDAGraph()
    got: dict[int, list] = {}

    def load(i: int) -> None:
        for dst, src in zip(static, data[i], strict=True):
            for k in dst:
                dst[k].copy_(src[k])

    with install(layer, pool, _knobs(2), tokens=TOKENS) as inst, guard(pool, mode):
        phases = GraphPhases(inst)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in (0, 1):  # eager warm-up on the capture stream
                got[i] = _eager(layer, data[i])
        torch.cuda.current_stream().wait_stream(stream)
        load(2)
        with capture_iteration(inst, stream), torch.cuda.graph(graph, stream=stream):
            out = _fwd_bwd(model=layer, data_iterator=iter(static), num_microbatches=GRAPH_MICROBATCHES,
                           seq_length=SEQ, forward_only=False)  # fmt: skip
        for i in (2, 3, 4):
            load(i)
            phases.replay(graph)
            got[i] = _flat(out)
        phases.before_eager()
        got[5] = _eager(layer, data[5])  # eager between replays
        for i in (6, 7):
            load(i)
            phases.replay(graph)  # ordered after the eager iteration's releases
            got[i] = _flat(out)
        torch.cuda.synchronize()
    diffs = {i: _max_diff(ref[i], got[i]) for i in sorted(got)}
    SUMMARY[f"own_capture_loop_{mode}"] = {"control_run_to_run": tol, "max_diff_per_iteration": diffs, "gpu_waits": {
        k: v.gpu_waits for k, v in pool.stats().items()}}  # fmt: skip
    assert grad_accs and tol == 0.0, f"the eager control is not deterministic run to run (max diff {tol})"
    assert all(d == 0.0 for d in diffs.values()), diffs
