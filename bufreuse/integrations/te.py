"""Transformer Engine adapter: the expert FC2 output written into a caller-provided buffer.

Two routes, detected by feature (``bufreuse.integrations.features.te_grouped_output``):

- the op fuser (what megatron-core 0.19.2's ``TEGroupedMLP._fused_forward`` does): the fused ops
  take ``op_kwargs={-1: {OUTPUT_BUFFER_KEY: buffer}}`` (key from
  ``transformer_engine.pytorch.ops.basic.grouped_linear``; -1 is the FC2 basic op);
- the module: ``GroupedLinear.forward(inp, m_splits, ..., out=buffer)`` (TE PR #3161).

TE needs the buffer with the exact output shape, contiguous, and ``requires_grad=False``: a ring
slot is handed over as a detached alias of the same storage (no copy). TE's torch part needs a
CUDA build, so only fakes exercise this here.
"""

from __future__ import annotations

from typing import Any

import torch

from bufreuse.errors import BackendContractError, ConfigError
from bufreuse.integrations._compat_megatron import te_fused_impl
from bufreuse.integrations.features import accepts_keyword

__all__ = [
    "FC2_OP_INDEX",
    "grouped_linear_into",
    "output_alias",
    "output_buffer_op_kwargs",
    "require_fused_output_buffer",
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
