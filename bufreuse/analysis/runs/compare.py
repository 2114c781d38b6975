"""Compare runs against a baseline, as data: one :class:`RunComparison` per run, every metric judged.

The first run is the baseline. Sampled metrics (throughput, step time) get a 95% interval of their
difference (:mod:`.stats`: Welch for means, percentile bootstrap for medians; log windows weighted
by their iterations), every metric its delta and verdict (:mod:`.verdicts`), the allocated delta its
ring-storage explanation. Configuration and scope differences (:mod:`.comparability`) are
caveats; a Megatron log against a snapshot is refused unless forced. Tables and plots of the result
are :mod:`bufreuse.analysis.render`.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from bufreuse.analysis.runs.comparability import config_caveats, scope_conflict, software_caveats
from bufreuse.analysis.runs.record import RunRecord
from bufreuse.analysis.runs.resolve import resolve_runs
from bufreuse.analysis.runs.span import common_span, trim
from bufreuse.analysis.runs.stats import bootstrap_diff, mean_diff_interval, metric_values, run_stats
from bufreuse.analysis.runs.verdicts import (
    Bands,
    MetricDelta,
    explain_allocated,
    judge,
    node_sets,
    oom_bound,
    oom_caveat,
)
from bufreuse.errors import InputError

__all__ = ["ComparisonResult", "RunComparison", "compare_runs", "compare_specs"]


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
    comparability: list[str] = field(default_factory=list)
    """Configuration and scope differences against the baseline, stated above the verdicts."""
    span: dict[str, Any] | None = None
    """Set when the two logs cover different iteration spans (:class:`.span.Span`'s ``to_dict``): throughput and
    step time are then compared over the ``common`` span."""
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


def compare_runs(
    runs: list[RunRecord],
    *,
    bands: Bands | None = None,
    slot_bytes: dict[str, int] | None = None,
    warmup: int = 3,
    seed: int = 0,
    force: bool = False,
) -> ComparisonResult:
    """Compare ``runs[1:]`` against ``runs[0]``.

    Args:
        slot_bytes: {buffer: bytes} (``"*"`` = every buffer), slot sizes for the ring-storage explanation.
        warmup: iterations the Megatron logs skipped (reported only).
        force: compare a Megatron log with a snapshot anyway (the scope caveat is stated).

    Raises:
        InputError: fewer than two runs, a failed baseline, or a log against a snapshot without ``force``.
    """
    if len(runs) < 2:
        raise InputError(f"compare needs a baseline and at least one other run, got {len(runs)}")
    bands = bands or Bands()
    for run in runs:
        _apply_slot_bytes(run, slot_bytes or {})
    base = runs[0]
    if base.status != "ok":
        raise InputError(f"baseline {base.label} did not finish ok (status {base.status})")
    if not force:
        for run in runs[1:]:
            if {base.kind, run.kind} == {"megatron", "snapshot"}:
                raise InputError(
                    f"{scope_conflict(base, run)}: the figures do not measure the same thing; "
                    "pass --force to compare anyway"
                )
    stats = {r.label: run_stats(r) for r in runs}
    comparisons = [_compare_one(base, run, stats, bands, seed) for run in runs[1:]]
    for run, comp in zip(runs[1:], comparisons, strict=True):
        if run.named and not any(m.verdict != "n/a" for m in comp.metrics):
            raise InputError(f"{run.label} yields no comparison with {base.label}: {_why_none(base, run, comp)}")
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
    force: bool = False,
) -> ComparisonResult:
    """Resolve ``specs`` (labels, folders, logs, snapshots) and compare them, the first as baseline."""
    runs = resolve_runs(specs, root=root, warmup=warmup)
    return compare_runs(runs, bands=bands, slot_bytes=slot_bytes, warmup=warmup, force=force)


def _why_none(base: RunRecord, run: RunRecord, comp: RunComparison) -> str:
    """Why a run has no metric judged against the baseline: its status, or no figure in common."""
    if run.status != "ok":
        why = next((w for w in run.warnings if w.startswith("status ")), None)
        return why or f"status {run.status}"
    have = {m.metric for m in comp.metrics if m.value is not None}
    wanted = {m.metric for m in comp.metrics if m.baseline is not None}
    shown = ", ".join(sorted(have)) or "none"
    return f"no figure in common (baseline has {', '.join(sorted(wanted)) or 'none'}; this run has {shown})"


def _apply_slot_bytes(run: RunRecord, slot_bytes: dict[str, int]) -> None:
    if not slot_bytes:
        return
    for name in run.ring_slots:
        size = slot_bytes.get(name, slot_bytes.get("*"))
        if size is not None:
            run.ring_slot_bytes[name] = int(size)
            run.slot_bytes_source = "given slot size"


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


_SERIES = {
    "tflops_mean": ("tflops", "tflops_windows", "mean"),
    "tflops_median": ("tflops", "tflops_windows", "median"),
    "step_ms_mean": ("step_ms", "step_windows", "mean"),
    "step_ms_median": ("step_ms", "step_windows", "median"),
}
"""Sampled metrics: the run's series, its window weights, the statistic whose difference gets an interval."""


def _compare_one(
    base: RunRecord, run: RunRecord, stats: dict[str, dict[str, Any]], bands: Bands, seed: int
) -> RunComparison:
    comp = RunComparison(label=run.label, source=str(run.source), kind=run.kind, status=run.status)
    comp.comparability.extend(config_caveats(base, run))
    if scope := scope_conflict(base, run):
        comp.comparability.append(scope)
    if base.memory_only:  # the run's own warnings follow; the baseline's memory-only scope qualifies them all
        only = (w for w in base.warnings if w.startswith("memory reports only"))
        comp.caveats.extend(f"the baseline {base.label} has {w}" for w in only)
    comp.caveats.extend(f"{run.label}: {w}" for w in run.warnings)
    comp.node_sets, caveat = node_sets(base, run)
    if caveat:
        comp.caveats.append(caveat)
    software = software_caveats(base, run)
    comp.comparability.extend(software)
    unlike = [
        w
        for w, yes in (("different node sets", comp.node_sets == "differ"), ("different software", bool(software)))
        if yes
    ]
    if caveat := oom_caveat(base, run):
        comp.caveats.append(caveat)
    span = common_span(base, run) if run.status == "ok" else None
    if span is not None:  # like with like: the iterations both logs cover
        comp.span = span.to_dict()
        comp.comparability.append(span.caveat(base.label, run.label))
        if span.common is not None:
            base, run = trim(base, span.common), trim(run, span.common)
            stats = {base.label: run_stats(base), run.label: run_stats(run)}
    bv, rv = metric_values(stats[base.label]), metric_values(stats[run.label])
    for key, (title, unit, better) in _TITLES.items():
        if bv[key] is None and rv[key] is None:
            continue
        m = MetricDelta(metric=key, title=title, unit=unit, better=better, baseline=bv[key], value=rv[key])
        if run.status == "ok" and m.baseline is not None and m.value is not None:
            if key in _SERIES:
                series, windows, stat = _SERIES[key]
                a, b = getattr(base, series), getattr(run, series)
                m.n_baseline, m.n_value = len(a), len(b)
                wa, wb = getattr(base, windows), getattr(run, windows)
                if stat == "mean":
                    ci = mean_diff_interval(a, b, base_weights=wa, other_weights=wb)
                else:
                    ci = bootstrap_diff(a, b, stat=stat, base_weights=wa, other_weights=wb, seed=seed)
                if ci is not None:
                    m.ci_low, m.ci_high = ci
            elif key == "tflops":
                m.n_baseline, m.n_value = 1, 1  # one reported figure a side, no spread known
            judge(m, bands, differ=bool(unlike), unlike=" and ".join(unlike))
            oom_bound(m, base, run)
        comp.metrics.append(m)
    comp.ring_bytes = run.ring_bytes
    allocated = next((x for x in comp.metrics if x.metric == "max_allocated_mib"), None)
    comp.explanation, comp.explained = explain_allocated(base, run, allocated, bands)
    return comp


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj
