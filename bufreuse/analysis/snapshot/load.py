"""Load one snapshot file and normalise it into numpy columns (the schema is in :mod:`.schema`).

Each trace entry is read once, through C-level ``map(dict.get, ...)`` passes into int64 columns,
because a per-entry Python loop would dominate the report. Frames stay in the loaded lists and are
read later only for the handful of blocks a report names. Every malformed field is a
``SnapshotFormatError`` naming the file and the field.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from bufreuse.analysis.snapshot.schema import ACTIONS, ANNOTATION_ACTIONS, BLOCK_STATES, OTHER, STATE_ALIASES
from bufreuse.analysis.snapshot.unpickle import ProgressFn, load_pickle_file
from bufreuse.errors import SnapshotFormatError

__all__ = ["EventTable", "FinalState", "SnapshotData", "load_snapshot", "normalise"]

_CODE = {a: i for i, a in enumerate(ACTIONS)}


@dataclass(kw_only=True, slots=True)
class EventTable:
    """One device's trace as columns; ``entries`` is the loaded list, kept for lazy frame lookups."""

    device: int
    action: np.ndarray  # int8 codes, index into ACTIONS; OTHER for unknown actions
    addr: np.ndarray  # int64; 0 where absent (oom)
    size: np.ndarray  # int64
    stream: np.ndarray  # int64
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


@dataclass(kw_only=True, slots=True)
class SnapshotData:
    """A validated snapshot: per-device final state and trace columns."""

    path: str
    format: str  # "device_traces" | "segments-list"
    final: dict[int, FinalState]
    traces: dict[int, EventTable]
    warnings: list[str] = field(default_factory=list)


def load_snapshot(path: str | os.PathLike[str], *, progress: ProgressFn | None = None) -> SnapshotData:
    """Load (restricted unpickler) and normalise one snapshot file; raises ``SnapshotFormatError``."""
    return normalise(load_pickle_file(path, progress=progress), path=str(path))


def normalise(raw: Any, *, path: str = "<snapshot>") -> SnapshotData:
    """Validate a loaded snapshot object and turn it into columns; errors name the bad field."""
    if isinstance(raw, list):
        segments, traces, fmt = raw, [], "segments-list"
    elif isinstance(raw, dict):
        if "segments" not in raw:
            raise SnapshotFormatError(f"{path}: no 'segments' key (keys: {sorted(map(str, raw))[:8]})")
        segments, traces, fmt = raw["segments"], raw.get("device_traces", []), "device_traces"
        if not isinstance(segments, list):
            raise SnapshotFormatError(f"{path}: 'segments' is {type(segments).__name__}, expected a list")
        if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
            raise SnapshotFormatError(f"{path}: 'device_traces' must be a list of lists (one per device)")
    else:
        raise SnapshotFormatError(f"{path}: top level is {type(raw).__name__}, expected a dict or a list of segments")
    final = _final_state(segments, path)
    tables = {dev: _columns(entries, dev, path) for dev, entries in enumerate(traces) if entries}
    for dev in tables:
        final.setdefault(dev, FinalState())  # every block freed and every segment released
    data = SnapshotData(path=path, format=fmt, final=final, traces=tables)
    for t in tables.values():
        for action, n in sorted(t.unknown_actions.items()):
            if action in ANNOTATION_ACTIONS:
                continue  # time markers (newer torch writes "user_defined"): listed in skipped_entries
            data.warnings.append(f"device {t.device}: {n} trace entries with action {action!r} skipped")
    return data


def _nonneg_int(v: Any, where: str, path: str) -> int:
    if type(v) is not int or v < 0:
        raise SnapshotFormatError(f"{path}: {where} must be a non-negative int, got {v!r}")
    return v


