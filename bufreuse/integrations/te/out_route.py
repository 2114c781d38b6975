"""Transformer Engine adapter: the expert FC2 output written into a caller-provided buffer.

Two routes, detected by feature (``bufreuse.integrations.features.te_grouped_output``):

- the op fuser (what megatron-core 0.19.2's ``TEGroupedMLP._fused_forward`` does): the fused ops
  take ``op_kwargs={-1: {OUTPUT_BUFFER_KEY: buffer}}`` (key from
  ``transformer_engine.pytorch.ops.basic.grouped_linear``; -1 is the FC2 basic op);
- the module: ``GroupedLinear.forward(inp, m_splits, ..., out=buffer)`` (TE PR #3161). megatron's
  ``TEGroupedLinear.forward(x, m_splits)`` passes no ``out=``, so :func:`patch_out_route` patches the
  TE class (found by signature) to take an armed buffer from the instance (:data:`ARMED_OUT`), while
  any hooked layer needs it (:func:`use_out_route`).

TE needs the buffer with the exact output shape, contiguous, and ``requires_grad=False``: a ring
slot is handed over as a detached alias of the same storage (no copy). TE's torch part needs a
CUDA build, so only fakes exercise this here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bufreuse.errors import BackendContractError, ConfigError
from bufreuse.integrations._compat_megatron import te_fused_impl
from bufreuse.integrations.features import accepts_keyword

__all__ = [
    "ARMED_OUT",
    "FC2_OP_INDEX",
    "arm_out",
    "grouped_linear_into",
    "out_route_class",
    "output_alias",
    "output_buffer_op_kwargs",
    "patch_out_route",
    "require_fused_output_buffer",
    "use_out_route",
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


ARMED_OUT = "_bufreuse_armed_out"
"""Instance attribute (a list) holding the buffer the next ``GroupedLinear.forward`` call writes into."""

_routes: dict[type, list[Any]] = {}
"""Patched TE class -> [undo, users]; the patch stays while any hooked layer uses it."""


def out_route_class(cls: type) -> type | None:
    """The first class in ``cls``'s MRO whose own ``forward`` takes ``out=`` (TE's ``GroupedLinear``), or None."""
    for klass in cls.__mro__:
        fn = vars(klass).get("forward")
        if fn is not None and accepts_keyword(fn, "out"):
            return klass
    return None


def arm_out(armed: list[torch.Tensor], buffer: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Arm ``buffer`` (as its detached alias of ``shape``) for the next patched forward of that module."""
    if armed:
        raise ConfigError("a GroupedLinear output buffer is already armed (re-entrant FC2 forward)")
    armed.append(output_alias(buffer, shape))


def patch_out_route(cls: type) -> Callable[[], None]:
    """Patch ``cls.forward`` to pass an instance's armed buffer as ``out=``; returns the undo.

    Instances without an armed buffer call the original unchanged. An explicit ``out=`` together
    with an armed buffer is refused (two writers for one output).
    """
    orig = vars(cls)["forward"]

    def forward(self: Any, inp: Any, m_splits: Any, *args: Any, **kwargs: Any) -> Any:
        armed = self.__dict__.get(ARMED_OUT)
        if armed:
            if kwargs.get("out") is not None:
                raise ConfigError("GroupedLinear.forward got out= and a bufreuse output buffer; disable expert reuse")
            kwargs["out"] = armed.pop()
        return orig(self, inp, m_splits, *args, **kwargs)

    forward.__wrapped__ = orig  # type: ignore[attr-defined]  # keeps the signature visible to feature checks
    cls.forward = forward  # type: ignore[attr-defined]

    def undo() -> None:
        cls.forward = orig  # type: ignore[attr-defined]

    return undo


def use_out_route(installation: Any, cls: type | None) -> None:
    """Keep :func:`patch_out_route` on ``cls`` while ``installation`` lives (shared, counted)."""
    if cls is None:
        raise ConfigError("no Transformer Engine GroupedLinear.forward(out=) in this FC2 module's classes")
    route = _routes.get(cls)
    if route is None:
        route = _routes[cls] = [patch_out_route(cls), 0]
    route[1] += 1

    def release() -> None:
        route[1] -= 1
        if route[1] == 0 and _routes.get(cls) is route:
            del _routes[cls]
            route[0]()

    installation.on_uninstall(release)
