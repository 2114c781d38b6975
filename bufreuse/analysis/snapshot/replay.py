"""Replay a trace's columns into reserved / allocated / pending-free bytes after every event.

All three series are linear in the events, so each is a baseline plus a cumulative sum (vectorised,
no per-event Python). The baselines are reconstructed from the final state: what the
segments and blocks hold at dump time minus the trace's net change. That makes memory that
existed before recording started (weights, say) count, and keeps the figures right when the
recording ring buffer dropped the oldest entries (frees whose alloc is gone).

- reserved: ``segment_alloc``/``segment_map`` add, ``segment_free``/``segment_unmap`` subtract.
- allocated: ``alloc`` adds, ``free_requested`` subtracts (the tensor is gone).
- pending free: ``free_requested`` adds, ``free_completed`` subtracts (the block waits for the
  events recorded by ``record_stream`` before the allocator may reuse it).
- active = allocated + pending free.

A ``free_completed`` whose ``free_requested`` is not in the trace (torch 2.0's default
``trace_alloc_max_entries=1`` keeps one entry) leaves the queue before it unknown: its bytes were
pending before recording began, for a reason the trace cannot tell. They are kept apart
(``pending_before_trace``), never counted as blocks waiting on ``record_stream``, and the replay
says whether the max-active point moves without them.

Sizes in alloc/free entries are requested bytes (torch records ``requested_size``), so the
final-state baselines use the blocks' requested bytes too.

Sizes are unsigned 64-bit and a hostile (or corrupt) file can make any sum pass 2^63, so the
series are int64 only when the sum of every size and baseline provably fits; otherwise they are
exact Python ints (object arrays: slower, never wrapped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bufreuse.analysis.snapshot.load import EventTable, FinalState
from bufreuse.analysis.snapshot.schema import ALLOC, FREE_DONE, FREE_REQ, SEG_ALLOC, SEG_FREE, SEG_MAP, SEG_UNMAP

__all__ = ["PendingBlock", "Replay", "pending_blocks_at", "replay"]


@dataclass(kw_only=True, slots=True)
class Replay:
    """Series after each event (index i = state after event i) and the points that matter."""

    reserved: np.ndarray
    allocated: np.ndarray
    pending: np.ndarray
    reserved_baseline: int
    allocated_baseline: int
    pending_baseline: int
    max_reserved: int
    max_reserved_index: int  # -1: the maximum is the state before the first event
    max_active: int
    max_active_index: int
    frees_without_alloc: int  # free_requested whose alloc is not in the trace (allocated before it)
    completions_without_request: int  # free_completed with no free_requested before it
    pending_before_trace: np.ndarray | None = None
    """Bytes of the pending series already pending when the trace began (cause unknown); None: none."""
    max_active_known: int = 0
    """Max of active less the pending-before-trace bytes, and its index: where the peak is without them."""
    max_active_known_index: int = -1
    max_reserved_in_segments: int = 0
    """Max of the reserved series as the segment entries give it; ``max_reserved`` is this, or max active when
    the trace and final state disagree so that active tops it (reserved can never hold less than active)."""
    warnings: list[str] = field(default_factory=list)

    @property
    def active(self) -> np.ndarray:
        return self.allocated + self.pending

    def before_trace_at(self, index: int) -> int:
        """Pending-before-trace bytes after event ``index`` (-1: before the first event, all of the baseline)."""
        if index < 0:
            return self.pending_baseline
        return int(self.pending_before_trace[index]) if self.pending_before_trace is not None else 0


@dataclass(kw_only=True, slots=True)
class PendingBlock:
    """A block in the pending-free queue at some event: where it was freed and allocated."""

    free_index: int
    alloc_index: int  # -1 when its alloc is not in the trace
    addr: int
    size: int
    stream: int


_SAFE = 1 << 61  # sums below this (float64-estimated, with margin) cannot wrap in int64


def _signed_sizes(t: EventTable, final: FinalState) -> np.ndarray:
    """The size column as int64 when every cumulative sum fits in it, else as exact Python ints."""
    total = float(np.sum(t.size, dtype=np.float64)) if len(t) else 0.0
    total += float(final.reserved) + float(final.allocated_requested) + float(final.pending_requested)
    if total < _SAFE:
        return t.size.astype(np.int64)
    return t.size.astype(object)


def _delta(t: EventTable, size: np.ndarray, plus: tuple[int, ...], minus: tuple[int, ...]) -> np.ndarray:
    sign = np.zeros(len(t), dtype=np.int64)
    sign[np.isin(t.action, plus)] = 1
    sign[np.isin(t.action, minus)] = -1
    return sign * size


def replay(t: EventTable, final: FinalState) -> Replay:
    """Replay one device's trace against its final state; never raises on inconsistent traces."""
    warnings: list[str] = []
    size = _signed_sizes(t, final)
    reserved = np.cumsum(_delta(t, size, (SEG_ALLOC, SEG_MAP), (SEG_FREE, SEG_UNMAP)))
    allocated = np.cumsum(_delta(t, size, (ALLOC,), (FREE_REQ,)))
    pend_delta = _delta(t, size, (FREE_REQ,), (FREE_DONE,))
    quick = _immediate_frees(t)  # a plain free: never waits in the queue
    pend_delta[quick] = 0
    pend_delta[quick + 1] = 0
    orphan_frees, orphan_done = _orphans(t)
    known_delta = pend_delta.copy()
    known_delta[orphan_done] = 0
    known = np.cumsum(known_delta)  # blocks whose free_requested is in the trace: record_stream waits
    pending = np.cumsum(pend_delta)
    n = len(t)
    net = (int(reserved[-1]), int(allocated[-1]), int(pending[-1])) if n else (0, 0, 0)
    base_r = final.reserved - net[0]
    base_a = final.allocated_requested - net[1]
    base_p = final.pending_requested - net[2]
    reserved += base_r
    allocated += base_a
    pending += base_p
    for name, base, series in (("reserved", base_r, reserved), ("allocated", base_a, allocated)):
        low = min(base, int(series.min()) if n else base)
        if low < 0:
            warnings.append(
                f"{name} bytes go negative ({low}) in the replay: the trace and the final segments disagree "
                "(entries skipped with skip_actions, or a snapshot of another device?)"
            )
    if (n and int(pending.min()) < 0) or base_p < 0:
        warnings.append("pending-free bytes go negative in the replay: free_completed entries without requests")
    unknown = bool(len(orphan_done)) or base_p > 0
    before = pending - known if n and unknown else None  # starts at base_p: nothing known pends before event 0
    if n:
        ir = int(np.argmax(reserved))
        max_r, ir = (int(reserved[ir]), ir) if reserved[ir] > base_r else (base_r, -1)
        max_a, ia = _peak(allocated + pending, pending, base_a + base_p)
        max_k, ik = _peak(allocated + known, known, base_a) if unknown else (max_a, ia)
    else:
        max_r, ir, max_a, ia = final.reserved, -1, final.allocated_requested + final.pending_requested, -1
        max_k, ik = final.allocated_requested, -1
    max_r_segments = max_r
    if max_a > max_r:  # impossible: an allocation lives in reserved memory; the allocations are the direct count
        warnings.append(
            f"the trace and final state disagree: replayed max active ({_mib(max_a)}) tops the max reserved the "
            f"segment entries give ({_mib(max_r)}); max reserved is shown as max active, a lower bound "
            "(segment entries skipped with skip_actions, or a final state from another device?)"
        )
        max_r, ir = max_a, ia
    orphan_dones = len(orphan_done)
    if orphan_frees:
        warnings.append(
            f"{orphan_frees} frees of blocks whose alloc is not in the trace: memory that predates recording "
            "(allocated before the first trace entry, counted from the final state); only if recording was "
            "already on when they were allocated did the recording ring buffer drop their allocs (max_entries)"
        )
    if unknown:
        moved = "moves" if ik != ia else "does not move"
        warnings.append(
            f"{_mib(base_p)} pending free before the trace began ({orphan_dones} free_completed entries without "
            "their free_requested): cause unknown, not counted as blocks waiting on record_stream; "
            f"the max-active point {moved} without them"
        )
    return Replay(
        reserved=reserved,
        allocated=allocated,
        pending=pending,
        reserved_baseline=base_r,
        allocated_baseline=base_a,
        pending_baseline=base_p,
        max_reserved=max_r,
        max_reserved_index=ir,
        max_active=max_a,
        max_active_index=ia,
        frees_without_alloc=orphan_frees,
        completions_without_request=orphan_dones,
        pending_before_trace=before,
        max_active_known=max_k,
        max_active_known_index=ik,
        max_reserved_in_segments=max_r_segments,
        warnings=warnings,
    )


