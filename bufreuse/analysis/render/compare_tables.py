"""A comparison as rich tables (an overview, then one side-by-side table per run), plain text, JSON.

``bufreuse compare`` prints these and ``bufreuse demo`` writes them; the numbers come from
:mod:`bufreuse.analysis.runs.compare`, this module only formats them.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from bufreuse.analysis.render.export import json_text, renderable_text
from bufreuse.analysis.render.safe import rich_text
from bufreuse.analysis.runs.compare import ComparisonResult, RunComparison
from bufreuse.analysis.runs.verdicts import MetricDelta

__all__ = ["comparison_json", "comparison_renderable", "comparison_text"]

_STYLE = {
    "improvement": "green",
    "parity": "cyan",
    "regression": "bold red",
    "inconclusive": "magenta",
    "explained": "yellow",
    "n/a": "dim",
}


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "MiB":
        return f"{value:.2g}" if 0 < abs(value) < 1 else f"{value:,.0f}"  # a tiny value is not "0"
    return f"{value:,.2f}"


def _labelled(label: str, text: str) -> str:
    """``label: text``, unless ``text`` already starts with the label (a run's own warning)."""
    return text if text.startswith(f"{label}: ") else f"{label}: {text}"


def _delta_cell(m: MetricDelta) -> Text:
    if m.delta is None:
        return Text(m.verdict, style=_STYLE.get(m.verdict, ""))
    pct = f" ({m.delta_pct:+.2f}%)" if m.delta_pct is not None else ""
    if m.unit == "MiB":
        sign = f"{m.delta:+.2g}" if 0 < abs(m.delta) < 1 else f"{m.delta:+,.0f}"
    else:
        sign = f"{m.delta:+,.2f}"
    text = Text(f"{sign}{pct} ")
    if m.explained_by:
        text.append(f"{m.verdict}, explained by {m.explained_by}", style=_STYLE["explained"])
    else:
        text.append(m.verdict, style=_STYLE.get(m.verdict, ""))
    if m.ci_low is not None and m.ci_high is not None:
        text.append(f"\nCI95 [{m.ci_low:+.2f}, {m.ci_high:+.2f}]", style="dim")
    return text


def _detail_table(result: ComparisonResult, comp: RunComparison) -> Table:
    title = f"{rich_text(comp.label)} vs baseline {rich_text(result.baseline)}"
    table = Table(title=title, header_style="bold")
    table.add_column("metric")
    table.add_column(rich_text(result.baseline), justify="right")
    table.add_column(rich_text(comp.label), justify="right")
    table.add_column("Δ (Δ%) verdict")
    kinds = frozenset({comp.kind, *(r.kind for r in result.runs if r.label == result.baseline)})
    for m in comp.metrics:
        name = f"{rich_text(_title(m.metric, m.title, kinds))} ({m.unit})"
        table.add_row(name, _fmt(m.baseline, m.unit), _fmt(m.value, m.unit), _delta_cell(m))
    return table


def _title(metric: str, title: str, kinds: frozenset[str]) -> str:
    """The name of what a memory figure covers, as every other command names it (one name per quantity).

    A snapshot's reserved figure is the max over the steps it traced (``snapshot-report``'s "max reserved"); a
    sweep's or a log's is the peak of the whole process (``torch.cuda.max_memory_reserved()``): for one control
    run they differ (the proxy's: 6,488 and 7,000 MiB), so the label says which it is.
    """
    if metric == "max_active_mib":
        return "max active (allocated + pending-free)"
    if metric != "max_reserved_mib":
        return title
    if kinds == {"snapshot"}:
        return "max reserved (traced steps)"
    if "snapshot" not in kinds:
        return "peak reserved (whole process)"
    return "reserved: snapshot's max over its traced steps vs the peak of a whole process"


_HEADERS = {
    "tflops_mean": "TFLOP/s mean",
    "tflops_median": "TFLOP/s med",
    "tflops": "TFLOP/s",
    "step_ms_mean": "step mean",
    "step_ms_median": "step med",
    "max_allocated_mib": "peak allocated",
    "max_reserved_mib": "peak reserved",
    "max_active_mib": "max active",
    "device_used_mib": "device",
    "pending_free_mib": "pending-free",
}


def _overview_table(result: ComparisonResult) -> Table:
    keys: list[tuple[str, str]] = []
    for comp in result.comparisons:
        for m in comp.metrics:
            if (m.metric, m.title) not in keys:
                keys.append((m.metric, m.title))
    table = Table(title=f"overview: Δ% vs baseline {rich_text(result.baseline)}", header_style="bold")
    table.add_column("run")
    snapshots_only = all(r.kind == "snapshot" for r in result.runs)
    for key, title in keys:
        header = "max reserved" if key == "max_reserved_mib" and snapshots_only else _HEADERS.get(key)
        table.add_column(header or rich_text(title), justify="right")
    for comp in result.comparisons:
        cells: list[str | Text] = [Text(comp.label)]
        for key, _ in keys:
            m = next((x for x in comp.metrics if x.metric == key), None)
            if m is None or m.delta_pct is None:
                cells.append(Text(m.verdict if m else "—", style="dim"))
            else:
                word = "explained" if m.explained_by else m.verdict
                cells.append(Text(f"{m.delta_pct:+.1f}% {word}", style=_STYLE[word]))
        table.add_row(*cells)
    return table


def _samples_line(label: str, stats: dict[str, Any]) -> str | None:
    """``label: N samples (dropped ...); TFLOP/s p10–p90 a–b; ms p10–p90 c–d`` when samples exist."""
    pieces = []
    for key, unit in (("tflops", "TFLOP/s/GPU"), ("step_ms", "ms")):
        s = stats[key]
        if s["n"] > 1:
            pieces.append(f"{unit} p10–p90 {s['p10']:,.2f}–{s['p90']:,.2f} (n={s['n']})")
    if not pieces:
        return None
    dropped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in stats["dropped"].items() if v)
    return f"{label}: " + "; ".join(pieces) + (f"; dropped windows: {dropped}" if dropped else "")


