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
    """Reserved and active memory over time, with the pending-free queue as a shaded band.

    Reserved is drawn dashed on top of active (in a ring run they coincide and a solid line would
    hide one); the legend sits outside the axes, below, so it covers neither data nor the max-active mark.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    x = timeline.x
    ax.plot(
        x,
        _gib(timeline.active),
        color="tab:blue",
        lw=1.6,
        drawstyle="steps-post",
        label="active (allocated + pending free)",
        zorder=3,
    )
    ax.plot(
        x, _gib(timeline.reserved), color="black", lw=1.0, ls="--", drawstyle="steps-post", label="reserved", zorder=4
    )
    if timeline.pending_by_site:  # the pending-free band, stacked by allocation site
        low = _gib(timeline.allocated)
        for k, (site, b) in enumerate(timeline.pending_by_site.items()):
            high = low + _gib(b)
            ax.fill_between(
                x,
                low,
                high,
                color=f"C{(k + 1) % 10}",
                alpha=0.5,
                lw=0,
                step="post",
                label=f"pending free: {mpl_text(site)}",
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
    ax.axvline(timeline.max_active_x, color="tab:red", ls=":", lw=0.8)
    ax.scatter(
        [timeline.max_active_x],
        [timeline.max_active_bytes / _GiB],
        color="tab:red",
        zorder=6,
        s=24,
        label=f"max active {timeline.max_active_bytes / _GiB:.2f} GiB",
    )
    span = (float(x.min()), float(x.max())) if len(x) else (0.0, 1.0)
    left_half = timeline.max_active_x <= (span[0] + span[1]) / 2  # the label goes where there is room
    ax.annotate(
        f"max active {timeline.max_active_bytes / _GiB:.2f} GiB",
        (timeline.max_active_x, timeline.max_active_bytes / _GiB),
        textcoords="offset points",
        xytext=(8, 10) if left_half else (-8, 10),
        ha="left" if left_half else "right",
        fontsize=8,
        color="tab:red",
        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85},
        zorder=7,
    )
    ax.set_xlabel(mpl_text(timeline.x_label))
    ax.set_ylabel("GiB")
    ax.set_ylim(
        bottom=0, top=max(float(_gib(timeline.reserved).max(initial=0)), timeline.max_active_bytes / _GiB) * 1.12
    )
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2, fontsize=8, frameon=False)
    ax.set_title(mpl_text(title) if title else "Allocator memory over the recorded trace", fontsize=9)
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


def memory_figure(result: ComparisonResult, *, run: str = "") -> Figure:
    """Grouped bars: one group per memory metric, one bar per run (MiB), each labelled; 0 drawn, n/a said."""
    import numpy as np

    fig = _figure(9.0, 4.8)
    ax = fig.add_subplot()
    labels = [r.label for r in result.runs if r.status == "ok"]
    metrics = [(k, t) for k, t in _MEMORY if any(result.stats[lb][k] is not None for lb in labels)]
    if not metrics:
        ax.text(0.5, 0.5, "no memory figures in these runs", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    x = np.arange(len(metrics))
    width = 0.8 / len(labels)
    top = max((result.stats[lb][k] or 0.0) for lb in labels for k, _ in metrics) or 1.0
    for i, label in enumerate(labels):
        raw = [result.stats[label][k] for k, _ in metrics]
        values = [v or 0.0 for v in raw]
        xs = x + (i - (len(labels) - 1) / 2) * width
        bars = ax.bar(xs, values, width, label=mpl_text(label), color=f"C{i % 10}")
        zero = [xx for xx, v in zip(xs, raw, strict=True) if v == 0]
        if zero:  # a 0 bar has no height: a mark at the axis so it reads as measured, not missing
            ax.scatter(zero, [top * 0.004] * len(zero), marker="_", s=width * 900, color=f"C{i % 10}", zorder=3)
        texts = ["n/a" if v is None else f"{v:,.0f}" for v in raw]
        ax.bar_label(bars, labels=texts, fontsize=7, rotation=90, padding=2)
    ax.set_xticks(x, [t for _, t in metrics])
    ax.set_ylabel("MiB")
    ax.set_title(f"Peak memory per run (baseline {mpl_text(result.baseline)})" + (f"\n{mpl_text(run)}" if run else ""),
                 fontsize=10)  # fmt: skip
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.margins(y=0.18)
    if any(k == "device_used_mib" for k, _ in metrics):
        ax.set_xlabel("device used: total - free GPU memory as the driver reports it (CUDA context and other "
                      "processes included)", fontsize=7, color="dimgray")  # fmt: skip
    return fig


def throughput_figure(result: ComparisonResult, *, run: str = "") -> Figure:
    """Median throughput (or step time without throughput) per run with its p10–p90 spread, labelled.

    Points with error bars, not bars: the y axis is zoomed to the spread (a bar would imply a 0 base),
    and the title says so whenever it does not start at 0.
    """
    fig = _figure(7.0, 4.6)
    ax = fig.add_subplot()
    use_tflops = any(result.stats[r.label]["tflops"]["n"] for r in result.runs)
    series, unit = ("tflops", "TFLOP/s/GPU") if use_tflops else ("step_ms", "ms per step")
    labels, medians, lows, highs = [], [], [], []
    for r in result.runs:
        if r.status != "ok":
            continue
        s = result.stats[r.label][series]
        if s["n"]:
            labels.append(mpl_text(r.label))
            medians.append(s["median"])
            lows.append(s["median"] - s["p10"])
            highs.append(s["p90"] - s["median"])
    if not labels:
        ax.text(0.5, 0.5, "no per-iteration data in these runs", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    xs = list(range(len(labels)))
    ax.errorbar(xs, medians, yerr=[lows, highs], fmt="o", capsize=5, color="tab:blue", label="median, p10–p90")
    fmt = "{:,.1f}" if use_tflops else "{:,.2f}"
    for xx, m in zip(xs, medians, strict=True):
        ax.annotate(fmt.format(m), (xx, m), textcoords="offset points", xytext=(8, 0), va="center", fontsize=8)
    ax.set_xticks(xs, labels)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_ylabel(f"{unit}: median (p10–p90)")
    low = min(m - lo for m, lo in zip(medians, lows, strict=True))
    high = max(m + hi for m, hi in zip(medians, highs, strict=True))
    pad = max((high - low) * 0.5, abs(high) * 0.01, 1e-9)
    bottom = max(0.0, low - pad)
    ax.set_ylim(bottom, high + pad)
    ax.grid(True, axis="y", alpha=0.3)
    what = "Throughput" if use_tflops else "Step time"
    note = " — y axis does not start at 0" if bottom > 0 else ""
    ax.set_title(f"{what}{note}" + (f"\n{mpl_text(run)}" if run else ""), fontsize=10)
    return fig


def iteration_figure(result: ComparisonResult, *, run: str = "") -> Figure:
    """Per-iteration throughput (or step time) of every run, steady-state samples in order."""
    fig = _figure()
    ax = fig.add_subplot()
    use_tflops = any(len(r.tflops) for r in result.runs)  # series may be arrays: no truth value
    drawn = 0
    for r in result.runs:
        values = r.tflops if use_tflops else r.step_ms
        if len(values):
            ax.plot(range(1, len(values) + 1), values, marker=".", label=mpl_text(r.label))
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no per-iteration data in these runs", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("steady-state sample")
    ax.set_ylabel("TFLOP/s/GPU" if use_tflops else "ms per step")
    what = "Per-iteration throughput" if use_tflops else "Per-step time"
    ax.set_title(f"{what} (steady state; y axis zoomed)" + (f"\n{mpl_text(run)}" if run else ""), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    return fig


COMPARISON_PLOT_FILES = ("compare-memory.png", "compare-throughput.png", "compare-iterations.png")
"""File names the comparison plots are written under, in :func:`comparison_figures` order."""


def comparison_figures(result: ComparisonResult, *, run: str = "") -> dict[str, Figure]:
    """Memory, throughput and per-iteration figures, keyed by their file name (``run`` names the runs in titles)."""
    makers = (memory_figure, throughput_figure, iteration_figure)
    return {name: make(result, run=run) for name, make in zip(COMPARISON_PLOT_FILES, makers, strict=True)}


# -- sweep ----------------------------------------------------------------------------------------

SWEEP_PLOT_FILES = ("reserved_vs_slots.png", "step_time_vs_slots.png")
"""File names the sweep's plots are written under, in :func:`sweep_figures` order."""


