"""The trace side of what-if: the events as allocator operations, the state before them, the rings.

:class:`TraceOps` turns one device's trace columns into allocator operations with numpy (block
identity, immediate vs ``record_stream``-delayed frees, ``empty_cache`` runs) and rebuilds the
segments and blocks that existed before recording started. :func:`classify_allocs` names the
ring of every ``alloc`` event; frames are read once per distinct frame object (a snapshot shares
frame dicts between entries), so a million-event trace costs about a microsecond per alloc.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bufreuse.analysis.snapshot.allocator_model import K_MIN_BLOCK_SIZE, round_size
from bufreuse.analysis.snapshot.load import EventTable
from bufreuse.analysis.snapshot.schema import ALLOC, FREE_DONE, FREE_REQ, SEG_ALLOC, SEG_FREE
from bufreuse.analysis.snapshot.sites import UNKNOWN_SITE, SiteRules

__all__ = [
    "EMPTY_CACHE",
    "FREE",
    "FREE_PENDING",
    "MALLOC",
    "PEND",
    "RingSite",
    "TraceOps",
    "classify_allocs",
    "device_segments",
    "frame_site_lookup",
    "max_split_size",
    "settings_warnings",
]

MALLOC, FREE, PEND, FREE_PENDING, EMPTY_CACHE = range(5)
"""Operation codes: malloc, free now, hold as pending-free, free a pending block, ``empty_cache``."""


@dataclass(kw_only=True, slots=True)
class RingSite:
    """One site served from a ring: which blocks, how big a slot, how many slots it needs."""

    name: str  # the category name or the --site pattern
    sites: list[str]  # distinct first-user-frame sites of its blocks, most bytes first
    blocks: int
    slot_bytes: int
    min_slots: int  # most of its blocks alive at once
    stream: int
    moe_frame: bool = True  # some block's stack has an MoE Python frame (SiteRules.is_moe_frame)


def device_segments(raw: Any, dev: int) -> list[dict[str, Any]]:
    segs = raw.get("segments", []) if isinstance(raw, dict) else raw
    return [s for s in segs if isinstance(s, dict) and s.get("device", 0) == dev]


def _settings(raw: Any) -> dict[str, Any]:
    s = raw.get("allocator_settings") if isinstance(raw, dict) else None
    return s if isinstance(s, dict) else {}


def max_split_size(raw: Any) -> int | None:
    v = _settings(raw).get("max_split_size")
    return v if type(v) is int and 0 < v < (1 << 62) else None


def settings_warnings(raw: Any) -> list[str]:
    s, out = _settings(raw), []
    if s.get("expandable_segments"):
        out.append("expandable_segments is on: the model treats its segments as ordinary cudaMalloc segments")
    div = s.get("roundup_power2_divisions")
    if isinstance(div, dict) and any(v for v in div.values() if type(v) is int):
        out.append("roundup_power2_divisions is set: the model rounds to 512 B only")
    if isinstance(s.get("garbage_collection_threshold"), float) and s["garbage_collection_threshold"] > 0:
        out.append("garbage_collection_threshold is set: the model never frees segments on its own")
    return out


@dataclass(kw_only=True, slots=True)
class TraceOps:
    """The trace as allocator operations (numpy), and the state before it."""

    code: np.ndarray  # per kept event: MALLOC / FREE / PEND / FREE_PENDING / EMPTY_CACHE
    index: np.ndarray  # the event's index in the trace
    owner: np.ndarray  # per trace event: block id (alloc index, or -1-k for block k from before the trace)
    rounded: np.ndarray  # per trace event: its size rounded as the allocator rounds requests
    stream: np.ndarray
    segments: list[tuple[int, int, int, bool]]  # (address, size, stream, small) before the trace
    used: dict[int, list[tuple[int, int, int, bool]]]  # segment address -> [(addr, size, id, pending)]

    @classmethod
    def build(cls, t: EventTable, segs: list[dict[str, Any]], warnings: list[str]) -> TraceOps:
        a, addr, n = t.action, t.addr, len(t)
        mem = np.flatnonzero(np.isin(a, (ALLOC, FREE_REQ, FREE_DONE)))
        order = mem[np.argsort(addr[mem], kind="stable")]
        oa, oact = addr[order], a[order]
        start = np.ones(len(order), dtype=bool)
        start[1:] = oa[1:] != oa[:-1]
        gi = np.cumsum(start) - 1  # which address group
        last = np.maximum.accumulate(np.where((oact == ALLOC) | start, np.arange(len(order)), 0))
        owner = np.full(n, -(1 << 62), dtype=np.int64)
        owner[order] = np.where(oact[last] == ALLOC, order[last], -1 - gi[last])
        imm = np.zeros(n, dtype=bool)  # free_requested with its free_completed next: never pending
        imm[:-1] = (a[:-1] == FREE_REQ) & (a[1:] == FREE_DONE) & (addr[:-1] == addr[1:])
        drop = np.zeros(n, dtype=bool)
        drop[1:] = imm[:-1]
        code = np.full(n, -1, dtype=np.int8)
        code[a == ALLOC] = MALLOC
        code[(a == FREE_REQ) & imm] = FREE
        code[(a == FREE_REQ) & ~imm] = PEND
        code[(a == FREE_DONE) & ~drop] = FREE_PENDING
        seg_free = a == SEG_FREE
        code[seg_free & ~np.concatenate(([False], seg_free[:-1]))] = EMPTY_CACHE
        keep = np.flatnonzero(code >= 0)
        # segments before the trace: the final ones, undoing the trace's segment events backwards
        before = {s["address"]: (s["address"], s["total_size"], s.get("stream", 0), s.get("segment_type") == "small")
                  for s in segs if type(s.get("address")) is int}  # fmt: skip
        for i in np.flatnonzero(np.isin(a, (SEG_ALLOC, SEG_FREE)))[::-1].tolist():
            if a[i] == SEG_ALLOC:
                before.pop(int(addr[i]), None)
            else:
                sz = int(t.size[i])
                before[int(addr[i])] = (int(addr[i]), sz, int(t.stream[i]), sz == 2 << 20)
        # blocks before the trace: first event on an address is a free (request or completion) ...
        occupied: list[tuple[int, int, int, bool]] = []
        first = np.flatnonzero(start & (oact != ALLOC))
        for k, ev in zip(gi[first].tolist(), order[first].tolist(), strict=True):
            occupied.append((int(addr[ev]), round_size(int(t.size[ev])), -1 - k, a[ev] == FREE_DONE))
        # ... or an active block of the final state that the trace never touches
        touched = set(oa.tolist())
        extra = -(1 << 61)
        for s in segs:
            pos = s.get("address", 0)
            for b in s.get("blocks", []):
                ba = b.get("address", pos)
                if b.get("state") != "inactive" and ba not in touched:
                    occupied.append((ba, b["size"], extra, b.get("state") != "active_allocated"))
                    extra -= 1
                pos = ba + b["size"]
        starts = sorted(before)
        used: dict[int, list[tuple[int, int, int, bool]]] = {s: [] for s in starts}
        lost = 0
        for blk in occupied:
            j = np.searchsorted(starts, blk[0], side="right") - 1
            if j >= 0 and blk[0] < starts[j] + before[starts[j]][1]:
                used[starts[j]].append(blk)
            else:
                lost += 1
        if lost:
            warnings.append(f"{lost} blocks from before the trace lie in no segment of the final state: left out")
        return cls(code=code[keep], index=keep, owner=owner, rounded=_round_sizes(t.size), stream=t.stream,
                   segments=[before[s] for s in starts], used=used)  # fmt: skip


def _round_sizes(size: np.ndarray) -> np.ndarray:
    """:func:`~bufreuse.analysis.snapshot.allocator_model.round_size` over a column."""
    return np.maximum(-(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE, K_MIN_BLOCK_SIZE)


def classify_allocs(
    t: EventTable, ops: TraceOps, rules: SiteRules, patterns: Sequence[tuple[str, re.Pattern[str]]]
) -> tuple[np.ndarray, list[RingSite]]:
    """The ring of every trace event's block (-1: none) and the rings that have blocks.

    With ``patterns``, each ``(name, regex)`` is a ring and a block belongs to the first whose regex
    is found in its site; without, each category of ``rules`` (user rules, then dispatch_output and
    expert_output) is a ring. Categories are decided per frame line, which is what ``re.search``
    on the joined stack does for patterns that do not span lines.
    """
    names = [n for n, _ in patterns] if patterns else rules.ring_category_names
    users = len(rules.categories)  # user rules come first in ``names`` and win over moe_other, as in category()
    site_of, cat_of = _frame_caches(rules, names)
    allocs = np.flatnonzero(t.action == ALLOC).tolist()
    group = np.full(len(t), -1, dtype=np.int64)
    by_site: list[dict[str, int]] = [{} for _ in names]
    moe = [False] * len(names)
    moe_by_id: dict[int, bool] = {}
    site_match: dict[str, int] = {}
    entries, sizes = t.entries, t.size
    k = rules.site_frame
    for i in allocs:
        frames = entries[i].get("frames")
        if not isinstance(frames, list) or not frames:
            continue
        if patterns:
            site = _site(frames, site_of, k)
            g = site_match.get(site)
            if g is None:
                g = site_match[site] = next((j for j, (_, rx) in enumerate(patterns) if rx.search(site)), -1)
        else:
            cats = list(map(cat_of, frames))
            g = min((c for c in cats if c >= 0), default=len(names))
            if g >= len(names) or (EXCLUDED in cats and g >= users):
                continue  # no ring's block, or MoE memory no ring replaces (moe_other) and no user rule's
            site = _site(frames, site_of, k)
        if g >= 0:
            group[i] = g
            d = by_site[g]
            d[site] = d.get(site, 0) + int(sizes[i])
            if not moe[g]:
                moe[g] = any(
                    moe_by_id[id(f)] if id(f) in moe_by_id else moe_by_id.setdefault(id(f), rules.is_moe_frame(f))
                    for f in frames
                )
    owner = ops.owner
    ev_group = np.where(owner >= 0, group[np.maximum(owner, 0)], -1)
    rings: list[RingSite] = []
    remap = np.full(len(names) + 1, -1, dtype=np.int64)
    req = np.isin(t.action, (ALLOC, FREE_REQ))
    for g, name in enumerate(names):
        idx = np.flatnonzero(group == g)
        if len(idx) == 0:
            continue
        ev = np.flatnonzero(req & (ev_group == g))
        live = np.cumsum(np.where(t.action[ev] == ALLOC, 1, -1))
        remap[g] = len(rings)
        rings.append(
            RingSite(
                name=name,
                sites=sorted(by_site[g], key=lambda s, d=by_site[g]: (-d[s], s)),
                blocks=len(idx),
                slot_bytes=round_size(int(t.size[idx].max())),
                min_slots=int(live.max()) if len(live) else 0,
                stream=int(t.stream[idx[0]]),
                moe_frame=moe[g],
            )
        )
    return remap[ev_group], rings


def frame_site_lookup(rules: SiteRules) -> Callable[[Any], str]:
    """``frames -> site`` as ``rules.site`` returns it, reading each distinct frame object once."""
    site_of, _ = _frame_caches(rules, [])
    by_id: dict[int, str | None] = {}
    k0 = rules.site_frame

    def lookup(frames: Any) -> str:
        if not isinstance(frames, list):
            return UNKNOWN_SITE
        k = k0
        for f in frames:
            key = id(f)
            s = by_id[key] if key in by_id else by_id.setdefault(key, site_of(f))
            if s is not None:
                if k == 0:
                    return s
                k -= 1
        return UNKNOWN_SITE

    return lookup


def _site(frames: list[Any], site_of: Callable[[Any], str | None], k: int) -> str:
    for f in frames:
        s = site_of(f)
        if s is not None:
            if k == 0:
                return s
            k -= 1
    return UNKNOWN_SITE


def _plain(v: Any) -> Any:
    """A frame field as a cache key: a list or dict (a hostile file) is unhashable; sites show it as '?'."""
    return v if v is None or type(v) in (str, int, float, bool) else f"<{type(v).__name__}>"


EXCLUDED = -1
"""A frame whose category is a built-in that no ring takes (``moe_other``): its block is no ring's."""


