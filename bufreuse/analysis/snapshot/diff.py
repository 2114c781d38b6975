"""Two snapshots side by side: what changed in max reserved, max active and pending free, by site.

``diff_files(a, b)`` replays both traces (the device with the highest max reserved of each) and
attributes three figures to allocation sites (the first user frame of the block's ``alloc``, as
``snapshot-report`` names them):

- reserved at the max-reserved point: the live segments, each under the site of the allocation that
  made it (its ``segment_alloc`` entry);
- active at the max-active point: allocated and pending-free blocks, by the site of their alloc;
- pending free at the max-active point: the blocks waiting on ``record_stream`` there.

What the trace cannot name (segments and blocks from before recording: weights, ring storage
made before the recorded steps) is one ``<before trace>`` row, so each column sums to its figure.
Bytes are the trace's: requested bytes for blocks, segment bytes for segments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bufreuse.analysis.snapshot.load import EventTable, FinalState
from bufreuse.analysis.snapshot.load import load_snapshot as _load
from bufreuse.analysis.snapshot.replay import Replay, pending_blocks_at, replay
from bufreuse.analysis.snapshot.schema import ALLOC, FREE_DONE, FREE_REQ, OOM, SEG_ALLOC, SEG_FREE
from bufreuse.analysis.snapshot.sites import SiteRules
from bufreuse.errors import SnapshotFormatError

__all__ = ["BEFORE_TRACE", "MEASURES", "DiffRow", "SnapshotDiff", "SnapshotSide", "diff_files", "snapshot_side"]

BEFORE_TRACE = "<before trace>"
MEASURES = ("reserved", "active", "pending")
"""Per-site figures: reserved at max reserved, active and pending free at max active."""


@dataclass(kw_only=True, slots=True)
class SnapshotSide:
    """One snapshot's three figures and their split by site: ``by_site[measure][site] = (bytes, count)``."""

    file: str
    device: int
    max_reserved: int
    max_active: int
    pending_at_max_active: int
    by_site: dict[str, dict[str, tuple[int, int]]]
    categories: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    oom_events: int = 0
    """Out-of-memory events in the trace: the run died, so its peaks are lower bounds."""


@dataclass(kw_only=True, slots=True)
class DiffRow:
    site: str
    category: str
    a: dict[str, tuple[int, int]]  # measure -> (bytes, count) in A
    b: dict[str, tuple[int, int]]

    def delta(self, measure: str) -> int:
        return self.b[measure][0] - self.a[measure][0]


@dataclass(kw_only=True, slots=True)
class SnapshotDiff:
    a: SnapshotSide
    b: SnapshotSide
    rows: list[DiffRow]  # biggest change first

    @property
    def caveats(self) -> list[str]:
        """What qualifies every delta: an out-of-memory event in either trace (a dead run's peak is a lower bound)."""
        dead = [(name, s) for name, s in (("A", self.a), ("B", self.b)) if s.oom_events]
        if not dead:
            return []
        who = " and ".join(f"{name} ({s.oom_events} out-of-memory event{'s' if s.oom_events > 1 else ''})"
                           for name, s in dead)  # fmt: skip
        if len(dead) == 2:
            what = "both runs died: neither max reserved nor max active is a true peak, so no delta is a verdict"
        else:
            name = dead[0][0]
            what = (f"{name} died before its true peak: its max reserved and max active are lower bounds, so a delta "
                    f"{'above' if name == 'B' else 'below'} zero only says the true one is at least that, and any "
                    "other delta says nothing")  # fmt: skip
        return [f"{who} recorded: {what}"]

    def to_json(self) -> dict[str, Any]:
        def side(s: SnapshotSide) -> dict[str, Any]:
            return {"file": s.file, "device": s.device, "max_reserved_bytes": s.max_reserved,
                    "max_active_bytes": s.max_active, "pending_free_at_max_active_bytes": s.pending_at_max_active,
                    "oom_events": s.oom_events, "warnings": s.warnings}  # fmt: skip

        return {
            "caveats": self.caveats,
            "a": side(self.a),
            "b": side(self.b),
            "delta": {
                "max_reserved_bytes": self.b.max_reserved - self.a.max_reserved,
                "max_active_bytes": self.b.max_active - self.a.max_active,
                "pending_free_at_max_active_bytes": self.b.pending_at_max_active - self.a.pending_at_max_active,
            },
            "sites": [
                {
                    "site": r.site,
                    "category": r.category,
                    **{
                        f"{m}_{k}": v
                        for m in MEASURES
                        for k, v in (
                            ("a_bytes", r.a[m][0]),
                            ("a_count", r.a[m][1]),
                            ("b_bytes", r.b[m][0]),
                            ("b_count", r.b[m][1]),
                            ("delta_bytes", r.delta(m)),
                        )
                    },
                }
                for r in self.rows
            ],
        }


