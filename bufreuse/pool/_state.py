"""Plain state shared by the ring and the allocator-backed buffers: phases, counters, one slot."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Phase", "RingStats", "StorageIndex"]


class StorageIndex(dict):
    """Storage pointer -> ring, plus the byte spans of those storages for the saved-tensor pack hook.

    The pack hook runs for every tensor autograd saves inside ``track_saved``; ``data_ptr()`` and a
    span test cost less there than building an ``untyped_storage()`` object per saved tensor. A tensor
    whose data pointer lies in a ring's storage can only be a view of it (the ring owns that memory).
    ``spans`` is mutated in place, so hooks that captured it see storages added later (``auto`` growth).
    """

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[int, int, Any, int]] = []
        """(first byte, end byte, ring, storage pointer) per registered storage."""

    def add(self, ptr: int, nbytes: int, ring: Any) -> None:
        """Register one storage of ``ring`` (``nbytes`` long, starting at ``ptr``)."""
        self[ptr] = ring
        self.spans.append((ptr, ptr + max(nbytes, 1), ring, ptr))


class Phase(enum.Enum):
    """Where a ring (or pool) stands in the eager -> capture -> replay -> eager cycle."""

    EAGER = "eager"
    CAPTURING = "capturing"
    GRAPHED = "graphed"  # captured (or before_replay): replays may run; eager use needs after_replay()


@dataclass(kw_only=True, slots=True)
class RingStats:
    """Counters of one buffer (a snapshot; the ring keeps counting)."""

    acquisitions: int = 0
    """Successful ``acquire`` calls (fallback allocations included)."""
    empty_acquisitions: int = 0
    """Of those, the ones of zero rows (an all-to-all that sent this rank no token). torch gives a zero-element
    tensor a null data pointer (pinned upstream, pytorch#101426), so no saved-tensor region counts a save of one
    and its release is never deferred: what a release check subtracts before comparing deferrals with a rule."""
    releases: int = 0
    """Releases carried out (immediate and deferred ones, fallback tensors included)."""
    gpu_waits: int = 0
    """GPU-side waits inserted (producer stream waited on a release event or a replay fence)."""
    peak_held: int = 0
    """Most acquisitions held at once."""
    persistent_bytes: int = 0
    """Bytes allocated once for the slots (0 for the allocator policies)."""
    deferred_releases: int = 0
    """``release_when_unsaved`` calls that found saved references or holds and deferred the release."""
    fallback_allocations: int = 0
    """Acquisitions served by the caching allocator because every slot was held (``on_exhausted='allocate'``)."""
    settled_slots: int = 0
    """Slot count now (for ``num_slots='auto'``: the depth warm-up settled on)."""
    grown: int = 0
    """Slots added by ``num_slots='auto'`` growth."""
    elided_events: int = 0
    """Events not recorded: eager releases on the stream that produced the slot (stream order protects the
    next producer on that stream, as the caching allocator's same-stream free), and the marks of a deferred
    slot's readers (a reader on the stream of the final release is ordered before it by that stream)."""
    late_records: int = 0
    """Elided events recorded after all: a next producer on another stream (after the first, the ring
    records at every release) or a capture stream joining the slot before capture; a reader's mark whose
    final release came on another stream."""


class _Slot:
    """One slot: its own base tensor (own version counter), holder and release state."""

    __slots__ = (
        "base",
        "capture_event",
        "eager_event",
        "generation",
        "holds",
        "index",
        "late",
        "live",
        "made_on",
        "marks",
        "pending",
        "saved_refs",
        "wait_on",
        "wait_stream",
    )

    def __init__(self, index: int, base: torch.Tensor, eager_event: Any, capture_event: Any) -> None:
        self.index = index
        self.base = base
        self.live: torch.Tensor | None = None  # the acquisition while held (released: None)
        self.generation = 0
        self.eager_event = eager_event
        self.capture_event = capture_event
        self.wait_on: Any = None  # event the next producer must wait on (None: nothing pending)
        self.wait_stream: Any = None  # stream that event was recorded on (same stream: no wait)
        self.made_on: Any = None  # the stream of the live acquisition (its producer)
        self.late = False  # released on made_on without recording wait_on: record it before anyone waits
        self.saved_refs = 0  # live autograd-saved references (track_saved)
        self.holds = 0  # active Hold objects
        self.pending = False  # release_when_unsaved called; released when saved_refs == holds == 0
        self.marks: list[tuple[Any, Any, bool]] = []  # (stream, event, not yet recorded) of readers to join

    def state(self) -> str:
        """Who holds the slot, for error messages."""
        if self.live is None:
            return "free"
        parts = []
        if self.pending:
            parts.append("release deferred")
        if self.saved_refs:
            parts.append(f"{self.saved_refs} autograd-saved reference(s)")
        if self.holds:
            parts.append(f"{self.holds} hold(s)")
        return "held" + (f" ({', '.join(parts)})" if parts else "")
