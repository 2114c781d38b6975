"""Transformer Engine adapter: the expert FC2 output written into a caller-provided buffer.

Two routes, detected by feature (``bufreuse.integrations.features.te_grouped_output``):

- the op fuser (what megatron-core 0.19.2's ``TEGroupedMLP._fused_forward`` does): the fused ops
  take ``op_kwargs={-1: {OUTPUT_BUFFER_KEY: buffer}}`` (key from
  ``transformer_engine.pytorch.ops.basic.grouped_linear``; -1 is the FC2 basic op);
- the module: ``GroupedLinear.forward(inp, m_splits, ..., out=buffer)`` (TE PR #3161). megatron's
  ``TEGroupedLinear.forward(x, m_splits)`` passes no ``out=``, so the hooked FC2 module is switched to
  a subclass (:func:`routing_class`) whose MRO puts one shim ``forward`` between megatron's class and
  TE's: it acquires the slot and passes it as ``out=`` (:func:`route_into_ring`). Nothing else is
  patched: FC1, other layers and the control run their own classes.

TE needs the buffer with the exact output shape, contiguous, and ``requires_grad=False``: every ring
acquisition is a fresh tensor over its slot's storage that requires no grad (no copy, no extra alias).
TE's torch part needs a CUDA build, so only fakes exercise this here; the H200 runs it with real TE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bufreuse.errors import BackendContractError, ConfigError
from bufreuse.integrations._compat_megatron import te_fused_impl
from bufreuse.integrations.core import Held, dtype_refusal, with_reuse_hint
from bufreuse.integrations.features import accepts_keyword
from bufreuse.pool import EarlyReuseError

__all__ = [
    "FC2_OP_INDEX",
    "ROUTE",
    "Fc2Route",
    "grouped_linear_into",
    "out_route_class",
    "output_alias",
    "output_buffer_op_kwargs",
    "require_fused_output_buffer",
    "route_into_ring",
    "routing_class",
]

FC2_OP_INDEX = -1
"""Basic-op index of FC2 in megatron's fused [fc1, activation, fc2] op sequence."""