def _final_state(segments: list[Any], path: str) -> dict[int, FinalState]:
    out: dict[int, FinalState] = {}
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict):
            raise SnapshotFormatError(f"{path}: segments[{i}] is {type(seg).__name__}, expected a dict")
        dev = seg.get("device", 0)
        fs = out.setdefault(dev if type(dev) is int else 0, FinalState())
        total = _nonneg_int(seg.get("total_size"), f"segments[{i}].total_size", path)
        blocks = seg.get("blocks", [])
        if not isinstance(blocks, list):
            raise SnapshotFormatError(f"{path}: segments[{i}].blocks must be a list")
        pool = seg.get("segment_pool_id", (0, 0))
        pool_key = ",".join(map(str, pool)) if isinstance(pool, tuple | list) else str(pool)
        pool_fig = fs.by_pool.setdefault(pool_key, {"reserved_bytes": 0, "active_bytes": 0})
        pool_fig["reserved_bytes"] += total
        fs.reserved += total
        fs.num_segments += 1
        fs.expandable_segments += bool(seg.get("is_expandable", False))
        stream = seg.get("stream", 0)
        for j, b in enumerate(blocks):
            where = f"segments[{i}].blocks[{j}]"
            if not isinstance(b, dict):
                raise SnapshotFormatError(f"{path}: {where} is {type(b).__name__}, expected a dict")
            size = _nonneg_int(b.get("size"), f"{where}.size", path)
            req = b.get("requested_size", size)
            req = _nonneg_int(req, f"{where}.requested_size", path)
            state = b.get("state")
            state = STATE_ALIASES.get(state, state)
            if state not in fs.state_bytes:
                raise SnapshotFormatError(f"{path}: {where}.state is {state!r}, expected one of {BLOCK_STATES}")
            fs.state_bytes[state] += size
            if state == "inactive":
                continue
            fs.rounding_waste += max(size - req, 0)
            pool_fig["active_bytes"] += size
            if type(stream) is int:
                fs.by_stream[stream] = fs.by_stream.get(stream, 0) + size
            if state == "active_allocated":
                fs.allocated_requested += req
            else:
                fs.pending_requested += req
    return out


def _columns(entries: list[Any], device: int, path: str) -> EventTable:
    """Trace entries → int64 columns, in C-level passes; a slow per-entry pass only to explain errors."""
    n = len(entries)
    try:
        actions = list(map(dict.get, entries, repeat("action")))
        code = np.fromiter(map(_CODE.get, actions, repeat(OTHER)), dtype=np.int8, count=n)
        cols = {}
        for key, default in (("addr", 0), ("size", None), ("stream", 0)):
            cols[key] = _int_column(list(map(dict.get, entries, repeat(key), repeat(default))))
        time_us = None
        if n and type(entries[0].get("time_us")) is int:
            try:
                time_us = _int_column(list(map(dict.get, entries, repeat("time_us"), repeat(0))))
            except TypeError:
                time_us = None  # timestamps are optional: a bad one drops the time axis, not the report
    except (TypeError, OverflowError, ValueError):
        _explain(entries, device, path)
        raise SnapshotFormatError(f"{path}: device_traces[{device}] has malformed entries") from None
    neg = np.flatnonzero((cols["size"] < 0) | (cols["addr"] < 0))
    if len(neg):
        i = int(neg[0])
        raise SnapshotFormatError(
            f"{path}: device_traces[{device}][{i}] has a negative size or addr "
            f"(size={entries[i].get('size')!r}, addr={entries[i].get('addr')!r})"
        )
    unknown: dict[str, int] = {}
    for i in np.flatnonzero(code == OTHER)[:100_000]:
        a = actions[i]
        if not isinstance(a, str):
            raise SnapshotFormatError(f"{path}: device_traces[{device}][{i}].action is {a!r}, expected a string")
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


def _int_column(values: list[Any]) -> np.ndarray:
    """A list of Python ints → int64 array; numpy's type inference doubles as the type check."""
    arr = np.array(values) if values else np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "ib":
        raise TypeError(f"not a column of ints ({arr.dtype})")
    return arr.astype(np.int64, copy=False)


def _explain(entries: list[Any], device: int, path: str) -> None:
    """Find the first bad entry and raise an error that names it and the bad field."""
    for i, e in enumerate(entries):
        where = f"device_traces[{device}][{i}]"
        if not isinstance(e, dict):
            raise SnapshotFormatError(f"{path}: {where} is {type(e).__name__}, expected a dict")
        if "size" not in e:
            raise SnapshotFormatError(f"{path}: {where} has no 'size' (action {e.get('action')!r})")
        for key in ("addr", "size", "stream", "time_us"):
            v = e.get(key, 0)
            if type(v) not in (int, bool) or not -(1 << 63) <= v < (1 << 63):
                raise SnapshotFormatError(f"{path}: {where}.{key} is {v!r}, expected an int")
        try:
            hash(e.get("action"))
        except TypeError:
            raise SnapshotFormatError(f"{path}: {where}.action is {e.get('action')!r}, expected a string") from None
