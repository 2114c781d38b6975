"""CUDA-graph phases on the NCCL ring path (CPU: the pool's phase state machine runs on CPU tensors).

The GPU suite (tests/test_megatron_gpu.py) captures and replays a real ``MoELayer`` iteration through
megatron-core's own ``FullCudaGraphWrapper``; here the phase logic is checked call by call: a real
``BufferPool`` on CPU, and for the wrapper logic a stand-in class with ``FullCudaGraphWrapper``'s
protocol (``curr_iter``, ``cuda_graph_warmup_steps``, class-level ``cuda_graph``), since megatron's
class creates CUDA streams in its constructor.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

torch = pytest.importorskip("torch")

from bufreuse.integrations.graphs import GraphPhases, capture_iteration, pools_of, wrap_full_iteration_call  # noqa: E402
from bufreuse.pool import BufferPool, CaptureStateError, Phase  # noqa: E402

ROWS, HIDDEN = 8, 4


def _pool(policy: str = "ring") -> BufferPool:
    pool = BufferPool("cpu")
    slots = 2 if policy == "ring" else 0
    pool.register("dispatch_output", policy=policy, num_slots=slots, max_shape=(ROWS, HIDDEN), dtype=torch.float32)
    return pool


def _step(pool: BufferPool, seen: list) -> None:
    """One iteration: two microbatches, each slot released by its final reader."""
    for _ in range(2):
        t = pool.acquire("dispatch_output", (ROWS, HIDDEN))
        seen.append((pool.phase, pool.get("dispatch_output").stats.acquisitions))
        pool.release("dispatch_output", t)


def test_capture_iteration_runs_the_pool_phases_in_order() -> None:
    pool = _pool()
    seen: list = []
    _step(pool, seen)
    ring = pool.get("dispatch_output")
    assert ring.cursor == 0 and ring.stats.acquisitions == 2  # two slots, wrapped round once
    _step(pool, seen)
    phases = GraphPhases(pool)
    with capture_iteration(pool) as cm:
        assert cm.pools == [pool] and pool.phase is Phase.CAPTURING and ring.cursor == 0
        _step(pool, seen)
    assert pool.phase is Phase.GRAPHED
    with pytest.raises(CaptureStateError, match="after_replay"):
        pool.acquire("dispatch_output")  # eager use after replays without before_eager is refused
    phases.before_replay()  # graphed, no eager use since: nothing to order
    assert pool.phase is Phase.GRAPHED
    phases.before_eager()
    assert pool.phase is Phase.EAGER
    _step(pool, seen)
    phases.before_replay()  # eager use since the capture: the replay stream waits on those releases
    assert pool.phase is Phase.GRAPHED


def test_capture_refuses_held_slot_and_abort_returns_to_eager() -> None:
    pool = _pool()
    held = pool.acquire("dispatch_output")
    with pytest.raises(CaptureStateError, match="held"), capture_iteration(pool):
        pass
    pool.release("dispatch_output", held)
    with pytest.raises(CaptureStateError, match="at the end of a captured iteration"), capture_iteration(pool):
        pool.acquire("dispatch_output")  # a captured iteration that keeps a slot
    assert pool.phase is Phase.EAGER
    with pytest.raises(RuntimeError, match="boom"), capture_iteration(pool):
        pool.acquire("dispatch_output")
        raise RuntimeError("boom")
    assert pool.phase is Phase.EAGER and pool.get("dispatch_output").held == 0


def test_check_boundary_names_the_held_buffer() -> None:
    pool = _pool("stream-ordered")
    t = pool.acquire("dispatch_output", (ROWS, HIDDEN))
    with pytest.raises(CaptureStateError, match="'dispatch_output': 1 acquisition"):
        GraphPhases(pool).check_boundary("after an eager iteration")
    pool.release("dispatch_output", t)
    GraphPhases(pool).check_boundary("after an eager iteration")


def test_pools_of_dedupes_installations_sharing_a_pool() -> None:
    class Inst:
        def __init__(self, pool: BufferPool) -> None:
            self.pool = pool

    a, b = _pool(), _pool()
    assert pools_of([Inst(a), Inst(a), b]) == [a, b]
    with pytest.raises(TypeError):
        pools_of(3)


class _Wrapper:
    """FullCudaGraphWrapper's protocol: eager warm-up calls, a capture call that also replays, replays."""

    cuda_graph: ClassVar[dict] = {"training": None, "validation": None}
    curr_iteration: ClassVar[dict] = {"training": 0, "validation": 0}

    def __init__(self, pool: BufferPool, seen: list, warmup: int) -> None:
        self.pool, self.seen, self.cuda_graph_warmup_steps = pool, seen, warmup

    def curr_iter(self, stage: str) -> int:
        return type(self).curr_iteration[stage]

    def __call__(self, **kwargs):
        stage = "validation" if kwargs["forward_only"] else "training"
        if self.curr_iter(stage) == self.cuda_graph_warmup_steps:
            _step(self.pool, self.seen)  # "capture": the pool is in its capture phase here
            type(self).cuda_graph[stage] = "graph"
            self.seen.append(("replay", stage))
        elif type(self).cuda_graph[stage] is None:
            _step(self.pool, self.seen)
        else:
            self.seen.append(("replay", stage))
        type(self).curr_iteration[stage] += 1


