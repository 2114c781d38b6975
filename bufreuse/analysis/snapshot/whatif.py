"""What-if replay: a control trace re-run through the allocator model with some sites on rings.

``what_if(path, slots=[2, 4, 10])`` reads a control snapshot (``record_stream`` on the cross-stream
buffers), picks the blocks of the named sites (default: the built-in MoE categories, dispatch and
expert output), and replays the trace through :class:`~bufreuse.analysis.snapshot.allocator_model.AllocatorModel`
once per slot count:

- N = 0: the trace unchanged. Its max reserved against the snapshot's own is the model's
  calibration error, reported with every result.
- N > 0: each site becomes one ring: ``N × slot`` bytes (slot = the site's largest block, 512 B
  aligned) allocated through the model at the site's first allocation, on that block's stream, and
  never freed; the site's blocks then take no allocator memory and never wait in the pending-free
  queue (a ring slot is released at the tensor's free, not at ``free_completed``). A slot count below
  the most blocks of a site alive at once is infeasible (the ring would raise ``EarlyReuseError``).

Everything else replays as recorded: allocations and frees in trace order, a block freed with
``record_stream`` uses held until its ``free_completed``, ``segment_free`` runs as ``empty_cache``.
The state before the trace (segments, their live and pending blocks) is rebuilt from the final
segments and the trace. Per-event work is numpy; the model itself is one Python call per event.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bufreuse.analysis.snapshot.allocator_model import AllocatorModel, round_size
from bufreuse.analysis.snapshot.load import FinalState, SnapshotData, load_snapshot, normalise
from bufreuse.analysis.snapshot.replay import replay
from bufreuse.analysis.snapshot.schema import ACTIONS, ALLOC
from bufreuse.analysis.snapshot.sites import SiteRules
from bufreuse.analysis.snapshot.unpickle import load_pickle_file
from bufreuse.analysis.snapshot.whatif_trace import (
    FREE,
    FREE_PENDING,
    MALLOC,
    PEND,
    RingSite,
    TraceOps,
    classify_allocs,
    device_segments,
    max_split_size,
    settings_warnings,
)
from bufreuse.errors import InputError, SnapshotFormatError

__all__ = ["Prediction", "RingSite", "WhatIfResult", "measured_max_reserved", "what_if", "what_if_data"]


@dataclass(kw_only=True, slots=True)
class Prediction:
    slots: int
    feasible: bool
    max_reserved: int | None
    max_allocated: int | None
    max_active: int | None
    ring_bytes: int
    segments_allocated: int | None = None
    note: str = ""


@dataclass(kw_only=True, slots=True)
class WhatIfResult:
    file: str
    device: int
    measured_max_reserved: int
    measured_max_active: int
    rings: list[RingSite]
    predictions: list[Prediction]
    measured: dict[int, int] = field(default_factory=dict)  # slots -> a measured run's max reserved
    warnings: list[str] = field(default_factory=list)

    def error(self, p: Prediction) -> float | None:
        """(predicted − measured) / measured max reserved, for slot counts with a measured run."""
        m = self.measured.get(p.slots)
        if p.slots == 0 and m is None:
            m = self.measured_max_reserved
        if not m or p.max_reserved is None:
            return None
        return (p.max_reserved - m) / m

    @property
    def calibration(self) -> Prediction:
        return next(p for p in self.predictions if p.slots == 0)

    @property
    def calibration_error(self) -> float:
        """(model − snapshot) / snapshot max reserved of the unchanged trace."""
        m = self.calibration.max_reserved or 0
        return (m - self.measured_max_reserved) / self.measured_max_reserved if self.measured_max_reserved else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "device": self.device,
            "measured_max_reserved_bytes": self.measured_max_reserved,
            "measured_max_active_bytes": self.measured_max_active,
            "model_calibration_error": self.calibration_error,
            "rings": [
                {
                    "name": r.name,
                    "sites": r.sites,
                    "blocks": r.blocks,
                    "slot_bytes": r.slot_bytes,
                    "min_slots": r.min_slots,
                    "stream": r.stream,
                }
                for r in self.rings
            ],
            "predictions": [
                {
                    "slots": p.slots,
                    "feasible": p.feasible,
                    "max_reserved_bytes": p.max_reserved,
                    "max_allocated_bytes": p.max_allocated,
                    "max_active_bytes": p.max_active,
                    "ring_bytes": p.ring_bytes,
                    "segments_allocated": p.segments_allocated,
                    "note": p.note,
                    "measured_max_reserved_bytes": self.measured.get(p.slots),
                    "error": self.error(p),
                }
                for p in self.predictions
            ],
            "warnings": self.warnings,
        }


def what_if(
    path: str | os.PathLike[str],
    slots: Sequence[int],
    *,
    sites: Sequence[str] = (),
    categories: Mapping[str, str] | None = None,
    site_frame: int = 0,
    measured: Mapping[int, str | os.PathLike[str]] | None = None,
) -> WhatIfResult:
    """Predict max reserved / allocated for each slot count (N = 0 always added, as calibration).

    Args:
        path: a control snapshot with a trace (``torch.cuda.memory._dump_snapshot``).
        slots: slot counts to predict, each ≥ 1 (0 is the unchanged trace and always included).
        sites: regexes searched in a block's site (``path:line:function`` of its first user frame);
            each is one ring. Empty: the built-in categories (plus ``categories``), one ring each.
        categories: extra ``name -> regex`` category rules (on the alloc stack), as snapshot-report.
        site_frame: which user frame names a site (0 = innermost).
        measured: slot count -> a measured run (its snapshot, or its ``metrics.json``) to compare with.

    Raises:
        SnapshotFormatError: unreadable file, or a snapshot without a trace.
        InputError: a bad pattern or slot count, or no block matching the sites.
    """
    was = gc.isenabled()
    gc.disable()  # objects from a pickle form no cycles; the collector would scan them ~10 times
    try:
        raw = load_pickle_file(path)
        data = normalise(raw, path=str(path))
        result = what_if_data(data, raw, slots, sites=sites, categories=categories, site_frame=site_frame)
        result.measured = {n: measured_max_reserved(p) for n, p in (measured or {}).items()}
        return result
    finally:
        if was:
            gc.enable()


def what_if_data(
    data: SnapshotData,
    raw: Any,
    slots: Sequence[int],
    *,
    sites: Sequence[str] = (),
    categories: Mapping[str, str] | None = None,
    site_frame: int = 0,
) -> WhatIfResult:
    """:func:`what_if` on a loaded snapshot (``raw`` = the unpickled object, for its segments)."""
    if any(n < 0 for n in slots):
        raise InputError(f"--slots must be >= 0, got {list(slots)}")
    if not data.traces:
        raise SnapshotFormatError(
            f"{data.path}: no trace entries; what-if replays the trace (record with "
            "torch.cuda.memory._record_memory_history())"
        )
    try:
        rules = SiteRules(site_frame=site_frame, categories=dict(categories or {}))
        patterns = [(p, re.compile(p)) for p in sites]
    except (re.error, ValueError) as e:
        raise InputError(f"bad --site/--category pattern: {e}") from None
    replays = {d: replay(t, data.final.get(d, FinalState())) for d, t in data.traces.items()}
    dev = max(replays, key=lambda d: replays[d].max_reserved)
    t, rp = data.traces[dev], replays[dev]
    if not np.any(t.action == ALLOC):
        codes, counts = np.unique(t.action, return_counts=True)
        held = ", ".join(f"{c} {ACTIONS[a] if a < len(ACTIONS) else 'other'}" for a, c in
                         zip(codes.tolist(), counts.tolist(), strict=True))  # fmt: skip
        raise InputError(
            f"{data.path}: the trace holds no allocations (device {dev}: {held}), so nothing can be put on a ring; "
            "record with torch.cuda.memory._record_memory_history() before the training steps"
        )
    warnings = list(data.warnings) + settings_warnings(raw)
    ops = TraceOps.build(t, device_segments(raw, dev), warnings)
    max_split = max_split_size(raw)
    counts = sorted({0, *slots})
    with _Runner(ops, max_split, jobs=len(counts) if len(ops.code) >= PARALLEL_MIN_OPS else 1) as run:
        control = run.submit(np.zeros(0, dtype=np.int64), [], 0)  # N = 0 needs no sites: starts first
        ring_of, rings = classify_allocs(t, ops, rules, patterns)
        if not rings:
            wanted = ", ".join(n for n, _ in patterns) if patterns else ", ".join(rules.ring_category_names)
            raise InputError(
                f"{data.path}: no allocation in the trace matches the sites ({wanted}); see snapshot-report"
            )
        if not patterns:
            no_moe = [r.name for r in rings if not r.moe_frame]
            if no_moe:
                raise InputError(
                    f"{data.path}: category {', '.join(no_moe)} has no MoE frame (token_dispatcher, grouped_linear, "
                    "...) in any of its stacks: no ring is built from it; name MoE sites with --site"
                )
        pending: list[Any] = [control]
        for n in counts[1:]:
            short = [r for r in rings if r.min_slots > n]
            if short:
                note = "; ".join(f"{r.name} has {r.min_slots} blocks alive at once" for r in short)
                pending.append(Prediction(slots=n, feasible=False, max_reserved=None, max_allocated=None,
                                          max_active=None, ring_bytes=0, note=note))  # fmt: skip
            else:
                pending.append(run.submit(ring_of, rings, n))
        preds = [p if isinstance(p, Prediction) else p.result() for p in pending]
    return WhatIfResult(
        file=data.path,
        device=dev,
        measured_max_reserved=rp.max_reserved,
        measured_max_active=rp.max_active,
        rings=rings,
        predictions=preds,
        warnings=warnings,
    )


PARALLEL_MIN_OPS = 200_000
"""Traces with at least this many operations replay each slot count in its own forked process."""

_SHARED: tuple[TraceOps, int | None] | None = None  # what forked workers inherit (never pickled)


class _Runner:
    """Run :func:`_simulate` per slot count: inline, or in forked workers that inherit the operations."""

    def __init__(self, ops: TraceOps, max_split: int | None, *, jobs: int) -> None:
        self.ops, self.max_split = ops, max_split
        workers = min(jobs, os.cpu_count() or 1)
        fork = "fork" in multiprocessing.get_all_start_methods()
        self.pool: ProcessPoolExecutor | None = None
        if workers > 1 and fork:
            global _SHARED
            _SHARED = (ops, max_split)
            self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))

    def __enter__(self) -> _Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        global _SHARED
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        _SHARED = None

    def submit(self, ring_of: np.ndarray, rings: list[RingSite], n: int) -> Future[Prediction]:
        if self.pool is not None:
            return self.pool.submit(_simulate_shared, ring_of, rings, n)
        fut: Future[Prediction] = Future()
        fut.set_result(_simulate(self.ops, ring_of, rings, n, self.max_split))
        return fut


def _simulate_shared(ring_of: np.ndarray, rings: list[RingSite], n: int) -> Prediction:
    if _SHARED is None:
        raise RuntimeError("what-if worker started without the inherited trace (needs the fork start method)")
    return _simulate(_SHARED[0], ring_of, rings, n, _SHARED[1])


def measured_max_reserved(path: str | os.PathLike[str]) -> int:
    """A run's max reserved: ``max_reserved_bytes`` of a ``metrics.json``, else a snapshot's replay."""
    if str(path).endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                v = json.load(f).get("max_reserved_bytes")
        except (OSError, ValueError, AttributeError) as e:
            raise InputError(f"{path}: cannot read max_reserved_bytes ({e})") from None
        if type(v) is not int:
            raise InputError(f"{path}: max_reserved_bytes is {v!r}, expected an int")
        return v
    data = load_snapshot(path)
    if not data.traces:
        return max((f.reserved for f in data.final.values()), default=0)
    return max(replay(t, data.final.get(d, FinalState())).max_reserved for d, t in data.traces.items())


def _simulate(ops: TraceOps, ring_of: np.ndarray, rings: list[RingSite], n: int, max_split: int | None) -> Prediction:
    """One replay through the model with every ring at ``n`` slots (``n = 0``: no rings)."""
    model = AllocatorModel(max_split_size=max_split)
    where: dict[int, int] = {}
    for seg_addr, seg_size, stream, small in ops.segments:
        blocks = ops.used[seg_addr]
        model.add_segment(seg_addr, seg_size, stream, small=small, used=[(b[0], b[1]) for b in blocks])
        for b_addr, _, bid, pending in blocks:
            where[bid] = b_addr
            if pending:
                model.mark_pending(b_addr)
    code, index = ops.code, ops.index
    size = ops.rounded[index]
    ring_bytes = 0
    if n > 0:
        g = ring_of[index]
        keep = g < 0
        size = size.copy()
        for k, r in enumerate(rings):  # the ring's storage: one allocation at the site's first alloc
            first = int(np.argmax(g == k))
            keep[first] = True
            size[first] = round_size(n * r.slot_bytes)
            ring_bytes += n * r.slot_bytes
        code, index, size = code[keep], index[keep], size[keep]
    malloc, free, pend, empty = model.malloc, model.free, model.pend, model.release_cached
    for c, bid, s, st in zip(code.tolist(), ops.owner[index].tolist(), size.tolist(), ops.stream[index].tolist(),
                             strict=True):  # fmt: skip
        if c == MALLOC:
            where[bid] = malloc(s, st)
        elif c == FREE:
            x = where.pop(bid, None)
            if x is not None:
                free(x)
        elif c == PEND:
            x = where.get(bid)
            if x is not None:
                pend(x)
        elif c == FREE_PENDING:
            x = where.pop(bid, None)
            if x is not None:
                free(x, pending=True)
        else:
            empty()
    ms = model.stats
    return Prediction(
        slots=n,
        feasible=True,
        max_reserved=ms.max_reserved,
        max_allocated=ms.max_allocated,
        max_active=ms.max_active,
        ring_bytes=ring_bytes,
        segments_allocated=ms.segments_allocated,
    )
