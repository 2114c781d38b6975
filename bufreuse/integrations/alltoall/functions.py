"""The NCCL all-to-all path: dispatch output and expert FC2 output written into pool buffers.

Two autograd Functions do the writing; the layer hooks in
:mod:`bufreuse.integrations.alltoall.hooks` decide where each buffer is released:

- :class:`RingAllToAll` runs ``all_to_all_single`` straight into a dispatch slot (at EP = 1 the
  upstream all-to-all is an identity, so the slot is filled by one copy; this proves the hooks,
  not the memory effect). Backward is the reverse all-to-all into a normal allocation.
- :class:`CatIntoRing` concatenates the per-expert FC2 outputs into an expert-output slot
  (replacing ``torch.cat``, which allocated the same bytes). Backward splits the gradient.

Neither saves its output, and neither releases: the layer hooks release each slot after its last
forward reader with ``Held.release`` (``pool.release_when_unsaved``), which waits for whatever a
consumer saved from it. Costs: one pool acquire/release pair per buffer per layer call.
"""

from __future__ import annotations

from typing import Any

import torch

from bufreuse.integrations.core import Held, acquire_with_hint
from bufreuse.pool import BufferPool

__all__ = ["CatIntoRing", "RingAllToAll"]


def _splits(x: Any) -> list[int] | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in list(x)]


class RingAllToAll(torch.autograd.Function):
    """All-to-all whose output is a pool buffer; the :class:`Held` goes to ``box[0]``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        inp: torch.Tensor,
        pool: BufferPool,
        name: str,
        group: Any,
        output_splits: Any,
        input_splits: Any,
        use_nccl_stream: bool,
        box: list,
    ) -> torch.Tensor:
        out_splits, in_splits = _splits(output_splits), _splits(input_splits)
        world = group.size() if group is not None else 1
        rows = sum(out_splits) if out_splits is not None else inp.shape[0]
        slot = acquire_with_hint(pool, name, (rows, *inp.shape[1:]), inp.dtype)
        if world == 1:
            slot.copy_(inp)
        else:
            work = torch.distributed.all_to_all_single(
                slot,
                inp.contiguous(),
                output_split_sizes=out_splits,
                input_split_sizes=in_splits,
                group=group,
                async_op=use_nccl_stream,
            )
            if use_nccl_stream:
                work.wait()
        box.append(Held(pool=pool, name=name, tensor=slot))
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.world = group, out_splits, in_splits, world
        return slot

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.world == 1:
            grad_in = grad
        else:
            grad = grad.contiguous()
            rows = sum(ctx.in_splits) if ctx.in_splits is not None else grad.shape[0]
            grad_in = grad.new_empty((rows, *grad.shape[1:]))
            torch.distributed.all_to_all_single(
                grad_in, grad, output_split_sizes=ctx.in_splits, input_split_sizes=ctx.out_splits, group=ctx.group
            )
        return grad_in, None, None, None, None, None, None, None


class CatIntoRing(torch.autograd.Function):
    """``torch.cat(parts, dim=0)`` written into a pool buffer; the :class:`Held` goes to ``box[0]``."""

    @staticmethod
    def forward(ctx: Any, pool: BufferPool, name: str, box: list, *parts: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = sum(p.shape[0] for p in parts)
        slot = acquire_with_hint(pool, name, (rows, *parts[0].shape[1:]), parts[0].dtype)
        torch.cat(parts, dim=0, out=slot)
        box.append(Held(pool=pool, name=name, tensor=slot))
        ctx.sizes = [p.shape[0] for p in parts]
        return slot

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return (None, None, None, *torch.split(grad, ctx.sizes, dim=0))
