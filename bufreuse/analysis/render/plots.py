"""Every matplotlib figure: the snapshot timeline, the comparison plots, the sweep plots.

Functions take data and return a ``Figure`` (a bare Figure renders with Agg; pyplot is never
touched); they never read files or print: callers write them with :func:`.export.png_bytes`.
matplotlib is imported inside the functions, so commands without ``--plot`` never import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bufreuse.analysis.render.safe import mpl_text
from bufreuse.analysis.runs.compare import ComparisonResult
from bufreuse.analysis.runs.record import MIB
from bufreuse.analysis.runs.sweep_rows import SweepRow
from bufreuse.analysis.snapshot.report import Timeline

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "COMPARISON_PLOT_FILES",
    "SWEEP_PLOT_FILES",
    "comparison_figures",
    "iteration_figure",
    "layer_bench_figure",
    "memory_figure",
    "plot_reserved",
    "plot_step_time",
    "sweep_figures",
    "throughput_figure",
    "timeline_figure",
]

_GiB = float(1 << 30)


def _gib(values: Any) -> Any:
    """Bytes as GiB floats (exact-int arrays, dtype object, included: matplotlib wants floats)."""
    import numpy as np

    return np.asarray(values, dtype=np.float64) / _GiB


# -- snapshot timeline ----------------------------------------------------------------------------


def timeline_figure(timeline: Timeline, *, title: str = "") -> Figure:
    """Reserved and active memory over time, with the pending-free queue as a shaded band."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    x = timeline.x
    ax.plot(x, _gib(timeline.reserved), color="tab:gray", lw=1.2, drawstyle="steps-post", label="reserved")
    ax.plot(
        x,
        _gib(timeline.active),
        color="tab:blue",
        lw=1.0,
        drawstyle="steps-post",
        label="active (allocated + pending free)",
    )
    if timeline.pending_by_site:  # the pending-free band, stacked by allocation site
        low = _gib(timeline.allocated)
        for k, (site, b) in enumerate(timeline.pending_by_site.items()):
            high = low + _gib(b)
            ax.fill_between(
                x, low, high, color=f"C{(k + 1) % 10}", alpha=0.5, lw=0, step="post", label=f"pending free: {site}"
            )
            low = high
    else:
        ax.fill_between(
            x,
            timeline.allocated / _GiB,
            _gib(timeline.active),
            color="tab:orange",
            alpha=0.45,
            lw=0,
            step="post",
            label="pending free",
        )
    ax.axvline(timeline.max_active_x, color="tab:red", ls="--", lw=0.8)
    ax.scatter(
        [timeline.max_active_x],
        [timeline.max_active_bytes / _GiB],
        color="tab:red",
        zorder=5,
        s=18,
        label=f"max active {timeline.max_active_bytes / _GiB:.2f} GiB",
    )
    ax.set_xlabel(mpl_text(timeline.x_label))
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    if title:
        ax.set_title(mpl_text(title), fontsize=9)
    return fig


# -- comparison -----------------------------------------------------------------------------------

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
        bars = ax.bar(x + (i - (len(labels) - 1) / 2) * width, values, width, label=mpl_text(label))
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v else "" for v in values], fontsize=7, rotation=90, padding=2)
    ax.set_xticks(x, [t for _, t in metrics])
    ax.set_ylabel("MiB")
    ax.set_title(f"Memory (baseline {mpl_text(result.baseline)})")
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
            labels.append(mpl_text(run.label))
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
            ax.plot(range(1, len(values) + 1), values, marker=".", label=mpl_text(run.label))
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


COMPARISON_PLOT_FILES = ("compare-memory.png", "compare-throughput.png", "compare-iterations.png")
"""File names the comparison plots are written under, in :func:`comparison_figures` order."""


def comparison_figures(result: ComparisonResult) -> dict[str, Figure]:
    """Memory, throughput and per-iteration figures, keyed by their file name."""
    makers = (memory_figure, throughput_figure, iteration_figure)
    return {name: make(result) for name, make in zip(COMPARISON_PLOT_FILES, makers, strict=True)}


# -- sweep ----------------------------------------------------------------------------------------

SWEEP_PLOT_FILES = ("reserved_vs_slots.png", "step_time_vs_slots.png")
"""File names the sweep's plots are written under, in :func:`sweep_figures` order."""


