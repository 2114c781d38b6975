"""The snapshot report of one loaded snapshot: the figures that decide whether buffer rings help.

:func:`analyze` returns exactly the JSON object ``bufreuse snapshot-report --json`` prints for a
file: peak reserved (and when), peak active (allocated + pending free) and the pending-free queue
at that point grouped by allocation site, size and stream (bytes already pending before the trace
began are reported apart: cause unknown, not record_stream waits), the final state by block state,
fragmentation, per-stream and per-pool totals, OOMs and warnings. Sites are read only for the
blocks in the pending-free queue at the max-active point, because frames are the expensive part.
Reading files (one or several, in worker processes) is :mod:`.batch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bufreuse.analysis.snapshot.load import EventTable, FinalState, SnapshotData
from bufreuse.analysis.snapshot.replay import Replay, pending_blocks_at, replay
from bufreuse.analysis.snapshot.schema import ALLOC, OOM
from bufreuse.analysis.snapshot.sites import BEFORE_TRACE_SITE, NO_FRAMES_SITE, UNKNOWN_SITE, SiteRules
from bufreuse.analysis.snapshot.validate import MAX_FRAMES, U64

__all__ = ["ReportConfig", "Timeline", "analyze"]


@dataclass(kw_only=True, slots=True)
class ReportConfig:
    """What a report reads from frames and how much timeline it keeps for plots."""

    categories: Mapping[str, str] = field(default_factory=dict)
    """User category rules ``name -> regex`` (tried before the built-in dispatch/expert rules)."""
    site_frame: int = 0
    """Which user frame names a site (0 = innermost user frame)."""
    site_skip: Sequence[str] = ()
    """Extra filename regexes whose frames are not user frames."""
    timeline_points: int = 0
    """Points of the reserved/active/pending timeline to keep for ``--plot`` (0 = none)."""
    pending_series_points: int = 2000
    """Points of the pending-free-by-site series in the report's ``pending_free_series`` (0 = none)."""

    def rules(self) -> SiteRules:
        return SiteRules(site_frame=self.site_frame, site_skip=tuple(self.site_skip), categories=self.categories)


@dataclass(kw_only=True, slots=True)
class Timeline:
    """A downsampled replay (bucket maxima of active), small enough to send between processes."""

    x: np.ndarray  # seconds since the first event, or event index when there are no timestamps
    x_label: str
    reserved: np.ndarray
    allocated: np.ndarray
    active: np.ndarray
    max_active_x: float
    max_active_bytes: int
    pending_by_site: dict[str, np.ndarray] | None = None  # pending-free bands at the same points


def analyze(data: SnapshotData, config: ReportConfig) -> tuple[dict[str, Any], Timeline | None]:
    """Replay every device with a trace; report the device with the highest peak reserved."""
    rules = config.rules()
    replays = {dev: replay(t, data.final.get(dev, FinalState())) for dev, t in data.traces.items()}
    devices = sorted(set(data.final) | set(replays)) or [0]
    if replays:
        dev = max(replays, key=lambda d: replays[d].max_reserved)
    else:
        dev = max(devices, key=lambda d: data.final[d].reserved if d in data.final else 0)
    final = data.final.get(dev, FinalState())
    t, r = data.traces.get(dev), replays.get(dev)
    warnings = list(data.warnings)
    if t is None or r is None:
        warnings.append(
            "recording was off: the snapshot has no trace entries (call "
            "torch.cuda.memory._record_memory_history() before the run); figures are the final state only"
        )
    else:
        warnings.extend(r.warnings)
    report = _figures(data.path, data.format, dev, final, t, r, rules)
    report["warnings"] = warnings
    if len(devices) > 1:
        report["devices"] = {
            str(d): {
                "max_reserved_bytes": replays[d].max_reserved if d in replays else data.final[d].reserved,
                "max_active_bytes": replays[d].max_active if d in replays else None,
                "num_trace_events": len(data.traces[d]) if d in data.traces else 0,
            }
            for d in devices
        }
    timeline = _timeline(t, r, config.timeline_points) if t is not None and r is not None else None
    if t is not None and r is not None and len(t):
        _pending_by_site(report, timeline, t, r, rules, config)
    return report, timeline


