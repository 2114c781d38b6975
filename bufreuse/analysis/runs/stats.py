"""Statistics of runs: sample summaries, the bootstrap CI of a median difference, per-run figures.

Data in, numbers out; :mod:`.verdicts` turns the numbers into verdicts against noise bands.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

from bufreuse.analysis.runs.record import MIB, RunRecord

__all__ = ["bootstrap_diff", "bootstrap_median_diff", "mean_diff_interval", "metric_values", "run_stats", "summarise"]


def _weights(values: Sequence[float], weights: Sequence[int] | None) -> np.ndarray:
    """Integer weights (iterations per log window), one per value; all 1 when not given (then, or when every
    weight is the same, one value read as the whole column: a long log's weights take no memory)."""
    if weights is None or not len(weights):
        return np.broadcast_to(np.int64(1), (len(values),))
    if len(weights) != len(values):
        raise ValueError(f"{len(weights)} weights for {len(values)} values")
    w = np.asarray(weights, dtype=np.int64)
    if w.ndim and w.strides[0] == 0:
        return np.broadcast_to(np.int64(max(int(w[0]), 1)), w.shape)
    return np.maximum(w, 1)


def summarise(values: Sequence[float], weights: Sequence[int] | None = None) -> dict[str, float | int | None]:
    """Mean, median, p10, p90, min, max and count of a sample (None entries when empty).

    ``weights`` (iterations per log window) make each value count as that many iterations:
    figures are those of the per-iteration sample the windows stand for (``np.percentile``'s linear
    method on it, read from cumulative weights, never by repeating values); ``n`` counts windows.
    """
    if not len(values):
        return {"n": 0, "mean": None, "median": None, "p10": None, "p90": None, "min": None, "max": None}
    v, w = np.asarray(values, dtype=float), _weights(values, weights)
    if int(w.max()) == 1:
        p10, p50, p90 = np.percentile(v, [10, 50, 90])
        mean = float(v.mean())
    elif bool(np.isnan(v).any()):
        p10 = p50 = p90 = mean = math.nan
    else:
        order = np.argsort(v, kind="stable")
        ordered, cum = v[order], np.cumsum(w[order])
        p10, p50, p90 = (_percentile(ordered, cum, q) for q in (0.1, 0.5, 0.9))
        mean = float(np.dot(v, w.astype(float)) / float(cum[-1]))
    return {
        "n": len(values),
        "mean": float(mean),
        "median": float(p50),
        "p10": float(p10),
        "p90": float(p90),
        "min": float(v.min()),
        "max": float(v.max()),
    }


def _percentile(ordered: np.ndarray, cum: np.ndarray, q: float) -> float:
    """Quantile ``q`` of the sample where ``ordered[i]`` (ascending) repeats until the cumulative weight
    ``cum[i]``, as ``np.percentile`` (linear) computes it on that sample."""
    n = int(cum[-1])

    def element(k: int) -> float:  # the k-th (0-based) element of the repeated sample
        return float(ordered[int(np.searchsorted(cum, k, side="right"))])

    h = (n - 1) * q
    if h >= n - 1:
        return element(n - 1)
    lo = math.floor(h)
    a, b, t = element(lo), element(lo + 1), h - lo
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t  # numpy's _lerp, rounding included


def _boot_stat(values: np.ndarray, weights: np.ndarray, idx: np.ndarray, stat: str) -> np.ndarray:
    """``stat`` (mean / median) of each resample ``idx`` (rows), weighted like :func:`summarise`."""
    v, w = values[idx], weights[idx].astype(float)
    if stat == "mean":
        return (v * w).sum(axis=1) / w.sum(axis=1)
    order = np.argsort(v, axis=1, kind="stable")
    v, w = np.take_along_axis(v, order, axis=1), np.take_along_axis(w, order, axis=1)
    cum, half = np.cumsum(w, axis=1), w.sum(axis=1, keepdims=True) / 2
    # the median of the repeated sample: mean of its two middle elements (one when the total is odd)
    lo = np.argmax(cum >= half, axis=1)
    hi = np.argmax(cum > half, axis=1)
    rows = np.arange(v.shape[0])
    return (v[rows, lo] + v[rows, hi]) / 2


def _boot_medians(ordered: np.ndarray, w: np.ndarray | None, order: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """:func:`_boot_stat`'s medians in O(windows) per resample: counts of each window, not a sort.

    ``ordered`` are the values sorted once (``order``), ``w`` their weights (None: all 1); a resample is
    how often it drew each window, so its cumulative weight over the sorted values finds the same two
    middle elements the sorted resample has (equal results).
    """
    out = np.empty(idx.shape[0])
    for r, row in enumerate(idx):
        counts = np.bincount(row, minlength=order.size)[order]
        cum = np.cumsum(counts if w is None else counts * w)
        half = cum[-1] / 2
        lo, hi = np.searchsorted(cum, half, side="left"), np.searchsorted(cum, half, side="right")
        out[r] = (ordered[lo] + ordered[hi]) / 2
    return out


_BOOT_CELLS = 1 << 21
"""Resampled values (resamples x windows) drawn at a time: 16 MiB of indices, whatever the sample size."""
_SORT_BELOW = 64
"""Samples smaller than this are resampled with sorts (:func:`_boot_stat`), larger ones by counts."""


GROUPED_ABOVE = 1 << 16
"""Samples of more windows than this are resampled by group counts (:func:`_grouped_medians`): a draw
costs O(groups), not O(windows), so a million-window log needs no million resamples of a million."""
MAX_GROUPS = 4096
"""Most groups a grouped resample draws counts for (values binned above it: :func:`_groups`)."""


def _groups(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """``(group values ascending, group weights, windows per group, bin width)`` of a large sample.

    Windows with the same value and weight are one group: resampling windows with replacement is then
    drawing each group's count from a multinomial, exactly. Logs print 1-2 decimals, so a million windows
    make a few thousand groups. Past :data:`MAX_GROUPS`, values within the weighted middle half are binned
    to 1/:data:`MAX_GROUPS` of its width (each resampled median moves by at most that, the bin width
    returned) and values outside it are lumped at its ends: a resample median of more than
    :data:`GROUPED_ABOVE` windows lies that far from the sample median with probability far below 1e-9.
    """
    const = not weights.strides[0]  # one weight for all (a long log's usual case): groups of values alone

    def group(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if const:
            u, c = np.unique(v, return_counts=True)
            return u, np.full(u.size, float(weights[0])), c
        pairs, c = np.unique(np.stack([v, weights.astype(float)]), axis=1, return_counts=True)
        return pairs[0], pairs[1], c

    v, w, counts = group(values)
    width = 0.0
    if v.size > MAX_GROUPS:
        if const:
            lo, hi = (float(q) for q in np.quantile(values, [0.25, 0.75]))
        else:
            order = np.argsort(values, kind="stable")
            cum = np.cumsum(weights[order])
            lo, hi = (float(values[order[np.searchsorted(cum, q * cum[-1])]]) for q in (0.25, 0.75))
            del order, cum
        width = (hi - lo) / (MAX_GROUPS - 2) if hi > lo else 0.0
        binned = np.clip(values, lo, hi)
        if width:
            binned = lo + np.round((binned - lo) / width) * width
        v, w, counts = group(binned)
        if v.size > MAX_GROUPS:  # many distinct weights: one weight per value bin (their mean)
            u, inv = np.unique(v, return_inverse=True)
            n = np.bincount(inv, weights=counts)
            return u, np.bincount(inv, weights=counts * w) / n, n.astype(np.int64), width
    return v, w, counts.astype(np.int64), width


def _grouped_medians(
    values: np.ndarray, weights: np.ndarray, n: int, rng: np.random.Generator, n_boot: int
) -> np.ndarray:
    """Weighted medians of ``n_boot`` resamples of ``n`` windows, each drawn as multinomial group counts."""
    v, w, k, _ = _groups(values, weights)
    p = k / k.sum()
    out = np.empty(n_boot)
    step = max(1, _BOOT_CELLS // v.size)
    for start in range(0, n_boot, step):
        counts = rng.multinomial(n, p, size=min(step, n_boot - start))
        cum = np.cumsum(counts * w, axis=1)
        half = cum[:, -1:] / 2
        lo, hi = np.argmax(cum >= half, axis=1), np.argmax(cum > half, axis=1)
        out[start : start + counts.shape[0]] = (v[lo] + v[hi]) / 2
    return out


def _bootstrap(values: np.ndarray, weights: np.ndarray, rng: np.random.Generator, n_boot: int, stat: str) -> np.ndarray:
    """``stat`` of ``n_boot`` resamples, drawn :data:`_BOOT_CELLS` at a time (the same draws as all at once);
    medians of more than :data:`GROUPED_ABOVE` windows from group counts."""
    n = values.size
    if stat == "median" and n > GROUPED_ABOVE:
        return _grouped_medians(values, weights, n, rng, n_boot)
    step = max(1, _BOOT_CELLS // n)
    by_sort = stat == "mean" or n < _SORT_BELOW
    if not by_sort:
        order = np.argsort(values, kind="stable")
        ordered = values[order]
        w = None if int(weights.max()) == 1 else weights[order].astype(float)
    parts = []
    for start in range(0, n_boot, step):
        idx = rng.integers(0, n, size=(min(step, n_boot - start), n))
        parts.append(_boot_stat(values, weights, idx, stat) if by_sort else _boot_medians(ordered, w, order, idx))
    return np.concatenate(parts)


def _t_quantile(p: float, df: float) -> float:
    """Student-t quantile by the Cornish-Fisher expansion (within 1% of exact for df >= 2)."""
    z = NormalDist().inv_cdf(p)
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4)
    )


def mean_diff_interval(
    base: Sequence[float],
    other: Sequence[float],
    *,
    base_weights: Sequence[int] | None = None,
    other_weights: Sequence[int] | None = None,
    level: float = 0.95,
) -> tuple[float, float] | None:
    """Welch interval of mean(other) - mean(base); None with fewer than 3 samples a side.

    A window averaging ``w`` iterations counts as a sample of variance sigma^2 / w: the mean is
    weighted by ``w`` and its variance is sigma^2 / sum(w), sigma^2 estimated from the weighted
    residuals over n - 1 (equal weights: the textbook Welch interval).
    """
    if len(base) < 3 or len(other) < 3:
        return None
    parts = []
    for values, weights in ((base, base_weights), (other, other_weights)):
        x, wi = np.asarray(values, dtype=float), _weights(values, weights)
        if not wi.strides[0]:  # one weight for all: the unweighted figures (no weight column in memory)
            mean = float(x.mean())
            var_mean = float(x.var(ddof=1)) / x.size
        else:
            w = wi.astype(float)
            mean = float((w * x).sum() / w.sum())
            var_mean = float((w * (x - mean) ** 2).sum() / (x.size - 1) / w.sum())
        parts.append((mean, var_mean, x.size - 1))
    (ma, va, da), (mb, vb, db) = parts
    se2 = va + vb
    diff = mb - ma
    if se2 <= 0:
        return diff, diff
    df = se2**2 / ((va**2 / da if va else 0.0) + (vb**2 / db if vb else 0.0))
    half = _t_quantile(0.5 + level / 2, max(df, 1.0)) * math.sqrt(se2)
    return diff - half, diff + half


def bootstrap_diff(
    base: Sequence[float],
    other: Sequence[float],
    *,
    stat: str = "median",
    base_weights: Sequence[int] | None = None,
    other_weights: Sequence[int] | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float] | None:
    """Percentile-bootstrap CI of stat(other) - stat(base) (``stat``: mean or median), windows
    resampled whole and weighted by their iterations; None with fewer than 3 samples a side."""
    if len(base) < 3 or len(other) < 3:
        return None
    if stat not in ("mean", "median"):
        raise ValueError(f"stat must be mean or median, got {stat!r}")
    rng = np.random.default_rng(seed)
    a, b = np.asarray(base, dtype=float), np.asarray(other, dtype=float)
    wa, wb = _weights(base, base_weights), _weights(other, other_weights)
    ma = _bootstrap(a, wa, rng, n_boot, stat)
    mb = _bootstrap(b, wb, rng, n_boot, stat)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(mb - ma, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_median_diff(
    base: Sequence[float], other: Sequence[float], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float] | None:
    """Percentile-bootstrap CI of median(other) - median(base); None with fewer than 3 samples a side."""
    return bootstrap_diff(base, other, stat="median", n_boot=n_boot, seed=seed, level=level)


def run_stats(run: RunRecord) -> dict[str, Any]:
    """One run's figures in display units (MiB, TFLOP/s/GPU, ms), as ``compare --json`` lists them."""
    return {
        "status": run.status,
        "tflops": summarise(run.tflops, run.tflops_windows),
        "tflops_value": run.tflops_value,
        "step_ms": summarise(run.step_ms, run.step_windows),
        "max_allocated_mib": _mib(run.max_allocated_bytes),
        "max_reserved_mib": _mib(run.max_reserved_bytes),
        "max_active_mib": _mib(run.max_active_bytes),
        "device_used_mib": _mib(run.device_used_bytes),
        "pending_free_mib": _mib(run.pending_free_bytes),
        "ring_slots": dict(run.ring_slots),
        "ring_slot_mib": {k: v / MIB for k, v in run.ring_slot_bytes.items()},
        "ring_mib": _mib(run.ring_bytes),
        "nodes": run.nodes.count if run.nodes is not None else None,
        "node_set": run.nodes.describe() if run.nodes is not None else None,
        "node_source": run.nodes_source,
        "software": dict(run.software),
        "config": dict(run.config),
        "job_id": run.job_id,
        "dropped": dict(run.dropped),
        "oom_events": run.oom_events,
        "warnings": list(run.warnings),
    }


def metric_values(stats: dict[str, Any]) -> dict[str, float | None]:
    """``{metric: value}`` of a :func:`run_stats` dict for every metric a comparison judges."""
    t, s = stats["tflops"], stats["step_ms"]
    return {
        "tflops_mean": t["mean"],
        "tflops_median": t["median"],
        "tflops": stats["tflops_value"] if t["n"] == 0 else None,
        "step_ms_mean": s["mean"],
        "step_ms_median": s["median"],
        "max_allocated_mib": stats["max_allocated_mib"],
        "max_reserved_mib": stats["max_reserved_mib"],
        "max_active_mib": stats["max_active_mib"],
        "device_used_mib": stats["device_used_mib"],
        "pending_free_mib": stats["pending_free_mib"],
    }


def _mib(v: int | None) -> float | None:
    return v / MIB if v is not None else None