def _series(rows: list[SweepRow], attr: str) -> dict[str, Any]:
    ok = [r for r in rows if r.status == "ok" and getattr(r, attr) is not None]
    out: dict[str, Any] = {}
    for graph in sorted({r.cuda_graph for r in ok}):
        sel = [r for r in ok if r.cuda_graph == graph]
        tag = " (graph)" if graph else ""
        pts = sorted((r.slots, getattr(r, attr)) for r in sel if r.mode in ("control", "ring"))
        if pts:
            out[f"control / ring{tag}"] = pts
        for r in sel:
            if r.mode == "stream-ordered":
                out[f"stream-ordered{tag}"] = getattr(r, attr)
    return out


def _plot(rows: list[SweepRow], attr: str, ylabel: str, scale: float, title: str) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    for label, data in _series(rows, attr).items():
        if isinstance(data, list):
            xs, ys = zip(*data, strict=True)
            ax.plot(xs, [y / scale for y in ys], marker="o", label=mpl_text(label))
        else:
            ax.axhline(data / scale, linestyle="--", color="tab:red" if "graph" not in label else "tab:purple",
                       label=mpl_text(label))  # fmt: skip
    ax.set_xlabel("slots per buffer (0 = control: record_stream)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.has_data():
        ax.legend()
    return fig


def plot_reserved(rows: list[SweepRow]) -> Figure:
    """Max reserved (MiB) against slots; stream-ordered as a dashed line."""
    return _plot(rows, "max_reserved_bytes", "max reserved (MiB)", MIB, "Max reserved memory vs ring slots")


def plot_step_time(rows: list[SweepRow]) -> Figure:
    """Median step time (ms) against slots; stream-ordered as a dashed line."""
    return _plot(rows, "step_ms", "median step time (ms)", 1.0, "Step time vs ring slots")


def sweep_figures(rows: list[SweepRow]) -> dict[str, Figure]:
    """Both plots, keyed by the file name they are written under (:data:`SWEEP_PLOT_FILES`)."""
    return dict(zip(SWEEP_PLOT_FILES, (plot_reserved(rows), plot_step_time(rows)), strict=True))


# -- bench layer ----------------------------------------------------------------------------------


def layer_bench_figure(result: dict[str, Any]) -> Figure:
    """``bench layer``'s per-round ratios: one point per measured round per arm (over its neighbouring control
    round), one panel per figure, a line at 1.0 (control rounds marked on it) and the parity band shaded."""
    keys = [k for k in ("host_us", "wall_ms", "gpu_ms") if k in result["metrics"]]
    fig = _figure(8.0, 2.6 * len(keys) + 0.6)
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    band = result["band_pct"] / 100
    arms = result["arms"][1:]
    for ax, key in zip(axes, keys, strict=True):
        ax.axhspan(1 - band, 1 + band, color="tab:gray", alpha=0.15, lw=0, label=f"±{result['band_pct']:g}% band")
        ax.axhline(1.0, color="black", lw=1)
        controls = [r["index"] for r in result["rounds"] if r["arm"] == "control" and not r["warmup"]]
        ax.plot(controls, [1.0] * len(controls), "|", color="black", ms=12, label="control rounds")
        for arm in arms:
            pts = [(r["index"], r["ratio"][key]) for r in result["rounds"] if r["arm"] == arm and r["ratio"]]
            xs, ys = zip(*pts, strict=True)
            judged = result["summary"][arm][key]["vs_control"]
            ax.plot(xs, ys, "o", label=mpl_text(f"{arm}: {judged['ratio']:.3f} ({judged['verdict']})"))
        ax.set_ylabel(f"{mpl_text(result['metrics'][key]['title'])}\narm / control")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("round (position in the run; warm-up rounds not shown)")
    from matplotlib.ticker import MaxNLocator

    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    c = result["config"]
    fig.suptitle(
        mpl_text(
            f"bench layer: hidden {c['hidden']}, {c['experts']} experts top-{c['topk']}, {c['tokens']} tokens, "
            f"{c['spec']} {c['precision']}, {c['schedule']}; {result['env']['gpu'] or 'CPU'}"
        ),
        fontsize=9,
    )
    return fig