def _pending_by_site(
    report: dict[str, Any], timeline: Timeline | None, t: EventTable, r: Replay, rules: SiteRules, config: ReportConfig
) -> None:
    """Add the pending-free series by site to the report (and as bands to the timeline)."""
    from bufreuse.analysis.snapshot.pending_sites import downsample, pending_series

    if config.pending_series_points > 0:
        picks = downsample(r.active, config.pending_series_points)
        x = (t.time_us[picks] - t.time_us[0]) / 1e6 if t.time_us is not None else None
        report["pending_free_series"] = pending_series(t, r, rules, picks).to_json(x)
    if timeline is not None:
        ps = pending_series(t, r, rules, downsample(r.active, config.timeline_points))
        timeline.pending_by_site = dict(zip(ps.sites, ps.bytes, strict=True))


def _max_pending_in_trace(r: Replay) -> int:
    """Most bytes pending free at once from frees requested in the trace (pending before it is apart)."""
    if not len(r.pending):
        return 0
    own = r.pending if r.pending_before_trace is None else r.pending - r.pending_before_trace
    return max(int(own.max()), 0)


def _int_or_none(v: Any) -> int | None:
    """An optional figure from the file: kept when it is an int in ``[0, 2^64)``, else None."""
    return v if type(v) is int and 0 <= v < U64 else None


def _at(arr: np.ndarray, i: int, base: int) -> int:
    return int(arr[i]) if i >= 0 else base


