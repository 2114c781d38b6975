"""Plots of a comparison: memory bars, throughput bars, per-iteration lines (matplotlib, Agg).

Plot functions take a :class:`ComparisonResult` and return a ``Figure``; only
:func:`write_comparison_plots` touches files (PNG, atomically). About 0.1 s per figure.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING

from bufreuse.analysis.compare import ComparisonResult
from bufreuse.fsutil import atomic_write_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["iteration_figure", "memory_figure", "throughput_figure", "write_comparison_plots"]

_MEMORY = (
    ("max_allocated_mib", "peak allocated"),
    ("max_reserved_mib", "peak reserved"),
    ("device_used_mib", "device used"),
    ("pending_free_mib", "pending-free"),
)


def _figure(width: float = 8.0, height: float = 4.5) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def memory_figure(result: ComparisonResult) -> Figure:
    """Grouped bars: one group per memory metric, one bar per run (MiB)."""
    import numpy as np

    fig = _figure()
    ax = fig.add_subplot()
    labels = [r.label for r in result.runs if r.status == "ok"]
    metrics = [(k, t) for k, t in _MEMORY if any(result.stats[lb][k] is not None for lb in labels)]
    if not metrics:
        ax.text(0.5, 0.5, "no memory figures in these runs", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    x = np.arange(len(metrics))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = [result.stats[label][k] or 0.0 for k, _ in metrics]
        bars = ax.bar(x + (i - (len(labels) - 1) / 2) * width, values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v else "" for v in values], fontsize=7, rotation=90, padding=2)
    ax.set_xticks(x, [t for _, t in metrics])
    ax.set_ylabel("MiB")
    ax.set_title(f"Memory (baseline {result.baseline})")
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    return fig


def throughput_figure(result: ComparisonResult) -> Figure:
    """Bars of median throughput (or median step time without throughput), p10–p90 as error bars."""
    fig = _figure(6.5, 4.5)
    ax = fig.add_subplot()
    use_tflops = any(result.stats[r.label]["tflops"]["n"] for r in result.runs)
    series, unit = ("tflops", "TFLOP/s/GPU") if use_tflops else ("step_ms", "ms per step")
    labels, medians, lows, highs = [], [], [], []
    for run in result.runs:
        if run.status != "ok":
            continue
        s = result.stats[run.label][series]
        if s["n"]:
            labels.append(run.label)
            medians.append(s["median"])
            lows.append(s["median"] - s["p10"])
            highs.append(s["p90"] - s["median"])
    if not labels:
        ax.text(0.5, 0.5, "no per-iteration data in these runs", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    bars = ax.bar(labels, medians, yerr=[lows, highs], capsize=4, color="tab:blue")
    fmt = "{:,.1f}" if use_tflops else "{:,.2f}"
    ax.bar_label(bars, labels=[fmt.format(v) for v in medians], fontsize=8, padding=3)
    ax.set_ylabel(f"median {unit} (p10–p90)")
    ax.set_title(("Throughput" if use_tflops else "Step time") + " (y axis does not start at 0)")
    low = min(m - lo for m, lo in zip(medians, lows, strict=True))
    high = max(m + hi for m, hi in zip(medians, highs, strict=True))
    pad = max((high - low) * 0.5, abs(high) * 0.01, 1e-9)
    ax.set_ylim(max(0.0, low - pad), high + pad)
    return fig


def iteration_figure(result: ComparisonResult) -> Figure:
    """Per-iteration throughput (or step time) of every run, steady-state samples in order."""
    fig = _figure()
    ax = fig.add_subplot()
    use_tflops = any(r.tflops for r in result.runs)
    drawn = 0
    for run in result.runs:
        values = run.tflops if use_tflops else run.step_ms
        if values:
            ax.plot(range(1, len(values) + 1), values, marker=".", label=run.label)
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no per-iteration data in these runs", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("steady-state sample")
    ax.set_ylabel("TFLOP/s/GPU" if use_tflops else "ms per step")
    ax.set_title("Per-iteration throughput" if use_tflops else "Per-step time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def write_comparison_plots(result: ComparisonResult, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``compare-memory.png``, ``compare-throughput.png``, ``compare-iterations.png``."""
    out = Path(out_dir)
    written = []
    for name, make in (("memory", memory_figure), ("throughput", throughput_figure), ("iterations", iteration_figure)):
        fig = make(result)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        written.append(atomic_write_bytes(out / f"compare-{name}.png", buf.getvalue()))
    return written