def output_alias(buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A detached, contiguous alias of ``buffer`` with exactly ``shape`` (same storage, no copy)."""
    if tuple(buffer.shape) != tuple(shape):
        raise ConfigError(f"TE output buffer has shape {tuple(buffer.shape)}, the FC2 output needs {tuple(shape)}")
    if not buffer.is_contiguous():
        raise ConfigError("TE output buffer must be contiguous (acquire a row-prefix of the ring slot)")
    return buffer.detach()


def output_buffer_op_kwargs(ops_module: Any, buffer: torch.Tensor, shape: tuple[int, ...]) -> dict[int, dict]:
    """``op_kwargs`` routing the fused grouped MLP's FC2 output into ``buffer``."""
    key = getattr(ops_module, "OUTPUT_BUFFER_KEY", None)
    if key is None:
        raise ConfigError("this Transformer Engine has no ops grouped_linear OUTPUT_BUFFER_KEY (needs TE PR #3161)")
    return {FC2_OP_INDEX: {key: output_alias(buffer, shape)}}


def grouped_linear_into(module: Any, inp: torch.Tensor, m_splits: Any, out: torch.Tensor, **kwargs: Any) -> Any:
    """``module(inp, m_splits, out=alias)`` for a TE ``GroupedLinear``; checks the output is ``out``'s storage."""
    if not accepts_keyword(type(module).forward, "out"):
        raise ConfigError(f"{type(module).__name__}.forward takes no out= (needs TE PR #3161)")
    shape = (inp.shape[0], module.out_features)
    result = module(inp, m_splits, out=output_alias(out, shape), **kwargs)
    y = result[0] if isinstance(result, tuple) else result
    if y.data_ptr() != out.data_ptr():
        raise BackendContractError(
            "Transformer Engine", "GroupedLinear.forward", "ignored out= (returned other storage)"
        )
    return result


def require_fused_output_buffer(experts: Any, experts_module: Any) -> None:
    """Fail early, naming what is missing, unless ``experts`` can write FC2 into a caller buffer.

    ``experts`` is megatron-core's ``TEGroupedMLP`` (its op-fuser ``_fused_forward`` takes
    ``output_buffer=`` and routes it as ``op_kwargs[-1][OUTPUT_BUFFER_KEY]``); ``experts_module`` is
    ``megatron.core.transformer.moe.experts``, whose ``OUTPUT_BUFFER_KEY`` is None unless the
    installed TE exports it. Checked by signature and importable key, never by version.
    """
    missing = []
    if not accepts_keyword(type(experts).forward, "output_buffer"):
        missing.append(f"{type(experts).__name__}.forward(output_buffer=) (megatron-core 0.19 TEGroupedMLP)")
    elif not te_fused_impl(experts):
        missing.append("the TE op-fuser grouped MLP (use_transformer_engine_op_fuser=True, a TE that fuses it)")
    if getattr(experts_module, "OUTPUT_BUFFER_KEY", None) is None:
        missing.append("Transformer Engine ops grouped_linear OUTPUT_BUFFER_KEY (TE PR #3161)")
    if missing:
        raise ConfigError("expert-output reuse needs " + "; ".join(missing))


ROUTE = "_bufreuse_fc2_route"
"""Instance attribute of a hooked FC2 module: its :class:`Fc2Route` (what the routing class's forward reads)."""

_ROUTING: dict[type, type] = {}
"""FC2 module class -> its routing subclass (made once per class)."""


def out_route_class(cls: type) -> type | None:
    """The first class in ``cls``'s MRO whose own ``forward`` takes ``out=`` (TE's ``GroupedLinear``), or None."""
    for klass in cls.__mro__:
        fn = vars(klass).get("forward")
        if fn is not None and accepts_keyword(fn, "out"):
            return klass
    return None


class Fc2Route:
    """One hooked FC2 module's state: where its output goes (a ring slot) and where the slot is queued."""

    __slots__ = ("cols", "dtype", "entry", "name", "pool", "queue", "row_bytes", "te_forward")

    def __init__(self, pool: Any, name: str, cols: int, queue: Any, te_forward: Callable[..., Any]) -> None:
        self.pool = pool
        self.name = name
        self.entry = pool.get(name)
        """The pool buffer the slots come from."""
        self.dtype = self.entry.dtype
        self.cols = cols
        self.row_bytes = cols * torch.empty((), dtype=self.dtype).element_size()
        self.queue = queue
        """Where each written slot goes as a ``Held`` (the combine stages release it)."""
        self.te_forward = te_forward
        """TE's ``forward`` taking ``out=`` (the class's own, looked up at install)."""

    def __copy__(self) -> Fc2Route:
        return self

    def __deepcopy__(self, memo: dict) -> Fc2Route:
        """A copied model shares the route, as it shared the hook closures before (the pool holds a lock)."""
        return self


def _routing_forward(self: Any, inp: Any, m_splits: Any, *args: Any, **kwargs: Any) -> Any:
    """TE's ``forward`` with ``out=`` a ring slot: the FC2 output written into the ring, checked, queued.

    The hot path of the TE module route, one frame: the slot is acquired here (errors as
    ``acquire_with_hint`` words them), its pointer read once (the storage check and the ``Held`` span).
    """
    route = self.__dict__.get(ROUTE)
    if route is None:  # uninstalled while another library had switched the class again: TE's own forward
        return super(self._bufreuse_shim, self).forward(inp, m_splits, *args, **kwargs)
    if kwargs.get("out") is not None:
        raise ConfigError("GroupedLinear.forward got out= and a bufreuse output buffer; disable expert reuse")
    rows = inp.shape[0]
    if inp.dtype is not route.dtype:
        raise dtype_refusal(route.name, route.dtype, inp.dtype)
    try:
        slot = route.entry.acquire((rows, route.cols))
    except EarlyReuseError as e:
        raise with_reuse_hint(route.pool, route.name, e) from e
    lo = slot.data_ptr()
    try:
        result = route.te_forward(self, inp, m_splits, *args, out=slot, **kwargs)
        y = result[0] if type(result) is tuple else result
        if y.data_ptr() != lo:
            raise BackendContractError(
                "Transformer Engine", "GroupedLinear.forward", "ignored out= (returned other storage)"
            )
    except BaseException:
        route.entry.release(slot)
        raise
    route.queue.append(Held(route.pool, route.name, slot, route.entry, (lo, lo + rows * route.row_bytes)))
    return result


def routing_class(cls: type, forward: Callable[..., Any] = _routing_forward) -> type:
    """A subclass of ``cls`` (megatron's ``TEGroupedLinear``) whose ``super().forward`` lands in the ring route.

    megatron's ``TEGroupedLinear.forward(x, m_splits)`` calls ``super().forward(x, m_splits,
    is_first_microbatch=...)`` and passes no ``out=``. In this class's MRO a shim sits between megatron's
    class and TE's (``out_route_class``): its ``forward`` (:func:`_routing_forward`) acquires the slot and
    calls TE's with ``out=``. Only instances switched to it (:func:`route_into_ring`) take the route: FC1,
    other layers and uninstalled modules run their own class untouched.
    """
    default = forward is _routing_forward
    routed = _ROUTING.get(cls) if default else None
    if routed is None:
        te_cls = out_route_class(cls)
        if te_cls is None:
            raise ConfigError(f"no Transformer Engine GroupedLinear.forward(out=) in {cls.__name__}'s classes")
        shim = type(f"_RingOut{te_cls.__name__}", (te_cls,), {"forward": forward, "__module__": __name__})
        shim._bufreuse_shim = shim  # type: ignore[attr-defined]  # the routing forward's way back to TE's
        bases = (shim,) if cls is te_cls else (cls, shim)
        routed = type(cls.__name__, bases, {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        if default:
            _ROUTING[cls] = routed
    return routed


def route_into_ring(installation: Any, module: Any, route: Fc2Route) -> None:
    """Switch ``module`` (an FC2 ``GroupedLinear``) to :func:`routing_class` with ``route``; undone at uninstall."""
    cls = type(module)
    routed = routing_class(cls)
    installation.override(module, ROUTE, route)
    module.__class__ = routed

    def restore() -> None:
        if type(module) is routed:
            module.__class__ = cls
        # else another library switched the class since: its subclass keeps the shim, which then finds no
        # route and calls TE's forward unchanged

    installation.on_uninstall(restore)