def _figures(
    path: str, fmt: str, dev: int, final: FinalState, t: EventTable | None, r: Replay | None, rules: SiteRules
) -> dict[str, Any]:
    final_active = final.allocated_requested + final.pending_requested
    out: dict[str, Any] = {"file": path, "format": fmt, "device": dev, "recording": t is not None}
    groups: list[dict[str, Any]] = []
    by_cat = dict.fromkeys([*rules.category_names, "other"], 0)
    streams: dict[str, dict[str, int]] = {}
    ooms: list[dict[str, Any]] = []
    if t is None or r is None:
        out |= {
            "num_trace_events": 0,
            "max_reserved_bytes": final.reserved,
            "max_reserved_event_index": None,
            "max_reserved_in_segments_bytes": final.reserved,
            "max_reserved_time_us": None,
            "reserved_at_trace_start_bytes": final.reserved,
            "max_active_bytes": final_active,
            "max_active_event_index": None,
            "max_active_time_us": None,
            "allocated_at_max_active_bytes": final.allocated_requested,
            "pending_free_at_max_active_bytes": final.pending_requested,
            "pending_before_trace_at_max_active_bytes": 0,
            "max_active_depends_on_pending_before_trace": False,
            "max_active_without_pending_before_trace_bytes": final_active,
            "max_active_without_pending_before_trace_event_index": None,
            "max_pending_free_bytes": final.pending_requested,
            "pending_before_trace_bytes": 0,
            "reserved_at_max_active_bytes": final.reserved,
        }
        frees_without_alloc = completions_without_request = 0
        groups = _final_pending_groups(final, rules)
        for g in groups:
            by_cat[g["category"]] = by_cat.get(g["category"], 0) + g["total_bytes"]
            s = streams.setdefault(str(g["stream"]), {})
            s["pending_free_at_max_active_bytes"] = s.get("pending_free_at_max_active_bytes", 0) + g["total_bytes"]
    else:
        ia, ir = r.max_active_index, r.max_reserved_index
        before_at = r.before_trace_at(ia)
        pend_at = _at(r.pending, ia, r.pending_baseline) - before_at
        out |= {
            "num_trace_events": len(t),
            "max_reserved_bytes": r.max_reserved,
            "max_reserved_event_index": ir,
            "max_reserved_time_us": int(t.time_us[ir]) if t.time_us is not None and ir >= 0 else None,
            "max_reserved_in_segments_bytes": r.max_reserved_in_segments,
            "reserved_at_trace_start_bytes": r.reserved_baseline,
            "max_active_bytes": r.max_active,
            "max_active_event_index": ia,
            "max_active_time_us": int(t.time_us[ia]) if t.time_us is not None and ia >= 0 else None,
            "allocated_at_max_active_bytes": _at(r.allocated, ia, r.allocated_baseline),
            "pending_free_at_max_active_bytes": pend_at,
            "pending_before_trace_at_max_active_bytes": before_at,
            "max_active_depends_on_pending_before_trace": r.max_active_known_index != ia,
            "max_active_without_pending_before_trace_bytes": r.max_active_known,
            "max_active_without_pending_before_trace_event_index": r.max_active_known_index,
            "max_pending_free_bytes": _max_pending_in_trace(r),
            "pending_before_trace_bytes": r.pending_baseline,
            "reserved_at_max_active_bytes": _at(r.reserved, ia, r.reserved_baseline),
        }
        groups = _pending_groups(t, ia, rules)
        for g in groups:
            by_cat[g["category"]] = by_cat.get(g["category"], 0) + g["total_bytes"]
            s = streams.setdefault(str(g["stream"]), {})
            s["pending_free_at_max_active_bytes"] = s.get("pending_free_at_max_active_bytes", 0) + g["total_bytes"]
        is_alloc = t.action == ALLOC
        uniq, inv = np.unique(t.stream[is_alloc], return_inverse=True)
        counts = np.bincount(inv, minlength=len(uniq))
        sums = np.bincount(inv, weights=t.size[is_alloc].astype(np.float64), minlength=len(uniq))
        for s_id, c, b in zip(uniq.tolist(), counts.tolist(), sums.tolist(), strict=True):
            streams.setdefault(str(s_id), {}).update(alloc_count=int(c), alloc_bytes=round(b))
        for i in np.flatnonzero(t.action == OOM).tolist():
            e = t.entries[i]
            ooms.append(
                {
                    "event_index": i,
                    "size_bytes": int(t.size[i]),
                    "device_free_bytes": _int_or_none(e.get("device_free", e.get("addr"))),
                    "stream": int(t.stream[i]),
                    "time_us": int(t.time_us[i]) if t.time_us is not None else None,
                }
            )
        frees_without_alloc, completions_without_request = r.frees_without_alloc, r.completions_without_request
    for s_id, b in final.by_stream.items():
        streams.setdefault(str(s_id), {})["final_active_bytes"] = b
    out |= {
        "pending_free_groups_at_max_active": groups,
        "pending_free_by_category_at_max_active": by_cat,
        "final_reserved_bytes": final.reserved,
        "final_state_bytes": dict(final.state_bytes),
        "fragmentation": {
            "reserved_minus_active_at_max_active_bytes": out["reserved_at_max_active_bytes"] - out["max_active_bytes"],
            "reserved_minus_active_bytes": final.reserved - final_active,
            "free_in_segments_bytes": final.state_bytes["inactive"],
            "rounding_waste_bytes": final.rounding_waste,
        },
        "streams": streams,
        "pools": final.by_pool,
        "num_segments": final.num_segments,
        "expandable_segments": final.expandable_segments,
        "oom_events": ooms,
        "skipped_entries": dict(t.unknown_actions) if t is not None else {},
        "frees_without_alloc": frees_without_alloc,
        "completions_without_request": completions_without_request,
    }
    return out


def _pending_groups(t: EventTable, index: int, rules: SiteRules) -> list[dict[str, Any]]:
    """The pending-free queue at ``index``, grouped by (site, size, stream, category), biggest first.

    Only blocks whose ``free_requested`` is in the trace: bytes pending before it began are not
    record_stream waits that the trace can show (the report lists them apart).
    """
    groups: dict[tuple[str, int, int, str], int] = {}
    name = _stack_namer(rules)
    for b in pending_blocks_at(t, index):
        if b.alloc_index >= 0:
            site, cat = name(t.entries[b.alloc_index].get("frames"))
            key = (site, b.size, b.stream, cat)
        else:
            key = (BEFORE_TRACE_SITE, b.size, b.stream, "other")
        groups[key] = groups.get(key, 0) + 1
    out = [
        {"site": s, "size_bytes": size, "count": c, "total_bytes": size * c, "stream": st, "category": cat}
        for (s, size, st, cat), c in groups.items()
    ]
    out.sort(key=lambda g: (-g["total_bytes"], g["site"], g["size_bytes"]))
    return out