def _frame_caches(rules: SiteRules, names: list[str]) -> tuple[Callable[[Any], str | None], Callable[[Any], int]]:
    """Per-frame lookups: its site (None for a skipped frame) and its category's index (len: none;
    ``EXCLUDED``: a category no ring takes)."""
    single = SiteRules(site_skip=tuple(rules.site_skip), categories=rules.categories)
    index = {n: j for j, n in enumerate(names)}
    none = len(names)
    by_id_site: dict[int, str | None] = {}
    by_id_cat: dict[int, int] = {}
    by_text: dict[tuple[Any, Any, Any], tuple[str | None, int]] = {}

    def fill(f: Any) -> None:
        key = tuple(_plain(f.get(k)) for k in ("filename", "line", "name")) if isinstance(f, dict) else (None,) * 3
        hit = by_text.get(key)
        if hit is None:
            s = single.site([f]) if isinstance(f, dict) else UNKNOWN_SITE
            cat = single.category([f]) if isinstance(f, dict) else "other"
            c = index.get(cat, EXCLUDED if cat in single.category_names and cat != "other" else none)
            hit = by_text[key] = (None if s == UNKNOWN_SITE else s, c)
        by_id_site[id(f)], by_id_cat[id(f)] = hit

    def site_of(f: Any) -> str | None:
        try:
            return by_id_site[id(f)]
        except KeyError:
            fill(f)
            return by_id_site[id(f)]

    def cat_of(f: Any) -> int:
        try:
            return by_id_cat[id(f)]
        except KeyError:
            fill(f)
            return by_id_cat[id(f)]

    return site_of, cat_of
