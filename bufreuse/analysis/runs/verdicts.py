"""How a verdict is decided: deltas against noise bands, node-set caveats, the ring-storage explanation.

For each metric of a run against the baseline the verdict is ``improvement``, ``parity`` or
``regression`` against a stated noise band: throughput and step time use a relative band, memory
the larger of an absolute and a relative band (defaults in :class:`Bands`). Two honesty rules:

- runs on different node sets: a throughput "improvement" is reported as parity (not a speedup
  claim), and the caveat is stated; regressions stay regressions;
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
    "THROUGHPUT_METRICS",
    "VERDICTS",
    "Bands",
    "MetricDelta",
    "explain_allocated",
    "join_notes",
    "judge",
    "node_sets",
]

VERDICTS = ("improvement", "parity", "regression", "n/a")
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
    note: str | None = None
    explained_by: str | None = None
    """Set on an allocated-memory regression that the ring storage covers (``ring storage: 4 × 539
    MiB``): the verdict stays ``regression``, but it does not fail the gate."""

    @property
    def fails_gate(self) -> bool:
        """A regression that ``--fail-on-regression`` fails on (not one explained by ring storage)."""
        return self.verdict == "regression" and self.explained_by is None


def judge(m: MetricDelta, bands: Bands, *, differ: bool) -> None:
    """Set ``m``'s delta, band and verdict; ``differ``: the runs used different node sets."""
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
        if differ and m.metric in THROUGHPUT_METRICS:
            m.verdict = "parity"
            m.note = "not claimed as a speedup: the runs used different node sets"
    else:
        m.verdict = "regression"


def node_sets(base: RunRecord, run: RunRecord) -> tuple[str, str | None]:
    """``same``, ``differ`` or ``unknown``, and the caveat to state with it (None when there is none)."""
    if not base.node_list or not run.node_list:
        caveat = None
        if base.kind == "megatron" or run.kind == "megatron":
            caveat = "node sets unknown: treat small throughput deltas as parity/regression signals"
        return "unknown", caveat
    a, b = set(base.node_list), set(run.node_list)
    if a == b:
        return "same", None
    return "differ", (
        f"node sets differ ({len(a & b)} of {len(a | b)} nodes shared): throughput deltas are "
        "parity/regression signals, not speedups"
    )


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
        verdict = f"{rest:+.0f} MiB is not ring storage" + (
            " (likely transient buffers in the control's peak that the rings replace)" if rest < 0 else ""
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
