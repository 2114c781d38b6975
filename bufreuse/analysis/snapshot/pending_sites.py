"""Pending-free bytes over time, split by allocation site, downsampled for plots and ``--json``.

A block is pending from its ``free_requested`` to its ``free_completed`` unless the two are back to
back (a plain free, never queued; :mod:`bufreuse.analysis.snapshot.replay` counts it the same way). Each
pending interval is attributed to the site of the block's ``alloc`` (first user frame, as
``snapshot-report`` names sites); the biggest ``top`` sites at their own peaks get a series each,
the rest are summed under ``other sites``; blocks pending when recording began (their completion
has no request in the trace) are ``<pending before trace>``, and blocks whose alloc predates the
trace are ``<alloc not in trace>``. The series
are sampled at the points :func:`downsample` picks (bucket maxima of active memory, as the timeline
plot does), so the bands line up with the timeline and each point's bands sum to the replay's
pending-free bytes there.

Cost: two stable sorts over the alloc/free events and one frame lookup per pending interval
(frames read once per distinct frame object), ~0.2 s per million events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bufreuse.analysis.snapshot.load import EventTable
from bufreuse.analysis.snapshot.replay import Replay
from bufreuse.analysis.snapshot.schema import ALLOC, FREE_DONE, FREE_REQ
from bufreuse.analysis.snapshot.sites import BEFORE_TRACE_SITE, SiteRules
from bufreuse.analysis.snapshot.whatif_trace import frame_site_lookup

__all__ = ["BEFORE_TRACE_PENDING", "OTHER_SITES", "PendingSeries", "downsample", "pending_series"]

BEFORE_TRACE_PENDING = "<pending before trace>"
OTHER_SITES = "other sites"


@dataclass(kw_only=True, slots=True)
class PendingSeries:
    """Pending-free bytes per site at sampled events: ``bytes[k][j]`` for ``sites[k]`` at ``index[j]``."""

    index: np.ndarray  # sampled event indices (state after that event)
    sites: list[str]
    bytes: np.ndarray  # int64 (exact Python ints, dtype object, where sums could pass 2^63), sites x index

    def to_json(self, x: np.ndarray | None = None) -> dict[str, Any]:
        return {
            "event_index": self.index.tolist(),
            **({"x": [round(float(v), 6) for v in x]} if x is not None else {}),
            "sites": {s: self.bytes[k].tolist() for k, s in enumerate(self.sites)},
        }


def downsample(active: np.ndarray, points: int) -> np.ndarray:
    """At most ``points`` event indices: in each of ``points`` equal buckets, where active peaks."""
    n = len(active)
    if n <= points:
        return np.arange(n)
    width = -(-n // points)
    pad = width * points - n
    act2 = np.concatenate((active, np.full(pad, np.iinfo(np.int64).min))).reshape(points, width)
    pick = np.arange(points) * width + np.argmax(act2, axis=1)
    return pick[pick < n]


def pending_series(t: EventTable, r: Replay, rules: SiteRules, picks: np.ndarray, *, top: int = 6) -> PendingSeries:
    """Pending-free bytes by site at ``picks`` (see the module docstring)."""
    a, addr, n = t.action, t.addr, len(t)
    imm = np.zeros(n, dtype=bool)  # plain frees: request and completion back to back
    if n > 1:
        imm[:-1] = (a[:-1] == FREE_REQ) & (a[1:] == FREE_DONE) & (addr[:-1] == addr[1:])
    mem = np.flatnonzero(np.isin(a, (ALLOC, FREE_REQ, FREE_DONE)))
    order = mem[np.argsort(addr[mem], kind="stable")]
    oact = a[order]
    start = np.ones(len(order), dtype=bool)
    start[1:] = addr[order][1:] != addr[order][:-1]
    last = np.maximum.accumulate(np.where((oact == ALLOC) | start, np.arange(len(order)), 0))
    alloc_of = np.full(n, -1, dtype=np.int64)  # per event: the alloc of its block (-1: before the trace)
    alloc_of[order] = np.where(oact[last] == ALLOC, order[last], -1)
    prev = np.full(len(order), -1, dtype=np.int64)
    prev[1:] = oact[:-1]
    prev[start] = -1
    orphan = np.zeros(n, dtype=bool)  # a completion whose request predates the trace
    orphan[order] = (oact == FREE_DONE) & (prev != FREE_REQ)
    after_imm = np.zeros(n, dtype=bool)
    after_imm[1:] = imm[:-1]
    ev = np.flatnonzero(((a == FREE_REQ) & ~imm) | ((a == FREE_DONE) & ~after_imm))
    sizes, sign = t.size[ev], np.where(a[ev] == FREE_REQ, 1, -1)
    # int64 when no running sum can pass 2^63 (int64 x uint64 would silently go float64); else exact ints
    exact = len(ev) > 0 and int(sizes.max()) > (2**63 - 1) // len(ev)
    delta = (
        np.array([s * g for s, g in zip(sizes.tolist(), sign.tolist(), strict=True)], dtype=object)
        if exact
        else sign * sizes.astype(np.int64)
    )
    site_of = frame_site_lookup(rules)
    labels: list[str] = []
    for i, orph in zip(alloc_of[ev].tolist(), orphan[ev].tolist(), strict=True):
        if orph:
            labels.append(BEFORE_TRACE_PENDING)
        else:
            labels.append(site_of(t.entries[i].get("frames")) if i >= 0 else BEFORE_TRACE_SITE)
    names_arr, lab = np.unique(np.array([*labels, BEFORE_TRACE_PENDING], dtype=object), return_inverse=True)
    names = [str(x) for x in names_arr]
    lab = lab[:-1]
    by = np.argsort(lab, kind="stable")  # events grouped by site, each group in trace order
    bounds = np.searchsorted(lab[by], np.arange(len(names) + 1))
    series, peaks = [], []
    for k, name in enumerate(names):
        sel = by[bounds[k] : bounds[k + 1]]
        e, c = ev[sel], np.cumsum(delta[sel])
        base = int(r.pending_baseline) if name == BEFORE_TRACE_PENDING else 0
        c = c + base
        at = np.searchsorted(e, picks, side="right") - 1  # last own event at or before each pick
        series.append(np.where(at >= 0, c[np.maximum(at, 0)], base) if len(c) else np.full(len(picks), base))
        peaks.append(max(int(c.max()), base) if len(c) else base)
    named = sorted((k for k, s in enumerate(names) if s != BEFORE_TRACE_PENDING), key=lambda k: (-peaks[k], names[k]))
    keep, rest = named[:top], named[top:]
    sites = [names[k] for k in keep]
    rows = [series[k] for k in keep]
    if rest:
        sites.append(OTHER_SITES)
        rows.append(np.sum([series[k] for k in rest], axis=0))
    k0 = names.index(BEFORE_TRACE_PENDING)
    if peaks[k0] or int(np.abs(series[k0]).max(initial=0)):
        sites.append(BEFORE_TRACE_PENDING)
        rows.append(series[k0])
    out = np.array(rows, dtype=object if exact else np.int64).reshape(len(rows), len(picks))
    return PendingSeries(index=picks, sites=sites, bytes=out)