def _peak(active: np.ndarray, pending: np.ndarray, baseline: int) -> tuple[int, int]:
    """Max of ``active`` and its index (-1: the state before the first event is the max).

    Ties: a free_requested moves bytes from allocated to pending and keeps active flat, so the tied
    point with the longest pending-free queue wins (the one the report is about).
    """
    peak = active.max()
    if peak <= baseline:
        return baseline, -1
    tied = np.flatnonzero(active == peak)
    return int(peak), int(tied[np.argmax(pending[tied])])


def _mib(n: int) -> str:
    """``12.5 MiB``; below 1 MiB the bytes themselves (a small figure must not read as ``0.0 MiB``)."""
    return f"{n / (1 << 20):,.1f} MiB" if abs(n) >= 1 << 20 else f"{n:,} B"


def _immediate_frees(t: EventTable) -> np.ndarray:
    """Indices of ``free_requested`` entries whose ``free_completed`` is the very next entry.

    The allocator records both under one lock when the block has no pending stream uses, so such a
    block is never in the pending-free queue; counting it there would put every plain free at the
    max-active point.
    """
    a = t.action
    if len(a) < 2:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero((a[:-1] == FREE_REQ) & (a[1:] == FREE_DONE) & (t.addr[:-1] == t.addr[1:]))


