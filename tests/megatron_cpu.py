"""Test helper: a one-process gloo group with megatron-core's model-parallel state, for CPU tests."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def single_process_model_parallel() -> Iterator[None]:
    """Init a world-size-1 gloo group (if none exists) and TP = PP = 1 state; tear both down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


@contextlib.contextmanager
def cpu_moe_parallel() -> Iterator[None]:
    """:func:`single_process_model_parallel`, with megatron's all-to-all dispatcher built without a CUDA stream.

    ``MoEAlltoAllTokenDispatcher`` creates a device-to-host stream at construction; pad mode never uses it.
    """
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    with single_process_model_parallel():
        old = D.cuda_dtoh_stream
        D.cuda_dtoh_stream = object()
        try:
            yield
        finally:
            D.cuda_dtoh_stream = old


def install_exercising_rings(*args, **kwargs):
    """``install()`` with both rings in use at EP = 1 (``ring_identity_dispatch`` and ``ring_single_rank_expert``).

    These one-process tests exercise the rings' hooks and release rules; in production an EP = 1 dispatch
    is an identity and an EP x ETP = 1 FC2 output never leaves its stream, so neither ring is used there
    (``tests/test_hot_path.py`` checks that).
    """
    from bufreuse.integrations.megatron import install

    kwargs.setdefault("ring_identity_dispatch", True)
    kwargs.setdefault("ring_single_rank_expert", True)
    return install(*args, **kwargs)


def cpu_moe_layer(num_experts: int = 8, dispatcher: str = "alltoall", hidden: int = 32, **config: object):
    """A real megatron-core ``MoELayer`` (local spec, ``SequentialMLP``) at EP = ETP = 1, pad-to-capacity, top-2
    (top-1 with pre-softmax for one expert), seeded; ``config``: more ``TransformerConfig`` fields. Build it
    inside :func:`cpu_moe_parallel`."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    topk = min(2, num_experts)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_router_pre_softmax=topk == 1,
        moe_token_dispatcher_type=dispatcher,
        use_cpu_initialization=True,
        add_bias_linear=False,
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
        **config,
    )
    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False).submodules.mlp(config=cfg)


def moe_forward(layer, x, generator=None):
    """One ``MoELayer`` forward over ``x`` [seq, batch, hidden] with seeded random top-k routing (``generator``,
    default seed 1), the stages called in the module's order."""
    import torch

    g = torch.Generator().manual_seed(1) if generator is None else generator
    n = layer.config.num_moe_experts
    top = torch.softmax(torch.randn(x.shape[0] * x.shape[1], n, generator=g), -1).topk(layer.config.moe_router_topk)
    routing = torch.zeros(top.values.shape[0], n, dtype=torch.bool).scatter(1, top.indices, True)
    probs = torch.zeros(routing.shape).scatter(1, top.indices, top.values)
    h, p = layer.preprocess(x, probs, routing)
    d, p = layer.dispatch(h, p)
    out, _ = layer.routed_experts_compute(d, p)
    return layer.postprocess(layer.combine(out), None)