def _plot(rows: list[SweepRow], attr: str, ylabel: str, scale: float, title: str, *, run: str = "") -> Figure:
    """One sweep figure: the control as its own marker at 0, ring runs as markers only (slot counts between
    them were not measured), stream-ordered as a dashed level; every point labelled with its value."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 4.6), layout="constrained")
    ax = fig.add_subplot()
    spread = attr == "step_ms"
    ok = [r for r in rows if r.status == "ok" and getattr(r, attr) is not None]
    fmt = "{:,.0f}" if scale != 1.0 else "{:,.2f}"
    measured: set[int] = set()
    for graph in sorted({r.cuda_graph for r in ok}):
        tag = " (graph)" if graph else ""
        sel = [r for r in ok if r.cuda_graph == graph]
        for mode, marker, color, label in (
            ("control", "s", "tab:gray" if not graph else "dimgray", f"control: record_stream{tag}"),
            ("ring", "o", "tab:blue" if not graph else "tab:purple", f"ring{tag}"),
        ):
            pts = sorted((r.slots, getattr(r, attr) / scale, r) for r in sel if r.mode == mode)
            if not pts:
                continue
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            measured.update(xs)
            err = None
            if spread and all(p[2].step_p10_ms is not None and p[2].step_p90_ms is not None for p in pts):
                err = [[y - p[2].step_p10_ms for y, p in zip(ys, pts, strict=True)],
                       [p[2].step_p90_ms - y for y, p in zip(ys, pts, strict=True)]]  # fmt: skip
            ax.errorbar(xs, ys, yerr=err, fmt=marker, ms=7, capsize=4, color=color, label=mpl_text(label), zorder=3)
            for xx, yy in zip(xs, ys, strict=True):
                ax.annotate(fmt.format(yy), (xx, yy), textcoords="offset points", xytext=(7, 4), fontsize=8)
        for r in sel:
            if r.mode == "stream-ordered":
                y = getattr(r, attr) / scale
                color = "tab:red" if not graph else "tab:pink"
                band = spread and r.step_p10_ms is not None and r.step_p90_ms is not None
                text = f"stream-ordered{tag} {fmt.format(y)}" + (" (band: p10–p90)" if band else "")
                ax.axhline(y, linestyle="--", color=color, lw=1.0, label=mpl_text(text))
                if band:
                    ax.axhspan(r.step_p10_ms, r.step_p90_ms, color=color, alpha=0.12, lw=0)
    ax.set_xlabel("slots per buffer (0 = the control: record_stream, no ring)")
    ax.set_ylabel(ylabel)
    if measured:
        ax.set_xticks(sorted(measured))
        ax.set_xlim(min(measured) - 0.7, max(measured) + 1.5)
    note = ""
    if ax.has_data():
        lo, hi = ax.get_ylim()
        if spread:  # zoomed to the spread, and said so
            pad = (hi - lo) * 0.1
            ax.set_ylim(max(0.0, lo - pad), hi + pad)
            note = " — y axis does not start at 0" if ax.get_ylim()[0] > 0 else ""
        else:
            ax.set_ylim(bottom=0, top=hi * 1.08)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=3, frameon=False)
    ax.set_title(f"{title}{note}" + (f"\n{mpl_text(run)}" if run else ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    return fig


def plot_reserved(rows: list[SweepRow], *, run: str = "") -> Figure:
    """Peak reserved of the whole process (MiB) against slots; stream-ordered as a dashed line."""
    title = "Peak reserved memory (whole process) vs ring slots"
    return _plot(rows, "max_reserved_bytes", "peak reserved, whole process (MiB)", MIB, title, run=run)


def plot_step_time(rows: list[SweepRow], *, run: str = "") -> Figure:
    """Median step time (ms) with its p10–p90 spread against slots; stream-ordered as a dashed line and band."""
    return _plot(rows, "step_ms", "step time (ms): median, p10–p90", 1.0, "Step time vs ring slots", run=run)


def sweep_figures(rows: list[SweepRow], *, run: str = "") -> dict[str, Figure]:
    """Both plots, keyed by the file name they are written under (:data:`SWEEP_PLOT_FILES`)."""
    return dict(zip(SWEEP_PLOT_FILES, (plot_reserved(rows, run=run), plot_step_time(rows, run=run)), strict=True))


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
