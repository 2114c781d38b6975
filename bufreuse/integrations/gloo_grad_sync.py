"""Megatron's DDP grad sync over gloo: each bucket collective on its own, one handle that waits them all.

megatron-core's ``_ParamAndGradBucketGroup.start_grad_sync`` (and ``start_param_sync`` under the distributed
optimizer) issues its bucket collectives inside ``torch.distributed._coalescing_manager(group, async_ops=...)``.
torch records them there and sends them as one ``allreduce_coalesced`` (``*_coalesced``) call at the end of the
block; gloo has none for CUDA tensors ("unsupported device type cuda"), so a run with
``--distributed-backend gloo`` on the GPU dies at its first step.

:func:`patch_megatron_grad_sync` replaces megatron's module attribute (``param_and_grad_buffer._coalescing_manager``)
with a manager that, for a gloo-backed group only, lets torch record the block's collectives as usual and then
issues each one on its own (``async_op=True``), in order. The handle it yields (:class:`WaitAll`) collects those
works, and its ``wait()`` waits every one: megatron keeps it as ``grad_reduce_handle`` when ``async_ops`` is
set and waits it in ``finish_grad_sync``; a synchronous block waits them before it ends, as torch's does. Any
other group (NCCL) goes to torch's manager untouched. gloo stages CUDA tensors through host memory: step times
of such runs are not NCCL's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from bufreuse.errors import BackendContractError
from bufreuse.integrations import _compat_megatron as compat

__all__ = ["WaitAll", "is_gloo", "patch_megatron_grad_sync", "per_op_manager"]

_ALL_REDUCE = frozenset({"all_reduce"})
_ALL_GATHER = frozenset({"all_gather_single", "all_gather_into_tensor", "_all_gather_base"})
_REDUCE_SCATTER = frozenset({"reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"})


class WaitAll:
    """The handle megatron keeps (``grad_reduce_handle`` / ``param_gather_handle``): ``wait()`` waits every work."""

    def __init__(self) -> None:
        self.works: list[Any] = []

    def append(self, work: Any) -> None:
        if work is not None:
            self.works.append(work)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def is_gloo(group: Any = None) -> bool:
    """Whether every device backend of ``group`` (default: the world) is gloo; False for a group it cannot name."""
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(group))
    except (ValueError, RuntimeError):
        return False
    return {part.rpartition(":")[2] for part in backend.split(",")} == {"gloo"}


def _issue(op: Any, group: Any) -> Any:
    """One recorded collective (torch's ``_CollOp``) issued on its own, ``async_op=True``; its work."""
    import torch.distributed as dist

    name = getattr(op.op, "__name__", repr(op.op))
    if name in _ALL_REDUCE:
        return dist.all_reduce(op.tensor, op=op.redop, group=group, async_op=True)
    if name in _ALL_GATHER:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(op.dst_tensor, op.tensor, group=group, async_op=True)
    if name in _REDUCE_SCATTER:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return scatter(op.dst_tensor, op.tensor, op=op.redop, group=group, async_op=True)
    raise BackendContractError(
        "torch", "_coalescing_manager", f"recorded a {name} collective", hint="bufreuse's gloo grad sync issues "
        "all_reduce, all_gather and reduce_scatter only; run without --distributed-backend gloo"
    )  # fmt: skip


def _per_op(group: Any, async_ops: bool) -> Iterator[WaitAll]:
    """torch's recording (``_world.pg_coalesce_state``), then each recorded collective issued on its own."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    group = group or dist.group.WORLD
    state = c10d._world.pg_coalesce_state
    if state.get(group):
        raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")  # torch's own check
    state[group] = []
    handle = WaitAll()
    try:
        yield handle
    finally:
        ops = state.pop(group, [])
    for op in ops:
        handle.append(_issue(op, group))
    if not async_ops:
        handle.wait()


def per_op_manager(orig: Callable[..., Any]) -> Callable[..., contextlib.AbstractContextManager[Any]]:
    """A ``_coalescing_manager(group, device, async_ops)``: per-op for gloo groups, ``orig`` for any other."""

    @contextlib.contextmanager
    def _coalescing_manager(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator[Any]:
        if not is_gloo(group):
            with orig(group=group, device=device, async_ops=async_ops) as cm:
                yield cm
            return
        yield from _per_op(group, async_ops)

    _coalescing_manager._bufreuse_per_op = True  # type: ignore[attr-defined]
    return _coalescing_manager


def patch_megatron_grad_sync() -> Callable[[], None]:
    """Make megatron-core's DDP bucket collectives run one by one on gloo groups; returns the undo.

    A no-op undo when megatron-core has no such manager or it is patched already.
    """
    undo = compat.patch_grad_sync_coalescing(per_op_manager, marker="_bufreuse_per_op")
    return undo if undo is not None else (lambda: None)
