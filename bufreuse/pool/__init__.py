"""Caller-owned persistent buffer rings for cross-stream MoE buffers (imports only torch).

``BufferPool`` holds named buffer kinds (``"dispatch_output"``, ``"expert_fc2_output"``), each with a
:class:`Policy`: ``ring`` (N persistent slots; the producer stream waits on the GPU for the slot's last
release event), ``record-stream`` (the control: ``torch.empty`` + ``record_stream``) or
````stream-ordered`` (``torch.empty``; release makes the producer wait on the consumer). Releases happen
at the true last reader: ``release_when_unsaved`` waits for autograd's saved references (counted by
``track_saved``) and for explicit ``Hold`` readers. Misuse raises a :class:`BufferReuseError` subclass
before any GPU work. See ``docs/pool.md``.
"""

from __future__ import annotations

from bufreuse.pool.allocating import AllocatingBuffer
from bufreuse.pool.buffer_pool import BufferPool
from bufreuse.pool.errors import (
    BufferReuseError,
    CaptureStateError,
    DoubleReleaseError,
    EarlyReuseError,
    ForeignTensorError,
    InvalidStreamError,
    RingConfigError,
    SavedForBackwardError,
    StaleAliasError,
    StaticShapeError,
    UnknownBufferError,
)
from bufreuse.pool.policy import Policy
from bufreuse.pool.ring import ON_EXHAUSTED, SLOT_ALIGN_BYTES, BufferRing, Phase, RingStats
from bufreuse.pool.tracking import Hold
from bufreuse.pool.watchdog import DEFAULT_WATCHDOG_S, Watchdog

__all__ = [
    "DEFAULT_WATCHDOG_S",
    "ON_EXHAUSTED",
    "SLOT_ALIGN_BYTES",
    "AllocatingBuffer",
    "BufferPool",
    "BufferReuseError",
    "BufferRing",
    "CaptureStateError",
    "DoubleReleaseError",
    "EarlyReuseError",
    "ForeignTensorError",
    "Hold",
    "InvalidStreamError",
    "Phase",
    "Policy",
    "RingConfigError",
    "RingStats",
    "SavedForBackwardError",
    "StaleAliasError",
    "StaticShapeError",
    "UnknownBufferError",
    "Watchdog",
]
