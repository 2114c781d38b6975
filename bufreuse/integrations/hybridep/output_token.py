"""DeepEP HybridEP helpers: hand a ring slot to ``HybridEPBuffer.dispatch_with_permute(output_token=)``.

Upstream HybridEP allocates its dispatch output itself; ``output_token`` is the keyword that lets
the caller supply it (docs/megatron.md says which DeepEP has it). These helpers fail early, naming
the missing API, when the installed DeepEP lacks it, and check that the kernel really wrote into
the slot it was given. The layer hooks using them are :mod:`bufreuse.integrations.hybridep.hooks`.

What the backend must write into ``output_token`` (a reused slot holds the previous microbatch's data,
or NaN in debug mode): every dispatched row, and each expert's padding rows set to zero, as upstream's
permute kernels zero them in their own output; the expert GEMMs compute the padding rows, so stale
values there reach the weight gradients. Rows past the padded splits may stay as they were: upstream
leaves them unwritten too, and no consumer reads them (docs/megatron.md, "Which rows of a slot are
written").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bufreuse.errors import BackendContractError, ConfigError
from bufreuse.integrations.core import DISPATCH, acquire_with_hint
from bufreuse.integrations.features import deepep_output_token
from bufreuse.pool import BufferPool

__all__ = ["OutputTokenInjector", "dispatch_into_pool", "dispatch_with_output_token", "require_output_token"]


def require_output_token(buffer_cls: Any) -> None:
    """Raise :class:`ConfigError` naming the missing API unless ``buffer_cls`` takes ``output_token``.

    ``buffer_cls`` is the class megatron-core would construct (``fused_a2a.HybridEPBuffer``); None
    means DeepEP with HybridEP did not import there.
    """
    if buffer_cls is None:
        raise ConfigError(
            "dispatch-output reuse on HybridEP needs DeepEP HybridEPBuffer.dispatch_with_permute(output_token=): "
            "DeepEP with HybridEP is not importable by megatron-core (fused_a2a.HAVE_HYBRIDEP is False)"
        )
    ok, detail = deepep_output_token(buffer_cls)
    if not ok:
        raise ConfigError(f"dispatch-output reuse on HybridEP needs DeepEP output_token: {detail}")


class OutputTokenInjector:
    """Stands in for megatron-core's process-wide ``HybridEPBuffer`` while hooks are installed.

    Every attribute is the wrapped buffer's, except ``dispatch_with_permute``: a forward dispatch
    (no ``handle``) takes the slot that ``take()`` hands out, if any, and goes through
    :func:`dispatch_with_output_token`; backward dispatches (with a ``handle``) and un-armed calls
    pass through untouched. The wrapped buffer's API is checked once (by signature), not per call.
    """

    __slots__ = ("checked", "inner", "take")

    def __init__(self, inner: Any, take: Callable[[], torch.Tensor | None]) -> None:
        self.inner = inner
        self.take = take
        self.checked = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def dispatch_with_permute(self, **kwargs: Any) -> tuple[Any, ...]:
        slot = self.take() if kwargs.get("handle") is None else None
        if slot is None:
            return self.inner.dispatch_with_permute(**kwargs)
        result = dispatch_with_output_token(self.inner, slot, checked=self.checked, **kwargs)
        self.checked = True
        return result


def dispatch_with_output_token(
    buffer: Any, output_token: torch.Tensor, *, checked: bool = False, **kwargs: Any
) -> tuple[Any, ...]:
    """Call ``buffer.dispatch_with_permute(output_token=..., **kwargs)``; its output must be that tensor.

    Raises :class:`ConfigError` when the buffer's API has no ``output_token`` (checked by signature,
    never by version; ``checked=True`` skips it for a buffer already checked) and
    :class:`~bufreuse.errors.BackendContractError` when the backend returned other storage than it
    was given.
    """
    if not checked:
        require_output_token(type(buffer))
    result = buffer.dispatch_with_permute(output_token=output_token, **kwargs)
    dispatched = result[0]
    if dispatched.data_ptr() != output_token.data_ptr():
        raise BackendContractError(
            "HybridEP",
            "dispatch_with_permute",
            "ignored output_token (returned other storage)",
            hint="the ring slot would hold stale data",
        )
    return result


def dispatch_into_pool(
    pool: BufferPool, buffer: Any, *, hidden: torch.Tensor, num_permuted_tokens: int, **kwargs: Any
) -> tuple[tuple[Any, ...], torch.Tensor]:
    """Acquire a ``dispatch_output`` buffer of the static bound and dispatch into it.

    Returns ``(dispatch result, acquired tensor)``; release the tensor after the experts (FP8/FP4
    expert GEMMs save a quantized copy, so the forward is its final reader).
    """
    slot = acquire_with_hint(pool, DISPATCH, (int(num_permuted_tokens), hidden.shape[-1]))
    result = dispatch_with_output_token(buffer, slot, hidden=hidden, num_permuted_tokens=num_permuted_tokens, **kwargs)
    return result, slot
