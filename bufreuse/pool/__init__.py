"""Caller-owned persistent buffer rings for cross-stream MoE buffers (imports only torch).

``BufferPool`` holds named buffer kinds (``"dispatch_output"``, ``"expert_fc2_output"``), each with a
:class:`Policy`: ``ring`` (N persistent slots; the producer stream waits on the GPU for the slot's last
release event), ``record-stream`` (the control: ``torch.empty`` + ``record_stream``) or
``stream-ordered`` (``torch.empty``; release makes the producer wait on the consumer). Misuse raises a
:class:`BufferReuseError` subclass before any GPU work. See ``docs/pool.md``.
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
from bufreuse.pool.ring import SLOT_ALIGN_BYTES, BufferRing, Phase, RingStats
from bufreuse.pool.watchdog import DEFAULT_WATCHDOG_S, Watchdog

__all__ = [
    "DEFAULT_WATCHDOG_S",
    "SLOT_ALIGN_BYTES",
    "AllocatingBuffer",
    "BufferPool",
    "BufferReuseError",
    "BufferRing",
    "CaptureStateError",
    "DoubleReleaseError",
    "EarlyReuseError",
    "ForeignTensorError",
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
