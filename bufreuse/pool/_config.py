"""Validation and small helpers shared by the ring and the allocator-backed buffers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from bufreuse.pool.errors import RingConfigError

__all__ = ["check_config", "resolve_device", "storage_ptr"]


def check_config(name: str, num_slots: int, max_shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
    """The bound as a tuple of ints, or ``RingConfigError`` naming the bad argument."""
    if not isinstance(name, str) or not name:
        raise RingConfigError(f"ring name must be a non-empty string, got {name!r}")
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
        raise RingConfigError(f"ring '{name}': num_slots must be an integer >= 1, got {num_slots!r}")
    try:
        shape = tuple(int(d) for d in max_shape)
    except (TypeError, ValueError):
        raise RingConfigError(f"ring '{name}': max_shape must be a sequence of ints, got {max_shape!r}") from None
    if not shape or any(d < 1 for d in shape):
        raise RingConfigError(f"ring '{name}': max_shape must have positive dimensions, got {shape}")
    if not isinstance(dtype, torch.dtype):
        raise RingConfigError(f"ring '{name}': dtype must be a torch.dtype, got {dtype!r}")
    return shape


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``None`` means the current CUDA device when there is one, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def storage_ptr(tensor: Any) -> int:
    """Address of ``tensor``'s storage (-1 for anything without one); one attribute call, no copy."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError, TypeError, NotImplementedError):
        return -1
