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