def diff_files(
    a: str | os.PathLike[str], b: str | os.PathLike[str], *, categories: Mapping[str, str] | None = None,
    site_frame: int = 0,
) -> SnapshotDiff:  # fmt: skip
    """Load, replay and compare two snapshots; raises ``SnapshotFormatError`` (either file)."""
    rules = SiteRules(site_frame=site_frame, categories=dict(categories or {}))
    sa, sb = snapshot_side(a, rules), snapshot_side(b, rules)
    cats = {**sb.categories, **sa.categories}
    sites = set()
    for s in (sa, sb):
        for m in MEASURES:
            sites.update(s.by_site[m])
    zero = (0, 0)
    rows = [
        DiffRow(
            site=site,
            category=cats.get(site, "other"),
            a={m: sa.by_site[m].get(site, zero) for m in MEASURES},
            b={m: sb.by_site[m].get(site, zero) for m in MEASURES},
        )
        for site in sites
    ]
    rows.sort(key=lambda r: (-max(abs(r.delta(m)) for m in MEASURES), r.site))
    return SnapshotDiff(a=sa, b=sb, rows=rows)


def snapshot_side(path: str | os.PathLike[str], rules: SiteRules) -> SnapshotSide:
    """One snapshot's figures by site (the device with the highest max reserved)."""
    data = _load(path)
    if not data.traces:
        raise SnapshotFormatError(f"{path}: no trace entries; a diff by site needs the recorded trace")
    replays = {d: replay(t, data.final.get(d, FinalState())) for d, t in data.traces.items()}
    dev = max(replays, key=lambda d: replays[d].max_reserved)
    t, r = data.traces[dev], replays[dev]
    cats: dict[str, str] = {}
    ia = r.max_active_index
    pending_total = int(r.pending[ia]) if ia >= 0 else r.pending_baseline
    by_site = {
        "reserved": _segments_at(t, r, rules, cats),
        "active": _blocks_at(t, ia, r.max_active, rules, cats, with_live=True),
        "pending": _blocks_at(t, ia, pending_total, rules, cats, with_live=False),
    }
    return SnapshotSide(
        file=str(path), device=dev, max_reserved=r.max_reserved, max_active=r.max_active,
        pending_at_max_active=pending_total, by_site=by_site, categories=cats,
        warnings=[*data.warnings, *r.warnings], oom_events=int(np.count_nonzero(t.action == OOM)),
    )  # fmt: skip


def _name(t: EventTable, i: int, rules: SiteRules, cats: dict[str, str]) -> str:
    frames = t.entries[i].get("frames")
    site = rules.site(frames)
    if site not in cats:
        cats[site] = rules.category(frames)
    return site


def _add(out: dict[str, tuple[int, int]], site: str, size: int) -> None:
    b, c = out.get(site, (0, 0))
    out[site] = (b + size, c + 1)


def _rest(out: dict[str, tuple[int, int]], total: int) -> dict[str, tuple[int, int]]:
    """Put what the trace cannot name under ``<before trace>`` (count unknown: 1 row)."""
    named = sum(b for b, _ in out.values())
    if total > named:
        out[BEFORE_TRACE] = (total - named, 1)
    return out


def _last_events(t: EventTable, codes: tuple[int, ...], upto: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (≤ ``upto``) of the last event per address among ``codes``, and their actions."""
    act = t.action[: upto + 1]
    idx = np.flatnonzero(np.isin(act, codes))
    idx = idx[np.argsort(t.addr[idx], kind="stable")]
    a = t.addr[idx]
    last = np.ones(len(idx), dtype=bool)
    last[:-1] = a[1:] != a[:-1]
    return idx[last], t.action[idx[last]]


def _segments_at(t: EventTable, r: Replay, rules: SiteRules, cats: dict[str, str]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    ir = r.max_reserved_index
    if ir < 0:
        return _rest(out, r.max_reserved)
    idx, act = _last_events(t, (SEG_ALLOC, SEG_FREE), ir)
    for i in idx[act == SEG_ALLOC].tolist():
        _add(out, _name(t, i, rules, cats), int(t.size[i]))
    return _rest(out, r.max_reserved)


def _blocks_at(
    t: EventTable, index: int, total: int, rules: SiteRules, cats: dict[str, str], *, with_live: bool
) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    if index < 0:
        return _rest(out, total)
    for b in pending_blocks_at(t, index):
        _add(out, _name(t, b.alloc_index, rules, cats) if b.alloc_index >= 0 else BEFORE_TRACE, b.size)
    if with_live:
        idx, act = _last_events(t, (ALLOC, FREE_REQ, FREE_DONE), index)
        for i in idx[act == ALLOC].tolist():
            _add(out, _name(t, i, rules, cats), int(t.size[i]))
    before = out.pop(BEFORE_TRACE, (0, 0))
    named = sum(b for b, _ in out.values())
    if total > named:
        out[BEFORE_TRACE] = (total - named, max(before[1], 1))
    return out