def _stack_namer(rules: SiteRules) -> Callable[[Any], tuple[str, str]]:
    """``frames -> (site, category)`` as ``rules.site`` / ``rules.category`` give them, each distinct stack
    named once (a queue of 10^5 blocks repeats the same few stacks; the key is the frames' text)."""
    seen: dict[tuple[Any, ...], tuple[str, str]] = {}

    def name(frames: Any) -> tuple[str, str]:
        if not frames:  # None, missing or []: recorded without stacks
            return NO_FRAMES_SITE, "other"
        if not isinstance(frames, list):
            return UNKNOWN_SITE, "other"
        try:
            key = tuple(
                (f.get("filename"), f.get("line"), f.get("name")) if isinstance(f, dict) else None
                for f in frames[:MAX_FRAMES]
            )
            hit = seen.get(key)
        except TypeError:  # an unhashable field (a list where a name belongs): name it uncached
            return rules.site(frames), rules.category(frames)
        if hit is None:
            hit = seen[key] = (rules.site(frames), rules.category(frames))
        return hit

    return name


def _final_pending_groups(final: FinalState, rules: SiteRules) -> list[dict[str, Any]]:
    """The final state's pending-free blocks grouped as :func:`_pending_groups` does, from the blocks' own frames.

    Without a trace the final state is the only point there is, so it stands for the max-active point.
    """
    groups: dict[tuple[str, int, int, str], int] = {}
    name = _stack_namer(rules)
    for size, stream, frames in final.pending_blocks:
        site, cat = name(frames)
        key = (site, size, stream, cat)
        groups[key] = groups.get(key, 0) + 1
    out = [
        {"site": s, "size_bytes": size, "count": c, "total_bytes": size * c, "stream": st, "category": cat}
        for (s, size, st, cat), c in groups.items()
    ]
    out.sort(key=lambda g: (-g["total_bytes"], g["site"], g["size_bytes"]))
    return out


def _timeline(t: EventTable, r: Replay, points: int) -> Timeline | None:
    if points <= 0 or len(t) == 0:
        return None
    res_all, alloc_all, active = r.reserved, r.allocated, r.active
    if active.dtype == object:  # sums past int64 (see replay): plots need floats, not exact ints
        res_all, alloc_all, active = (a.astype(np.float64) for a in (res_all, alloc_all, active))
    n = len(active)
    if n > points:
        width = -(-n // points)
        pad = width * points - n
        low = np.full(pad, -np.inf if active.dtype.kind == "f" else np.iinfo(np.int64).min, dtype=active.dtype)
        act2 = np.concatenate((active, low)).reshape(points, width)
        pick = np.arange(points) * width + np.argmax(act2, axis=1)
        pick = pick[pick < n]
        res2 = np.concatenate((res_all, low)).reshape(points, width)
        reserved = res2.max(axis=1)[: len(pick)]
    else:
        pick = np.arange(n)
        reserved = res_all
    if t.time_us is not None:
        t0 = float(t.time_us[0])  # floats: hostile timestamps far apart must not wrap in int64
        x = (t.time_us[pick].astype(np.float64) - t0) / 1e6
        x_label, ia_x = "seconds since recording started", (float(t.time_us[max(r.max_active_index, 0)]) - t0) / 1e6
    else:
        x, x_label, ia_x = pick.astype(np.float64), "trace event", float(max(r.max_active_index, 0))
    return Timeline(
        x=x,
        x_label=x_label,
        reserved=reserved,
        allocated=alloc_all[pick],
        active=active[pick],
        max_active_x=float(ia_x),
        max_active_bytes=r.max_active,
    )
