"""The pool's error hierarchy: every misuse raises before any GPU work is enqueued.

All errors derive from :class:`BufferReuseError` (a ``RuntimeError`` and a branch of the project's
one root, :class:`bufreuse.errors.BufreuseError`), so integrations can catch one type. Messages name
the ring, the slot, the generation and what to change.
"""

from __future__ import annotations

from bufreuse.errors import BufreuseError

__all__ = [
    "BufferReuseError",
    "CaptureStateError",
    "DoubleReleaseError",
    "EarlyReuseError",
    "ForeignTensorError",
    "InvalidStreamError",
    "RingConfigError",
    "SavedForBackwardError",
    "StaleAliasError",
    "StaticShapeError",
    "UnknownBufferError",
]


class BufferReuseError(BufreuseError, RuntimeError):
    """Base of every pool error."""


class StaticShapeError(BufferReuseError):
    """A request beyond the ring's static bound or of another dtype; names ring, bound and request."""


class EarlyReuseError(BufferReuseError):
    """The slot the ring would hand out is still held (not released).

    Carries ``ring``, ``slot``, ``generation`` (of the holder) and ``min_depth`` (acquisitions
    outstanding + 1: the slot count that would have sufficed for this schedule).
    """

    def __init__(self, message: str, *, ring: str, slot: int, generation: int, min_depth: int) -> None:
        super().__init__(message)
        self.ring = ring
        self.slot = slot
        self.generation = generation
        self.min_depth = min_depth


class DoubleReleaseError(BufferReuseError):
    """Release of an acquisition that was already released."""


class ForeignTensorError(BufferReuseError):
    """Release of a tensor the ring (or buffer) never handed out."""


class StaleAliasError(BufferReuseError):
    """Release of an older alias of a slot that has been acquired again since (or a view of the live one)."""


class CaptureStateError(BufferReuseError):
    """Allocation or growth during CUDA-graph capture, a slot held across a phase change, or a wrong transition."""


class SavedForBackwardError(BufferReuseError):
    """Autograd guard: ring storage saved for backward is released (or re-acquired) before that backward ran."""


class RingConfigError(BufferReuseError, ValueError):
    """Invalid ring or buffer registration (slot count, shape, dtype, policy, conflicting re-registration)."""


class UnknownBufferError(BufferReuseError):
    """``acquire``/``release`` of a buffer name that was never registered with the pool."""


class InvalidStreamError(BufferReuseError, ValueError):
    """A stream argument that is not a CUDA stream of the ring's device (checked in debug mode)."""
