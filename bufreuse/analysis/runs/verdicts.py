"""How a verdict is decided: the interval of the difference against a noise band; node sets; rings.

A metric measured by samples (throughput, step time: one sample per log window or measured
step) is judged by the 95% interval of its difference (Welch for means, bootstrap for medians)
against the band (relative, in :class:`Bands`): ``parity`` only when the whole interval lies
inside the band, ``improvement`` / ``regression`` only when it lies wholly beyond it on one
side, ``inconclusive`` otherwise, and ``inconclusive`` with fewer than :data:`MIN_SAMPLES`
steady-state samples a side (said in the note). So the verdict and its interval never
contradict each other. A memory peak is one exact figure, not a sample: its delta is judged
against the memory band (the larger of an absolute and a relative band).

- runs on different node sets: a throughput improvement is not claimed (``inconclusive``, with
  the caveat); regressions stay regressions;
- an allocated-memory delta is explained by ring storage (slots × slot bytes per ring) when the
  ring sizes are known; the verdict stays, the explanation says whether it accounts for it. A
  growth no larger than the ring storage plus the memory band is marked ``explained_by`` and does
  not fail the ``--fail-on-regression`` gate: a feature run always adds its slots, so gating on
  them would fail every feature run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bufreuse.analysis.runs.record import MIB, RunRecord
from bufreuse.errors import InputError

__all__ = [
    "MIN_SAMPLES",
    "THROUGHPUT_METRICS",
    "VERDICTS",
    "Bands",
    "MetricDelta",
    "explain_allocated",
    "join_notes",
    "judge",
    "node_sets",
    "oom_bound",
    "oom_caveat",
]

VERDICTS = ("improvement", "parity", "regression", "inconclusive", "n/a")
MIN_SAMPLES = 5
"""Fewest steady-state samples a side for a verdict on a sampled metric."""
THROUGHPUT_METRICS = ("tflops_mean", "tflops_median", "tflops", "step_ms_mean", "step_ms_median")
"""Metrics that different node sets may not claim as an improvement."""


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
    """95% interval of the delta (sampled metrics with >= 3 samples a side)."""
    n_baseline: int | None = None
    n_value: int | None = None
    """Steady-state samples a side (None: an exact figure such as a memory peak)."""
    note: str | None = None
    explained_by: str | None = None
    """Set on an allocated-memory regression that the ring storage covers (``ring storage: 4 × 539
    MiB``): the verdict stays ``regression``, but it does not fail the gate."""

    @property
    def fails_gate(self) -> bool:
        """A regression that ``--fail-on-regression`` fails on (not one explained by ring storage)."""
        return self.verdict == "regression" and self.explained_by is None


def judge(m: MetricDelta, bands: Bands, *, differ: bool, unlike: str = "different node sets") -> None:
    """Set ``m``'s delta, band and verdict; ``differ``: the runs differ in what a speedup must not come from
    (``unlike`` names it: different node sets, different software), so a throughput improvement is not claimed.

    ``m.n_baseline`` / ``m.n_value`` (set) mark a sampled metric, judged by ``m.ci_low`` /
    ``m.ci_high``; otherwise the delta itself is the exact difference.
    """
    if m.baseline is None or m.value is None:
        return
    m.delta = m.value - m.baseline
    m.delta_pct = m.delta / m.baseline * 100 if m.baseline else None
    if m.unit == "MiB":
        m.band = max(bands.memory_mib, abs(m.baseline) * bands.memory_pct / 100)
    else:
        m.band = abs(m.baseline) * bands.throughput_pct / 100
    sign = 1.0 if m.better == "higher" else -1.0
    if m.n_baseline is None and m.n_value is None:
        low = high = m.delta
    elif min(m.n_baseline or 0, m.n_value or 0) < MIN_SAMPLES:
        m.verdict = "inconclusive"
        m.note = join_notes(
            m.note, f"n = {m.n_baseline} vs {m.n_value} steady-state samples (< {MIN_SAMPLES} a side): no verdict"
        )
        return
    elif m.ci_low is None or m.ci_high is None:
        m.verdict = "inconclusive"
        m.note = join_notes(m.note, "no interval of the difference: no verdict")
        return
    else:
        low, high = m.ci_low, m.ci_high
    gain_low, gain_high = sorted((sign * low, sign * high))
    if -m.band <= low and high <= m.band:
        m.verdict = "parity"
    elif gain_low > m.band:
        m.verdict = "improvement"
        if differ and m.metric in THROUGHPUT_METRICS:
            m.verdict = "inconclusive"
            m.note = join_notes(m.note, f"not claimed as a speedup: the runs used {unlike}")
    elif gain_high < -m.band:
        m.verdict = "regression"
    else:
        m.verdict = "inconclusive"
        m.note = join_notes(
            m.note, f"95% CI [{low:+.3g}, {high:+.3g}] {m.unit} is neither inside nor beyond the ±{m.band:.3g} band"
        )


PEAK_METRICS = ("max_allocated_mib", "max_reserved_mib", "max_active_mib", "device_used_mib")
"""Memory peaks: a run that died of out-of-memory reached at least its recorded peak (a lower bound)."""


def oom_bound(m: MetricDelta, base: RunRecord, run: RunRecord) -> None:
    """Turn a memory verdict that an out-of-memory run cannot support into ``inconclusive``, with the note.

    A run that died of OOM never reached its true peak: its recorded peak is a lower bound. With only the
    compared run dead, its true delta is at least the recorded one, so a regression stands and nothing else
    does; with only the baseline dead, the true delta is at most the recorded one, so an improvement stands
    and nothing else does; with both dead, no memory verdict stands. Pending-free at the max-active point of
    a dead run is no bound either way: never claimed.
    """
    dead = [r.label for r in (base, run) if r.oom_events]
    if not dead or m.unit != "MiB" or m.verdict in ("n/a", "inconclusive"):
        return
    stands = m.metric in PEAK_METRICS and (
        (m.verdict == "regression" and not base.oom_events) or (m.verdict == "improvement" and not run.oom_events)
    )
    who = " and ".join(dead)
    bound = "their peaks are" if len(dead) > 1 else "its peak is"
    if stands:
        m.note = join_notes(m.note, f"{who} ran out of memory: {bound} a lower bound, and the {m.verdict} holds "
                                    "against it")  # fmt: skip
        return
    if m.metric in PEAK_METRICS:
        why = f"{bound} only a lower bound (a dead run never reached its true peak)"
    else:
        why = f"a dead run's {m.title} bounds nothing either way"
    m.note = join_notes(m.note, f"was {m.verdict}; {who} ran out of memory: {why}: no verdict")
    m.verdict = "inconclusive"


def oom_caveat(base: RunRecord, run: RunRecord) -> str | None:
    """The caveat stated when either run recorded out-of-memory events, else None."""
    dead = [f"{r.label} ({r.oom_events} out-of-memory event{'s' if r.oom_events > 1 else ''})"
            for r in (base, run) if r.oom_events]  # fmt: skip
    if not dead:
        return None
    return (f"{' and '.join(dead)} recorded: a dead run's memory peak is only a lower bound; memory verdicts it "
            "cannot support are inconclusive")  # fmt: skip


def node_sets(base: RunRecord, run: RunRecord) -> tuple[str, str | None]:
    """``same``, ``differ`` or ``unknown``, and the caveat to state with it (None when there is none).

    Node sets compare as compressed host lists when either is too large to expand.
    """
    if base.nodes is None or run.nodes is None:
        caveat = None
        timed = all(len(r.step_ms) or len(r.tflops) or r.tflops_value is not None for r in (base, run))
        if (base.kind == "megatron" or run.kind == "megatron") and timed:  # memory-only logs: no throughput
            caveat = "node sets unknown: treat small throughput deltas as parity/regression signals"
        return "unknown", caveat
    if base.nodes.same_as(run.nodes):
        return "same", None
    shared = base.nodes.shared(run.nodes)
    how = (
        f"{shared[0]} of {shared[1]} nodes shared"
        if shared is not None
        else f"{base.nodes.describe()} vs {run.nodes.describe()}"
    )
    return "differ", f"node sets differ ({how}): throughput deltas are parity/regression signals, not speedups"


def explain_allocated(
    base: RunRecord, run: RunRecord, m: MetricDelta | None, bands: Bands
) -> tuple[str | None, bool | None]:
    """Explain the allocated delta ``m`` by the run's ring storage: ``(explanation, explained)``.

    ``explained`` is True when the rings account for the delta within the memory band, None when
    there is nothing to explain or a slot size is unknown. Marks ``m.explained_by`` (the gate
    excuse) and adds a note to ``m`` when the rings cover a regression.
    """
    if m is None or m.delta is None or not run.ring_slots:
        return None, None
    if run.ring_bytes is None:
        unknown = ", ".join(k for k in run.ring_slots if k not in run.ring_slot_bytes)
        return f"ring slots known but slot size unknown for {unknown}: pass --slot-mib BUF=MIB", None
    base_ring = base.ring_bytes or 0
    rings = [
        (name, slots, run.ring_slot_bytes[name] / MIB)
        for name, slots in run.ring_slots.items()
        if slots and name in run.ring_slot_bytes
    ]
    parts = [f"{name} {slots} × {mib:g} MiB" for name, slots, mib in rings]
    ring_mib = (run.ring_bytes - base_ring) / MIB
    explained = m.band is not None and abs(m.delta - ring_mib) <= m.band
    if explained:
        verdict = f"the rings account for it ({ring_mib / m.delta:.0%})" if m.delta else "the rings account for it"
    else:
        rest = m.delta - ring_mib
        verdict = (
            f"{-rest:.0f} MiB below the ring storage (likely transient buffers in the control's peak that the rings "
            "replace)"
            if rest < 0
            else f"{rest:.0f} MiB beyond the ring storage"
        )
    explanation = (
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
    if explained and m.verdict == "regression":
        m.note = join_notes(m.note, "expected: explained by persistent ring storage")
    return explanation, explained


def join_notes(a: str | None, b: str) -> str:
    """Two notes as one (``a; b``), or ``b`` alone."""
    return f"{a}; {b}" if a else b
