"""Compare runs against a baseline: deltas, noise bands, verdicts and what explains them.

The first run is the baseline. For each other run and each metric the comparison gives the
absolute and relative delta and a verdict (``improvement``, ``parity``, ``regression``) against
a stated noise band: throughput and step time use a relative band (default 1%), memory the
larger of an absolute and a relative band (default 64 MiB or 0.1%). Where both runs have
per-iteration samples, a percentile bootstrap gives the 95% confidence interval of the median
difference (2,000 resamples: a few milliseconds). Two honesty rules from the seed validation:

- runs on different node sets: a throughput "improvement" is reported as parity (not a speedup
  claim), and the caveat is stated; regressions stay regressions;
- an allocated-memory delta is explained by ring storage (slots × slot bytes per ring) when the
  ring sizes are known; the verdict stays, the explanation says whether it accounts for it. A
  growth no larger than the ring storage plus the memory band is marked ``explained_by`` and does
  not fail the ``--fail-on-regression`` gate (:attr:`ComparisonResult.failing`): a feature run
  always adds its slots, so gating on them would fail every feature run.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from bufreuse.analysis.runs import MIB, RunRecord, resolve_runs
from bufreuse.errors import InputError

__all__ = [
    "VERDICTS",
    "Bands",
    "ComparisonResult",
    "MetricDelta",
    "RunComparison",
    "bootstrap_median_diff",
    "compare_runs",
    "compare_specs",
    "summarise",
]

VERDICTS = ("improvement", "parity", "regression", "n/a")
_THROUGHPUT_METRICS = ("tflops_mean", "tflops_median", "tflops", "step_ms_mean", "step_ms_median")


@dataclass(kw_only=True, slots=True)
class Bands:
    """Noise bands inside which a delta is parity."""

    throughput_pct: float = 1.0
    """Relative band for throughput and step time, percent of the baseline."""
    memory_mib: float = 64.0
    """Absolute band for memory, MiB; the larger of this and ``memory_pct`` applies."""
    memory_pct: float = 0.1
    """Relative band for memory, percent of the baseline."""

    def __post_init__(self) -> None:
        for name in ("throughput_pct", "memory_mib", "memory_pct"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise InputError(f"bands.{name} must be a finite number >= 0, got {value!r}")


@dataclass(kw_only=True, slots=True)
class MetricDelta:
    """One metric of one run against the baseline, in display units (TFLOP/s/GPU, ms, MiB)."""

    metric: str
    title: str
    unit: str
    better: str
    baseline: float | None
    value: float | None
    delta: float | None = None
    delta_pct: float | None = None
    band: float | None = None
    verdict: str = "n/a"
    ci_low: float | None = None
    ci_high: float | None = None
    note: str | None = None
    explained_by: str | None = None
    """Set on an allocated-memory regression that the ring storage covers (``ring storage: 4 × 539
    MiB``): the verdict stays ``regression``, but it does not fail the gate."""

    @property
    def fails_gate(self) -> bool:
        """A regression that ``--fail-on-regression`` fails on (not one explained by ring storage)."""
        return self.verdict == "regression" and self.explained_by is None


@dataclass(kw_only=True, slots=True)
class RunComparison:
    """Every metric of one run against the baseline, with caveats and the ring explanation."""

    label: str
    source: str
    kind: str
    status: str
    metrics: list[MetricDelta] = field(default_factory=list)
    node_sets: str = "unknown"
    """``same``, ``differ`` or ``unknown``."""
    caveats: list[str] = field(default_factory=list)
    ring_bytes: int | None = None
    explanation: str | None = None
    explained: bool | None = None
    """True when ring storage accounts for the allocated delta within the memory band."""

    def metric(self, name: str) -> MetricDelta:
        return next(m for m in self.metrics if m.metric == name)


@dataclass(kw_only=True, slots=True)
class ComparisonResult:
    """The baseline's statistics, one :class:`RunComparison` per other run, and the bands used."""

    baseline: str
    bands: Bands
    warmup: int
    runs: list[RunRecord]
    stats: dict[str, dict[str, Any]]
    comparisons: list[RunComparison]

    @property
    def regressions(self) -> list[tuple[str, str]]:
        """(run label, metric) for every metric that regressed beyond its band."""
        return [(c.label, m.metric) for c in self.comparisons for m in c.metrics if m.verdict == "regression"]

    @property
    def failing(self) -> list[tuple[str, str]]:
        """The :attr:`regressions` that fail the gate: all but those explained by ring storage."""
        return [(c.label, m.metric) for c in self.comparisons for m in c.metrics if m.fails_gate]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: NaN never appears (None instead)."""
        return _clean(
            {
                "baseline": self.baseline,
                "bands": asdict(self.bands),
                "warmup": self.warmup,
                "runs": {r.label: {"source": str(r.source), "kind": r.kind, **self.stats[r.label]} for r in self.runs},
                "comparisons": [asdict(c) for c in self.comparisons],
                "regressions": [{"run": r, "metric": m} for r, m in self.regressions],
                "failing": [{"run": r, "metric": m} for r, m in self.failing],
            }
        )

    def to_rows(self) -> list[dict[str, Any]]:
        """One flat row per (run, metric), for CSV."""
        rows = []
        for c in self.comparisons:
            for m in c.metrics:
                row = {"run": c.label, "baseline_run": self.baseline, **asdict(m), "node_sets": c.node_sets}
                rows.append(_clean(row))
        return rows


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


def compare_runs(
    runs: list[RunRecord],
    *,
    bands: Bands | None = None,
    slot_bytes: dict[str, int] | None = None,
    warmup: int = 3,
    seed: int = 0,
) -> ComparisonResult:
    """Compare ``runs[1:]`` against ``runs[0]``; ``slot_bytes`` ({buffer: bytes}, ``"*"`` = every
    buffer) overrides slot sizes for the ring-storage explanation."""
    if len(runs) < 2:
        raise InputError(f"compare needs a baseline and at least one other run, got {len(runs)}")
    bands = bands or Bands()
    for run in runs:
        _apply_slot_bytes(run, slot_bytes or {})
    base = runs[0]
    if base.status != "ok":
        raise InputError(f"baseline {base.label} did not finish ok (status {base.status})")
    stats = {r.label: _run_stats(r) for r in runs}
    comparisons = [_compare_one(base, run, stats, bands, seed) for run in runs[1:]]
    return ComparisonResult(
        baseline=base.label, bands=bands, warmup=warmup, runs=runs, stats=stats, comparisons=comparisons
    )


def compare_specs(
    specs: list[str],
    *,
    root: str | os.PathLike[str] | None = None,
    warmup: int = 3,
    bands: Bands | None = None,
    slot_bytes: dict[str, int] | None = None,
) -> ComparisonResult:
    """Resolve ``specs`` (labels, folders, logs, snapshots) and compare them, the first as baseline."""
    runs = resolve_runs(specs, root=root, warmup=warmup)
    return compare_runs(runs, bands=bands, slot_bytes=slot_bytes, warmup=warmup)


def _apply_slot_bytes(run: RunRecord, slot_bytes: dict[str, int]) -> None:
    if not slot_bytes:
        return
    for name in run.ring_slots:
        size = slot_bytes.get(name, slot_bytes.get("*"))
        if size is not None:
            run.ring_slot_bytes[name] = int(size)
            run.slot_bytes_source = "given slot size"


def _run_stats(run: RunRecord) -> dict[str, Any]:
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


def _metric_values(stats: dict[str, Any]) -> dict[str, float | None]:
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


_TITLES = {
    "tflops_mean": ("throughput mean", "TFLOP/s/GPU", "higher"),
    "tflops_median": ("throughput median", "TFLOP/s/GPU", "higher"),
    "tflops": ("throughput (reported)", "TFLOP/s/GPU", "higher"),
    "step_ms_mean": ("step time mean", "ms", "lower"),
    "step_ms_median": ("step time median", "ms", "lower"),
    "max_allocated_mib": ("peak allocated", "MiB", "lower"),
    "max_reserved_mib": ("peak reserved", "MiB", "lower"),
    "max_active_mib": ("peak active (allocated + pending-free)", "MiB", "lower"),
    "device_used_mib": ("device used", "MiB", "lower"),
    "pending_free_mib": ("pending-free at max active", "MiB", "lower"),
}


def _compare_one(
    base: RunRecord, run: RunRecord, stats: dict[str, dict[str, Any]], bands: Bands, seed: int
) -> RunComparison:
    comp = RunComparison(label=run.label, source=str(run.source), kind=run.kind, status=run.status)
    comp.caveats.extend(f"{run.label}: {w}" for w in run.warnings)
    comp.node_sets = _node_sets(base, run, comp)
    bv, rv = _metric_values(stats[base.label]), _metric_values(stats[run.label])
    for key, (title, unit, better) in _TITLES.items():
        if bv[key] is None and rv[key] is None:
            continue
        m = MetricDelta(metric=key, title=title, unit=unit, better=better, baseline=bv[key], value=rv[key])
        if run.status == "ok" and m.baseline is not None and m.value is not None:
            _judge(m, bands, differ=comp.node_sets == "differ")
            if key in ("tflops_median", "step_ms_median"):
                series = "tflops" if key == "tflops_median" else "step_ms"
                ci = bootstrap_median_diff(getattr(base, series), getattr(run, series), seed=seed)
                if ci is not None:
                    m.ci_low, m.ci_high = ci
                    if ci[0] <= 0 <= ci[1]:
                        m.note = _join(m.note, "95% CI of the median difference includes 0")
        comp.metrics.append(m)
    _explain_allocated(base, run, comp, bands)
    return comp


def _judge(m: MetricDelta, bands: Bands, *, differ: bool) -> None:
    if m.baseline is None or m.value is None:
        return
    m.delta = m.value - m.baseline
    m.delta_pct = m.delta / m.baseline * 100 if m.baseline else None
    if m.unit == "MiB":
        m.band = max(bands.memory_mib, abs(m.baseline) * bands.memory_pct / 100)
    else:
        m.band = abs(m.baseline) * bands.throughput_pct / 100
    gain = m.delta if m.better == "higher" else -m.delta
    if abs(m.delta) <= m.band:
        m.verdict = "parity"
    elif gain > 0:
        m.verdict = "improvement"
        if differ and m.metric in _THROUGHPUT_METRICS:
            m.verdict = "parity"
            m.note = "not claimed as a speedup: the runs used different node sets"
    else:
        m.verdict = "regression"


def _node_sets(base: RunRecord, run: RunRecord, comp: RunComparison) -> str:
    if not base.node_list or not run.node_list:
        if base.kind == "megatron" or run.kind == "megatron":
            comp.caveats.append("node sets unknown: treat small throughput deltas as parity/regression signals")
        return "unknown"
    a, b = set(base.node_list), set(run.node_list)
    if a == b:
        return "same"
    comp.caveats.append(
        f"node sets differ ({len(a & b)} of {len(a | b)} nodes shared): throughput deltas are "
        "parity/regression signals, not speedups"
    )
    return "differ"


def _explain_allocated(base: RunRecord, run: RunRecord, comp: RunComparison, bands: Bands) -> None:
    m = next((x for x in comp.metrics if x.metric == "max_allocated_mib"), None)
    comp.ring_bytes = run.ring_bytes
    if m is None or m.delta is None or not run.ring_slots:
        return
    if run.ring_bytes is None:
        unknown = ", ".join(k for k in run.ring_slots if k not in run.ring_slot_bytes)
        comp.explanation = f"ring slots known but slot size unknown for {unknown}: pass --slot-mib BUF=MIB"
        return
    base_ring = base.ring_bytes or 0
    rings = [
        (name, slots, run.ring_slot_bytes[name] / MIB)
        for name, slots in run.ring_slots.items()
        if slots and name in run.ring_slot_bytes
    ]
    parts = [f"{name} {slots} × {mib:g} MiB" for name, slots, mib in rings]
    ring_mib = (run.ring_bytes - base_ring) / MIB
    comp.explained = m.band is not None and abs(m.delta - ring_mib) <= m.band
    if comp.explained:
        verdict = f"the rings account for it ({ring_mib / m.delta:.0%})" if m.delta else "the rings account for it"
    else:
        rest = m.delta - ring_mib
        verdict = f"{rest:+.0f} MiB is not ring storage" + (
            " (likely transient buffers in the control's peak that the rings replace)" if rest < 0 else ""
        )
    comp.explanation = (
        f"ring storage {' + '.join(parts) or 'none'} = {ring_mib:+g} MiB"
        + (f" vs baseline rings {base_ring / MIB:g} MiB" if base_ring else "")
        + f"; allocated delta {m.delta:+.0f} MiB: {verdict}"
        + f"; slot size from {run.slot_bytes_source}"
    )
    # Gate: growth up to the rings' own storage (plus the band) is what the feature costs by design.
    if m.verdict == "regression" and m.band is not None and ring_mib > 0 and m.delta <= ring_mib + m.band:
        m.explained_by = "ring storage: " + " + ".join(f"{slots} × {mib:g} MiB" for _, slots, mib in rings)
        if base_ring:
            m.explained_by += f" (less the baseline's {base_ring / MIB:g} MiB)"
    if comp.explained and m.verdict == "regression":
        m.note = _join(m.note, "expected: explained by persistent ring storage")


def _mib(v: int | None) -> float | None:
    return v / MIB if v is not None else None


def _join(a: str | None, b: str) -> str:
    return f"{a}; {b}" if a else b


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj
