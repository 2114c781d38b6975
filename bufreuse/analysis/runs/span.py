"""Compare like with like: two logs that cover different iteration spans are compared over the span they share.

A log that stops at iteration 120 against one that runs to 2,130 compares the first 120 iterations of one run
with 2,000 of the other: late windows (a slower data loader, a warmer GPU, a checkpoint save) can flip the
verdict. When both runs carry iteration numbers (Megatron logs), :func:`common_span` finds each one's steady
span (the iterations its steady windows cover) and, when they differ, the span both cover; :func:`trim` keeps
the windows wholly inside it. ``compare`` then computes throughput and step time over the common span and
says so; memory peaks stay each log's own (Megatron reports memory once, after its first logging interval).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from bufreuse.analysis.runs.record import RunRecord

__all__ = ["Span", "common_span", "log_span", "trim"]

_SERIES = (("step_ms", "step_windows", "step_iters"), ("tflops", "tflops_windows", "tflops_iters"))
"""(values, window lengths, ending iterations) of each sampled series of a :class:`RunRecord`."""


@dataclass(kw_only=True, slots=True)
class Span:
    """Each run's steady span and the one they share, as ``(after, last)``: iterations ``after + 1 .. last``."""

    baseline: tuple[int, int]
    run: tuple[int, int]
    common: tuple[int, int] | None
    """None when the spans do not overlap."""
    left_out: dict[str, int]
    """Windows of each side outside the common span (keys ``baseline`` and ``run``)."""

    def caveat(self, base: str, run: str) -> str:
        """The sentence ``compare`` states above the verdicts."""
        a, b = _show(self.baseline), _show(self.run)
        if self.common is None:
            return (
                f"iteration spans differ and do not overlap ({base} {a}, {run} {b}): throughput and step time "
                "compared over different iterations"
            )
        parts = [f"{n} of {label}'s" for key, label in (("baseline", base), ("run", run))
                 if (n := self.left_out[key])]  # fmt: skip
        return (
            f"iteration spans differ ({base} {a}, {run} {b}): throughput and step time compared over the common "
            f"span, iterations {_show(self.common)} ({' and '.join(parts) or 'no'} window(s) left out); memory "
            "peaks are each log's own"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: each span as ``[first, last]`` iterations (1-based, inclusive)."""
        return {
            "baseline": _pair(self.baseline),
            "run": _pair(self.run),
            "common": _pair(self.common) if self.common is not None else None,
            "left_out_windows": dict(self.left_out),
        }


def _show(span: tuple[int, int]) -> str:
    return f"{span[0] + 1:,}–{span[1]:,}"


def _pair(span: tuple[int, int]) -> list[int]:
    return [span[0] + 1, span[1]]


def _columns(run: RunRecord, values: str, windows: str, iters: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The ending iterations and window lengths of one series, None when it has no iteration numbers."""
    it = getattr(run, iters)
    if not len(it) or len(it) != len(getattr(run, values)):
        return None
    ends = np.asarray(it, dtype=np.int64)
    w = getattr(run, windows)
    lengths = np.asarray(w, dtype=np.int64) if len(w) else np.ones(ends.size, dtype=np.int64)
    return ends, lengths


def log_span(run: RunRecord) -> tuple[int, int] | None:
    """``(after, last)``: the steady windows of ``run`` cover iterations ``after + 1 .. last``; None without
    iteration numbers (a sweep's measured steps, a memory-only log)."""
    spans = []
    for values, windows, iters in _SERIES:
        cols = _columns(run, values, windows, iters)
        if cols is not None and cols[0].size:
            ends, lengths = cols
            spans.append((int((ends - lengths).min()), int(ends.max())))
    if not spans:
        return None
    return min(s[0] for s in spans), max(s[1] for s in spans)


def common_span(base: RunRecord, run: RunRecord) -> Span | None:
    """The spans of two logs when they differ (None when equal, or when either has no iteration numbers)."""
    a, b = log_span(base), log_span(run)
    if a is None or b is None or a == b:
        return None
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    common = (lo, hi) if lo < hi else None
    left = {"baseline": 0, "run": 0}
    if common is not None:
        for key, r in (("baseline", base), ("run", run)):
            left[key] = _outside(r, common)
    return Span(baseline=a, run=b, common=common, left_out=left)


def _outside(run: RunRecord, span: tuple[int, int]) -> int:
    """Windows of ``run``'s longest series that are not wholly inside ``span``."""
    most = 0
    for values, windows, iters in _SERIES:
        cols = _columns(run, values, windows, iters)
        if cols is not None:
            ends, lengths = cols
            most = max(most, int(np.count_nonzero(~_inside(ends, lengths, span))))
    return most


def _inside(ends: np.ndarray, lengths: np.ndarray, span: tuple[int, int]) -> np.ndarray:
    return (ends - lengths >= span[0]) & (ends <= span[1])


def trim(run: RunRecord, span: tuple[int, int]) -> RunRecord:
    """A copy of ``run`` whose sampled series keep only the windows wholly inside ``span`` (peaks unchanged)."""
    changes: dict[str, Any] = {}
    for values, windows, iters in _SERIES:
        cols = _columns(run, values, windows, iters)
        if cols is None:
            continue
        keep = _inside(*cols, span)
        changes[values] = np.asarray(getattr(run, values), dtype=np.float64)[keep]
        changes[iters] = cols[0][keep]
        changes[windows] = cols[1][keep] if len(getattr(run, windows)) else []
    return dataclasses.replace(run, **changes)
