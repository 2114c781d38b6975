"""Load one snapshot file and normalise it into numpy columns (the schema is in :mod:`.schema`).

Each trace entry is read once, through C-level ``map(dict.get, ...)`` passes into uint64 columns,
because a per-entry Python loop would dominate the report. Frames stay in the loaded lists and are
read later only for the handful of blocks a report names. The file is untrusted: every number a
report uses is range-checked (sizes, addresses, streams in ``[0, 2^64)``, devices below
``MAX_DEVICES``), every container and string type is checked, nothing recurses on the file's depth,
and every malformed field is a ``SnapshotFormatError`` naming the file, the field path
(``device_traces[0][12].size``) and the value, shortened. Sizes of entries, segments and blocks are
bounded by the snapshot budgets of :class:`bufreuse.limits.Limits` (see :mod:`.budget`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from bufreuse.analysis.snapshot.budget import SnapshotBudgetError, check, memory_for, memory_limit
from bufreuse.analysis.snapshot.schema import ACTIONS, ANNOTATION_ACTIONS, BLOCK_STATES, OTHER, STATE_ALIASES
from bufreuse.analysis.snapshot.unpickle import ProgressFn, load_pickle_file
from bufreuse.analysis.snapshot.validate import MAX_DEVICES, U64, check_uint, short
from bufreuse.errors import SnapshotFormatError
from bufreuse.limits import Limits, current

__all__ = ["EventTable", "FinalState", "SnapshotData", "load_snapshot", "normalise"]

_CODE = {a: i for i, a in enumerate(ACTIONS)}


@dataclass(kw_only=True, slots=True)
class EventTable:
    """One device's trace as columns; ``entries`` is the loaded list, kept for lazy frame lookups."""

    device: int
    action: np.ndarray  # int8 codes, index into ACTIONS; OTHER for unknown actions
    addr: np.ndarray  # uint64; 0 where absent (oom)
    size: np.ndarray  # uint64 (replay widens it where sums could pass int64)
    stream: np.ndarray  # uint64
    time_us: np.ndarray | None  # int64, or None when the format has no timestamps
    entries: Sequence[dict[str, Any]]
    unknown_actions: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.action)


@dataclass(kw_only=True, slots=True)
class FinalState:
    """Block and segment totals of one device at dump time (requested bytes for active blocks)."""

    reserved: int = 0
    allocated_requested: int = 0  # active_allocated blocks, requested bytes (what the trace counts)
    pending_requested: int = 0  # active_pending_free blocks, requested bytes
    state_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BLOCK_STATES, 0))
    rounding_waste: int = 0  # active blocks: size - requested_size
    by_pool: dict[str, dict[str, int]] = field(default_factory=dict)  # "a,b" -> reserved/active bytes
    by_stream: dict[int, int] = field(default_factory=dict)  # stream -> active block bytes
    num_segments: int = 0
    expandable_segments: int = 0
    pending_blocks: list[tuple[int, int, Any]] = field(default_factory=list)  # (requested, stream, frames)


@dataclass(kw_only=True, slots=True)
class SnapshotData:
    """A validated snapshot: per-device final state and trace columns."""

    path: str
    format: str  # "device_traces" | "segments-list"
    final: dict[int, FinalState]
    traces: dict[int, EventTable]
    warnings: list[str] = field(default_factory=list)


def load_snapshot(
    path: str | os.PathLike[str], *, progress: ProgressFn | None = None, limits: Limits | None = None
) -> SnapshotData:
    """Load (restricted unpickler) and normalise one snapshot file; raises ``SnapshotFormatError``.

    Raises:
        SnapshotFormatError: the file is unreadable or malformed (the message names the field).
        SnapshotBudgetError: the file needs more than ``limits`` (default: in force) allows; a
            ``SnapshotFormatError`` too (names the budget and the flags).
    """
    limits = limits or current()
    try:
        with memory_limit(memory_for(limits)):  # loading and normalising both (nested caps keep the lower)
            return normalise(load_pickle_file(path, progress=progress, limits=limits), path=str(path), limits=limits)
    except MemoryError:
        raise SnapshotBudgetError(
            "max_memory_bytes",
            value="needs more memory",
            limit=memory_for(limits),
            what=f"{path}: loading the snapshot",
        ) from None