def comparison_renderable(result: ComparisonResult) -> Group:
    """An overview (when several runs), then per run a side-by-side table and its notes."""
    parts: list[Table | Text] = []
    if len(result.comparisons) > 1:
        parts.append(_overview_table(result))
    for comp in result.comparisons:
        for caveat in comp.comparability:  # above the verdicts: they qualify every one of them
            parts.append(Text(f"{comp.label}: not like for like: {caveat}", style="bold yellow"))
        parts.append(_detail_table(result, comp))
        if comp.status != "ok":
            parts.append(Text(f"{comp.label}: status {comp.status}; no metrics compared", style="bold red"))
        if comp.explanation:
            parts.append(Text(f"{comp.label}: {comp.explanation}"))
        for m in comp.metrics:
            if m.note:
                parts.append(Text(f"{comp.label}: {m.title}: {m.note}", style="yellow"))
        for caveat in comp.caveats:
            parts.append(Text(_labelled(comp.label, caveat), style="yellow"))
    for run in result.runs:
        if line := _samples_line(run.label, result.stats[run.label]):
            parts.append(Text(line, style="dim"))
    bands = result.bands
    parts.append(
        Text(
            f"noise bands: throughput/step time ±{bands.throughput_pct:g}%, memory ±max({bands.memory_mib:g} MiB, "
            f"{bands.memory_pct:g}%)"
            + "; verdicts from the 95% interval of the difference against the band"
            + (
                f"; --warmup {result.warmup} counts iterations: Megatron log windows overlapping the first "
                f"{result.warmup} are dropped; a sample is one log window, weighted by the iterations it averages"
                if any(r.kind == "megatron" and not r.memory_only for r in result.runs)
                else ""
            ),
            style="dim",
        )
    )
    return Group(*parts)


def comparison_text(result: ComparisonResult, *, width: int = 160) -> str:
    """The rendered table as plain text (no colour), e.g. for a report file."""
    return renderable_text(comparison_renderable(result), width=width)


def comparison_json(result: ComparisonResult) -> str:
    """The JSON that ``bufreuse compare --json`` prints."""
    return json_text(result.to_dict(), indent=2, sort_keys=True)
