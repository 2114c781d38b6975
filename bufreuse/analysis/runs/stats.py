"""Statistics of runs: sample summaries, the bootstrap CI of a median difference, per-run figures.

Data in, numbers out; :mod:`.verdicts` turns the numbers into verdicts against noise bands.
"""

from __future__ import annotations

from typing import Any

from bufreuse.analysis.runs.record import MIB, RunRecord

__all__ = ["bootstrap_median_diff", "metric_values", "run_stats", "summarise"]


def summarise(values: list[float]) -> dict[str, float | int | None]:
    """Mean, median, p10, p90, min, max and count of a sample (None entries when empty)."""
    import numpy as np

    if not values:
        return {"n": 0, "mean": None, "median": None, "p10": None, "p90": None, "min": None, "max": None}
    a = np.asarray(values, dtype=float)
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    return {
        "n": int(a.size),
        "mean": float(a.mean()),
        "median": float(p50),
        "p10": float(p10),
        "p90": float(p90),
        "min": float(a.min()),
        "max": float(a.max()),
    }


def bootstrap_median_diff(
    base: list[float], other: list[float], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float] | None:
    """Percentile-bootstrap CI of median(other) - median(base); None with fewer than 3 samples a side."""
    import numpy as np

    if len(base) < 3 or len(other) < 3:
        return None
    rng = np.random.default_rng(seed)
    a, b = np.asarray(base, dtype=float), np.asarray(other, dtype=float)
    ma = np.median(a[rng.integers(0, a.size, size=(n_boot, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, size=(n_boot, b.size))], axis=1)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(mb - ma, [tail, 100 - tail])
    return float(low), float(high)


def run_stats(run: RunRecord) -> dict[str, Any]:
    """One run's figures in display units (MiB, TFLOP/s/GPU, ms), as ``compare --json`` lists them."""
    return {
        "status": run.status,
        "tflops": summarise(run.tflops),
        "tflops_value": run.tflops_value,
        "step_ms": summarise(run.step_ms),
        "max_allocated_mib": _mib(run.max_allocated_bytes),
        "max_reserved_mib": _mib(run.max_reserved_bytes),
        "max_active_mib": _mib(run.max_active_bytes),
        "device_used_mib": _mib(run.device_used_bytes),
        "pending_free_mib": _mib(run.pending_free_bytes),
        "ring_slots": dict(run.ring_slots),
        "ring_slot_mib": {k: v / MIB for k, v in run.ring_slot_bytes.items()},
        "ring_mib": _mib(run.ring_bytes),
        "nodes": len(run.node_list) if run.node_list else None,
        "job_id": run.job_id,
        "dropped": dict(run.dropped),
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
