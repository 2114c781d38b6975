"""The allocator snapshot schema, written once: what ``torch.cuda.memory._snapshot()`` returns.

Accepted formats (plain pickled data, loaded by :mod:`.unpickle`, normalised by :mod:`.load`):

- ``{"segments": [...], "device_traces": [[...], ...]}`` from ``torch.cuda.memory._snapshot()``,
  torch 2.0 → 2.13. Optional keys are ignored when absent: ``time_us`` (2.1+), ``requested_size``
  (2.1+; else ``size``), ``allocator_settings`` / ``external_annotations`` (2.6+),
  ``compile_context`` / ``user_metadata`` (2.5+), ``pool_id`` / ``segment_pool_id``, blocks'
  ``history`` (2.0) instead of ``frames``, ``is_expandable`` and ``segment_map`` / ``segment_unmap``
  (2.1+), and actions this code does not know (``user_defined`` annotations, say): counted, skipped.
- The legacy list of segments from ``torch.cuda.memory_snapshot()`` (torch 1.13 → today): final
  state only, no trace.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "ACTIONS",
    "ALLOC",
    "ANNOTATION_ACTIONS",
    "BLOCK_STATES",
    "FREE_DONE",
    "FREE_REQ",
    "OOM",
    "OTHER",
    "SEG_ALLOC",
    "SEG_FREE",
    "SEG_MAP",
    "SEG_UNMAP",
    "SNAP",
    "STATE_ALIASES",
    "Block",
    "Frame",
    "Segment",
    "Snapshot",
    "TraceEntry",
]


class Frame(TypedDict):
    filename: str
    line: int
    name: str


class Block(TypedDict):
    size: int
    requested_size: NotRequired[int]  # torch >= 2.1; the requested (unrounded) bytes
    address: NotRequired[int]
    state: Literal["active_allocated", "active_pending_free", "active_awaiting_free", "inactive"]
    frames: NotRequired[list[Frame]]
    history: NotRequired[list[dict[str, Any]]]  # torch 2.0: [{addr, real_size, frames}]


class Segment(TypedDict):
    address: int
    total_size: int
    stream: int
    segment_type: Literal["small", "large"]
    blocks: list[Block]
    device: NotRequired[int]
    allocated_size: NotRequired[int]
    active_size: NotRequired[int]
    requested_size: NotRequired[int]
    segment_pool_id: NotRequired[tuple[int, int]]  # (0, 0) default pool; else CUDA graph / MemPool
    is_expandable: NotRequired[bool]


class TraceEntry(TypedDict):
    action: str  # one of ACTIONS (unknown ones are skipped)
    addr: NotRequired[int]  # absent on "oom"
    size: int  # requested bytes (alloc/free) or segment bytes (segment_*)
    stream: int
    frames: NotRequired[list[Frame]]
    time_us: NotRequired[int]
    device_free: NotRequired[int]  # "oom" only: bytes the driver reported free
    pool_id: NotRequired[tuple[int, int]]


class Snapshot(TypedDict):
    segments: list[Segment]
    device_traces: list[list[TraceEntry]]
    allocator_settings: NotRequired[dict[str, Any]]
    external_annotations: NotRequired[list[Any]]


ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
)
ANNOTATION_ACTIONS = frozenset({"user_defined", "annotation"})
"""Trace entries that mark a point in time (no memory change); skipped without a warning."""
ALLOC, FREE_REQ, FREE_DONE, SEG_ALLOC, SEG_FREE, SEG_MAP, SEG_UNMAP, SNAP, OOM = range(9)
"""Action codes of the normalised ``EventTable.action`` column: indexes into :data:`ACTIONS`."""
OTHER = 9
"""Code of an action not in :data:`ACTIONS` (counted and skipped)."""
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
STATE_ALIASES = {"active_awaiting_free": "active_pending_free"}
"""Block states older torch wrote under another name -> the name used here."""