def normalise(raw: Any, *, path: str = "<snapshot>", limits: Limits | None = None) -> SnapshotData:
    """Validate a loaded snapshot object and turn it into columns; errors name the bad field."""
    limits = limits or current()
    if isinstance(raw, list):
        segments, traces, fmt = raw, [], "segments-list"
    elif isinstance(raw, dict):
        if "segments" not in raw:
            keys = ", ".join(short(k) for k in list(raw)[:8])
            raise SnapshotFormatError(f"{path}: no 'segments' key (keys: {keys or 'none'})")
        segments, traces, fmt = raw["segments"], raw.get("device_traces", []), "device_traces"
        if not isinstance(segments, list):
            raise SnapshotFormatError(f"{path}: 'segments' is {short(segments)}, expected a list")
        if not isinstance(traces, list):
            raise SnapshotFormatError(f"{path}: 'device_traces' is {short(traces)}, expected a list (one per device)")
        if len(traces) > MAX_DEVICES:
            raise SnapshotFormatError(f"{path}: 'device_traces' has {len(traces):,} devices (at most {MAX_DEVICES})")
        for d, t in enumerate(traces):
            if not isinstance(t, list):
                raise SnapshotFormatError(f"{path}: device_traces[{d}] is {short(t)}, expected a list of entries")
        check("max_trace_entries", sum(map(len, traces)), what=f"{path}: trace entries", limits=limits)
    else:
        raise SnapshotFormatError(f"{path}: top level is {short(raw)}, expected a dict or a list of segments")
    final = _final_state(segments, path, limits)
    tables = {dev: _columns(entries, dev, path) for dev, entries in enumerate(traces) if entries}
    for dev in tables:
        final.setdefault(dev, FinalState())  # every block freed and every segment released
    data = SnapshotData(path=path, format=fmt, final=final, traces=tables)
    for t in tables.values():
        listed = 0
        for action, n in sorted(t.unknown_actions.items()):
            if action in ANNOTATION_ACTIONS:
                continue  # time markers (newer torch writes "user_defined"): listed in skipped_entries
            if listed == _WARN_ACTIONS:
                data.warnings.append(f"device {t.device}: more unknown actions skipped (see skipped_entries)")
                break
            listed += 1
            data.warnings.append(f"device {t.device}: {n} trace entries with action {short(action)} skipped")
    return data


_WARN_ACTIONS = 8  # unknown actions named in warnings per device (all of them are in skipped_entries)
_MAX_UNKNOWN = 1000  # distinct unknown actions kept per device


def _final_state(segments: list[Any], path: str, limits: Limits) -> dict[int, FinalState]:
    out: dict[int, FinalState] = {}
    check("max_blocks", len(segments), what=f"{path}: segments", limits=limits)
    n_blocks = len(segments)
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        if not isinstance(seg, dict):
            raise SnapshotFormatError(f"{path}: {where} is {short(seg)}, expected a dict")
        dev = check_uint(seg.get("device", 0), f"{where}.device", path, bound=MAX_DEVICES)
        fs = out.setdefault(dev, FinalState())
        total = check_uint(seg.get("total_size"), f"{where}.total_size", path)
        blocks = seg.get("blocks", [])
        if not isinstance(blocks, list):
            raise SnapshotFormatError(f"{path}: {where}.blocks is {short(blocks)}, expected a list")
        n_blocks += len(blocks)
        check("max_blocks", n_blocks, what=f"{path}: segments and blocks", limits=limits)
        pool_fig = fs.by_pool.setdefault(_pool_key(seg, where, path), {"reserved_bytes": 0, "active_bytes": 0})
        pool_fig["reserved_bytes"] += total
        fs.reserved += total
        fs.num_segments += 1
        expandable = seg.get("is_expandable", False)
        if type(expandable) not in (bool, int):
            raise SnapshotFormatError(f"{path}: {where}.is_expandable is {short(expandable)}, expected a bool")
        fs.expandable_segments += bool(expandable)
        stream = check_uint(seg.get("stream", 0), f"{where}.stream", path)
        for j, b in enumerate(blocks):
            bw = f"{where}.blocks[{j}]"
            if not isinstance(b, dict):
                raise SnapshotFormatError(f"{path}: {bw} is {short(b)}, expected a dict")
            size = check_uint(b.get("size"), f"{bw}.size", path)
            req = check_uint(b.get("requested_size", size), f"{bw}.requested_size", path)
            state = b.get("state")
            if type(state) is not str:
                raise SnapshotFormatError(f"{path}: {bw}.state is {short(state)}, expected one of {BLOCK_STATES}")
            state = STATE_ALIASES.get(state, state)
            if state not in fs.state_bytes:
                raise SnapshotFormatError(f"{path}: {bw}.state is {short(state)}, expected one of {BLOCK_STATES}")
            fs.state_bytes[state] += size
            if state == "inactive":
                continue
            fs.rounding_waste += max(size - req, 0)
            pool_fig["active_bytes"] += size
            fs.by_stream[stream] = fs.by_stream.get(stream, 0) + size
            if state == "active_allocated":
                fs.allocated_requested += req
            else:
                fs.pending_requested += req
                fs.pending_blocks.append((req, stream, _block_frames(b)))
    return out