def test_full_iteration_wrapper_logic_training_and_validation() -> None:
    pool = _pool()
    seen: list = []
    _Wrapper.cuda_graph = {"training": None, "validation": None}
    _Wrapper.curr_iteration = {"training": 0, "validation": 0}
    call = wrap_full_iteration_call(_Wrapper.__call__, lambda: [pool], lambda: None)
    w = _Wrapper(pool, seen, warmup=1)
    train, val = {"forward_only": False}, {"forward_only": True}
    call(w, **train)  # eager warm-up
    call(w, **train)  # capture + first replay
    assert pool.phase is Phase.GRAPHED
    call(w, **train)  # replay
    call(w, **val)  # eager validation after training replays: after_replay first
    assert pool.phase is Phase.EAGER
    call(w, **train)  # replay after eager use: ordered after its releases, back to graphed
    assert pool.phase is Phase.GRAPHED
    call(w, **val)  # validation capture from the graphed phase
    call(w, **val)
    phases = [p for p, _ in seen if isinstance(p, Phase)]
    assert phases == [Phase.EAGER] * 2 + [Phase.CAPTURING] * 2 + [Phase.EAGER] * 2 + [Phase.CAPTURING] * 2
    assert seen.count(("replay", "training")) == 3 and seen.count(("replay", "validation")) == 2
    untouched = wrap_full_iteration_call(_Wrapper.__call__, lambda: [], lambda: None)
    untouched(w, **train)  # no live installation: the original runs as is
    assert pool.phase is Phase.GRAPHED


def test_full_iteration_wrapper_refuses_a_slot_left_held() -> None:
    pool = _pool()
    _Wrapper.cuda_graph = {"training": None, "validation": None}
    _Wrapper.curr_iteration = {"training": 0, "validation": 0}

    def leaky(self, **kwargs):
        pool.acquire("dispatch_output")

    call = wrap_full_iteration_call(leaky, lambda: [pool], lambda: None)
    with pytest.raises(CaptureStateError, match="after an eager iteration"):
        call(_Wrapper(pool, [], warmup=1), forward_only=False)


@pytest.fixture
def cpu_layer():
    """A real megatron-core MoELayer on CPU (gloo, world size 1, pad-to-capacity, full-iteration graphs)."""
    pytest.importorskip("megatron.core")
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D
    from megatron.core.transformer.transformer_config import TransformerConfig

    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    old = D.cuda_dtoh_stream
    D.cuda_dtoh_stream = object()  # construction would create a CUDA stream; unused in pad mode
    cfg = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_moe_experts=4,
        moe_router_topk=2, moe_token_dispatcher_type="alltoall", use_cpu_initialization=True,
        add_bias_linear=False, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
        cuda_graph_impl="full_iteration",
    )  # fmt: skip
    try:
        yield get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False).submodules.mlp(config=cfg)
    finally:
        D.cuda_dtoh_stream = old
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def test_install_wraps_full_iteration_wrapper_and_uninstall_restores(cpu_layer) -> None:
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron_cpu import install_exercising_rings as install

    from bufreuse.config import BufReuseConfig
    from bufreuse.integrations.requirements import validate

    knobs = BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=2,
        moe_hybridep_num_expert_output_buffers=2,
    )
    validate(cpu_layer.config, knobs, seq_length=8, micro_batch_size=2)  # full_iteration + pad: supported
    orig = FullCudaGraphWrapper.__dict__["__call__"]
    pool = BufferPool("cpu")
    with install(cpu_layer, pool, knobs, tokens=16):
        patched = FullCudaGraphWrapper.__dict__["__call__"]
        assert patched is not orig and patched.__wrapped__ is orig
    assert FullCudaGraphWrapper.__dict__["__call__"] is orig