def _sorted_by_addr(t: EventTable, codes: tuple[int, ...], upto: int | None = None) -> np.ndarray:
    """Indices of the events with these codes (up to ``upto`` inclusive), ordered by (addr, index)."""
    act = t.action if upto is None else t.action[: upto + 1]
    idx = np.flatnonzero(np.isin(act, codes))
    return idx[np.argsort(t.addr[idx], kind="stable")]


def _orphans(t: EventTable) -> tuple[int, np.ndarray]:
    """Frees whose previous event on that address is not an alloc (a count), and the indices of
    completions whose previous event there is not their request."""
    idx = _sorted_by_addr(t, (ALLOC, FREE_REQ, FREE_DONE))
    if len(idx) == 0:
        return 0, np.zeros(0, dtype=np.int64)
    act, addr = t.action[idx], t.addr[idx]
    prev_act = np.concatenate(([-1], act[:-1]))
    same = np.concatenate(([False], addr[1:] == addr[:-1]))
    orphan_free = (act == FREE_REQ) & ~(same & (prev_act == ALLOC))
    orphan_done = (act == FREE_DONE) & ~(same & (prev_act == FREE_REQ))
    return int(orphan_free.sum()), idx[orphan_done]


def pending_blocks_at(t: EventTable, index: int) -> list[PendingBlock]:
    """Blocks whose ``free_requested`` came at or before ``index`` and whose completion did not.

    Costs two stable sorts over the alloc/free events up to ``index``; the result is usually tens
    to thousands of blocks, each carrying the index of its ``alloc`` event (for its frames).
    """
    if index < 0:
        return []
    idx = _sorted_by_addr(t, (ALLOC, FREE_REQ, FREE_DONE), upto=index)
    if len(idx) == 0:
        return []
    act, addr = t.action[idx], t.addr[idx]
    nxt_same = np.concatenate((addr[1:] == addr[:-1], [False]))
    # the last event on an address decides its state; a pending block's last event is its free request
    last = ~nxt_same
    sel = np.flatnonzero(last & (act == FREE_REQ))
    prev_same = np.concatenate(([False], addr[1:] == addr[:-1]))
    a = t.action
    quick = index + 1 < len(a) and a[index] == FREE_REQ and a[index + 1] == FREE_DONE
    quick = quick and t.addr[index] == t.addr[index + 1]  # a plain free at ``index``: not queued
    out = []
    for p in sel:
        if quick and int(idx[p]) == index:
            continue
        has_alloc = p > 0 and prev_same[p] and act[p - 1] == ALLOC
        i = int(idx[p])
        out.append(
            PendingBlock(
                free_index=i,
                alloc_index=int(idx[p - 1]) if has_alloc else -1,
                addr=int(t.addr[i]),
                size=int(t.size[i]),
                stream=int(t.stream[i]),
            )
        )
    return out
