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
    frees_without_alloc: int  # free_requested whose alloc is not in the trace (ring buffer cut it)
    completions_without_request: int  # free_completed with no free_requested before it
    warnings: list[str] = field(default_factory=list)

    @property
    def active(self) -> np.ndarray:
        return self.allocated + self.pending


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
    if n:
        ir = int(np.argmax(reserved))
        max_r, ir = (int(reserved[ir]), ir) if reserved[ir] > base_r else (base_r, -1)
        active = allocated + pending
        peak = active.max()
        if peak > base_a + base_p:
            # ties: a free_requested moves bytes from allocated to pending and keeps active flat, so
            # take the tied point with the longest pending-free queue (the one the report is about)
            tied = np.flatnonzero(active == peak)
            ia = int(tied[np.argmax(pending[tied])])
            max_a = int(peak)
        else:
            max_a, ia = base_a + base_p, -1
    else:
        max_r, ir, max_a, ia = final.reserved, -1, final.allocated_requested + final.pending_requested, -1
    orphan_frees, orphan_done = _orphans(t)
    if orphan_frees:
        warnings.append(
            f"{orphan_frees} frees of blocks whose alloc is not in the trace (the recording ring buffer "
            "dropped the oldest entries: raise max_entries)"
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
        completions_without_request=orphan_done,
        warnings=warnings,
    )


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


def _orphans(t: EventTable) -> tuple[int, int]:
    """Count frees whose previous event on that address is not an alloc, and completions likewise."""
    idx = _sorted_by_addr(t, (ALLOC, FREE_REQ, FREE_DONE))
    if len(idx) == 0:
        return 0, 0
    act, addr = t.action[idx], t.addr[idx]
    prev_act = np.concatenate(([-1], act[:-1]))
    same = np.concatenate(([False], addr[1:] == addr[:-1]))
    frees = act == FREE_REQ
    orphan_free = frees & ~(same & (prev_act == ALLOC))
    orphan_done = (act == FREE_DONE) & ~(same & (prev_act == FREE_REQ))
    return int(orphan_free.sum()), int(orphan_done.sum())


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