def _block_frames(b: dict[str, Any]) -> Any:
    """A block's alloc frames: ``frames`` (torch 2.1+), else the last ``history`` entry's (2.0)."""
    frames = b.get("frames")
    if not frames and isinstance(b.get("history"), list) and b["history"] and isinstance(b["history"][-1], dict):
        frames = b["history"][-1].get("frames")
    return frames if isinstance(frames, list) else None


def _pool_key(seg: dict[str, Any], where: str, path: str) -> str:
    """``"a,b"`` of a segment's ``segment_pool_id`` (``(0, 0)``: the default pool)."""
    pool = seg.get("segment_pool_id", (0, 0))
    if not isinstance(pool, tuple | list) or not 1 <= len(pool) <= 4:
        raise SnapshotFormatError(f"{path}: {where}.segment_pool_id is {short(pool)}, expected a pair of ints")
    for k, v in enumerate(pool):
        check_uint(v, f"{where}.segment_pool_id[{k}]", path)
    return ",".join(map(str, pool))


_INT_TYPES = frozenset({int})


def _columns(entries: list[Any], device: int, path: str) -> EventTable:
    """Trace entries → uint64 columns, in C-level passes; a slow per-entry pass only to explain errors."""
    n = len(entries)
    try:
        actions = list(map(dict.get, entries, repeat("action")))
        code = np.fromiter(map(_CODE.get, actions, repeat(OTHER)), dtype=np.int8, count=n)
        cols = {}
        for key, default in (("addr", 0), ("size", None), ("stream", 0)):
            cols[key] = _uint_column(list(map(dict.get, entries, repeat(key), repeat(default))))
        time_us = None
        if n and type(entries[0].get("time_us")) is int:
            try:
                time_us = _int64_column(list(map(dict.get, entries, repeat("time_us"), repeat(0))))
            except (TypeError, OverflowError):
                time_us = None  # timestamps are optional: a bad one drops the time axis, not the report
    except (TypeError, OverflowError, ValueError):
        _explain(entries, device, path)
        raise SnapshotFormatError(f"{path}: device_traces[{device}] has malformed entries") from None
    unknown: dict[str, int] = {}
    for i in np.flatnonzero(code == OTHER)[:100_000].tolist():
        a = actions[i]
        if type(a) is not str:
            raise SnapshotFormatError(f"{path}: device_traces[{device}][{i}].action is {short(a)}, expected a string")
        if a in unknown or len(unknown) < _MAX_UNKNOWN:
            unknown[a] = unknown.get(a, 0) + 1
    return EventTable(
        device=device,
        action=code,
        addr=cols["addr"],
        size=cols["size"],
        stream=cols["stream"],
        time_us=time_us,
        entries=entries,
        unknown_actions=unknown,
    )


def _uint_column(values: list[Any]) -> np.ndarray:
    """Python ints in ``[0, 2^64)`` → uint64 array; raises ``TypeError``/``OverflowError`` otherwise."""
    if not set(map(type, values)) <= _INT_TYPES:
        raise TypeError("not a column of ints")
    return np.fromiter(values, dtype=np.uint64, count=len(values))


def _int64_column(values: list[Any]) -> np.ndarray:
    if not set(map(type, values)) <= _INT_TYPES:
        raise TypeError("not a column of ints")
    return np.fromiter(values, dtype=np.int64, count=len(values))


def _explain(entries: list[Any], device: int, path: str) -> None:
    """Find the first bad entry and raise an error that names it and the bad field."""
    for i, e in enumerate(entries):
        where = f"device_traces[{device}][{i}]"
        if not isinstance(e, dict):
            raise SnapshotFormatError(f"{path}: {where} is {short(e)}, expected a dict")
        if "size" not in e:
            raise SnapshotFormatError(f"{path}: {where} has no 'size' (action {short(e.get('action'))})")
        for key in ("addr", "size", "stream"):
            check_uint(e.get(key, 0), f"{where}.{key}", path, bound=U64)
        try:
            hash(e.get("action"))
        except TypeError:
            raise SnapshotFormatError(
                f"{path}: {where}.action is {short(e.get('action'))}, expected a string"
            ) from None
