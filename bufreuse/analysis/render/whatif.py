"""Tables and figures for ``what-if`` and ``snapshot-diff``: take results, return renderables.

Nothing here reads snapshots or prints. matplotlib
is imported inside the figure functions, so table-only runs never pay its import.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from bufreuse.analysis.render.snapshot_tables import fmt_bytes
from bufreuse.analysis.snapshot.diff import BEFORE_TRACE, MEASURES, SnapshotDiff
from bufreuse.analysis.snapshot.whatif import WhatIfResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["diff_figure", "diff_renderable", "whatif_figure", "whatif_renderable"]

_GiB = float(1 << 30)
_MEASURE_TITLES = {
    "reserved": "reserved @max reserved",
    "active": "active @max active",
    "pending": "pending free @max active",
}


def _label(path: str) -> str:
    """The file with its folder (``slots0/snapshot.pickle.gz``): runs often share the file name."""
    head, tail = posixpath.split(str(path).replace("\\", "/"))
    return f"{posixpath.basename(head)}/{tail}" if head else tail


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _delta(n: int) -> str:
    return ("+" if n > 0 else "") + fmt_bytes(n) if n else "0"


def whatif_renderable(result: WhatIfResult) -> RenderableType:
    """The rings (sites, slot size, slots needed) and the predicted figures per slot count."""
    rings = Table(title=f"what-if: {result.file} (device {result.device})", title_justify="left")
    rings.add_column("ring")
    rings.add_column("sites", overflow="fold")
    for col in ("blocks", "slot", "min slots"):
        rings.add_column(col, justify="right")
    for r in result.rings:
        sites = ", ".join(r.sites[:3]) + (f" (+{len(r.sites) - 3})" if len(r.sites) > 3 else "")
        rings.add_row(r.name, sites, f"{r.blocks:,}", fmt_bytes(r.slot_bytes), str(r.min_slots))
    pred = Table(title="predicted by the allocator model", title_justify="left")
    cols = ["slots", "max reserved", "vs control", "max allocated", "ring storage"]
    if result.measured:
        cols += ["measured", "error"]
    for col in cols:
        pred.add_column(col, justify="right")
    base = result.calibration.max_reserved or 0
    notes: list[str] = []
    for p in result.predictions:
        row = [
            "0 (control)" if p.slots == 0 else str(p.slots),
            fmt_bytes(p.max_reserved) if p.feasible else "infeasible",
            _pct((p.max_reserved - base) / base) if p.feasible and base and p.slots else "",
            fmt_bytes(p.max_allocated),
            fmt_bytes(p.ring_bytes) if p.slots and p.feasible else "",
        ]
        if result.measured:
            row += [fmt_bytes(result.measured.get(p.slots)), _pct(result.error(p))]
        pred.add_row(*row)
        if p.note:
            notes.append(f"{p.slots} slots: {p.note} (the ring would raise EarlyReuseError)")
    foot = Text(
        f"model calibration: the trace as recorded replays to {fmt_bytes(result.calibration.max_reserved)} max "
        f"reserved; the snapshot says {fmt_bytes(result.measured_max_reserved)} ({_pct(result.calibration_error)})",
        style="dim",
    )
    parts: list[RenderableType] = [rings, pred, *(Text(n, style="yellow") for n in notes), foot]
    parts += [Text(f"warning: {w}", style="yellow") for w in result.warnings]
    return Group(*parts)


def whatif_figure(result: WhatIfResult) -> Figure:
    """Predicted max reserved and allocated per slot count (measured runs as markers)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ok = [p for p in result.predictions if p.feasible]
    labels = ["control" if p.slots == 0 else str(p.slots) for p in ok]
    x = range(len(ok))
    ax.bar([i - 0.2 for i in x], [(p.max_reserved or 0) / _GiB for p in ok], 0.4, label="predicted max reserved")
    ax.bar([i + 0.2 for i in x], [(p.max_allocated or 0) / _GiB for p in ok], 0.4, label="predicted max allocated")
    meas = [(i, result.measured[p.slots] / _GiB) for i, p in enumerate(ok) if p.slots in result.measured]
    if ok and ok[0].slots == 0 and 0 not in result.measured:
        meas.insert(0, (0, result.measured_max_reserved / _GiB))  # the control snapshot itself
    if meas:
        ax.plot([i - 0.2 for i, _ in meas], [v for _, v in meas], "k_", ms=22, mew=2, label="measured max reserved")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("slots per ring")
    ax.set_ylabel("GiB")
    ax.set_title(_label(result.file), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def diff_renderable(diff: SnapshotDiff, *, top: int = 15) -> RenderableType:
    """Headline deltas, then per figure the sites whose bytes changed most: A, B (counts) and Δ."""
    a, b = diff.a, diff.b
    head = Table(title=f"snapshot-diff\n  A: {a.file}\n  B: {b.file}", title_justify="left")
    for col in ("figure", "A", "B", "Δ (B − A)", "Δ %"):
        head.add_column(col, justify="left" if col == "figure" else "right")
    for name, va, vb in (
        ("max reserved", a.max_reserved, b.max_reserved),
        ("max active", a.max_active, b.max_active),
        ("pending free @max active", a.pending_at_max_active, b.pending_at_max_active),
    ):
        head.add_row(name, fmt_bytes(va), fmt_bytes(vb), _delta(vb - va), _pct((vb - va) / va) if va else "-")
    parts: list[RenderableType] = [head]
    parts += [Text(f"caveat: {c}", style="bold yellow") for c in diff.caveats]  # qualifies every delta below
    unit = {"reserved": "segments", "active": "blocks", "pending": "blocks"}
    for m in MEASURES:
        rows = sorted((r for r in diff.rows if r.a[m][0] or r.b[m][0]), key=lambda r: (-abs(r.delta(m)), r.site))
        t = Table(title=f"{_MEASURE_TITLES[m]}, by allocation site ({unit[m]})", title_justify="left")
        t.add_column("site", overflow="fold")
        t.add_column("category")
        for col in ("A", "B", "Δ"):
            t.add_column(col, justify="right")
        for r in rows[:top]:
            (ab, ac), (bb, bc) = r.a[m], r.b[m]
            t.add_row(r.site, r.category, f"{fmt_bytes(ab)} ({ac})", f"{fmt_bytes(bb)} ({bc})", _delta(bb - ab))
        parts.append(t)
        if len(rows) > top:
            parts.append(Text(f"{len(rows) - top} more sites (--top, or --json for all)", style="dim"))
    if any(r.site == BEFORE_TRACE for r in diff.rows):
        parts.append(
            Text(f"{BEFORE_TRACE}: memory allocated before recording started (weights, ring storage)", style="dim")
        )
    parts += [Text(f"warning ({s.file}): {w}", style="yellow") for s in (a, b) for w in s.warnings]
    return Group(*parts)


def diff_figure(diff: SnapshotDiff, *, top: int = 10) -> Figure:
    """Horizontal bars: each site's change (B − A) in the three figures, biggest first."""
    from matplotlib.figure import Figure

    rows = diff.rows[:top][::-1]
    fig = Figure(figsize=(10, 1.2 + 0.55 * max(len(rows), 1)), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    h = 0.8 / len(MEASURES)
    for k, m in enumerate(MEASURES):
        ys = [i + (k - 1) * h for i in range(len(rows))]
        ax.barh(ys, [r.delta(m) / _GiB for r in rows], h, label=_MEASURE_TITLES[m])
    ax.set_yticks(range(len(rows)), [f"{r.site} [{r.category}]" for r in rows], fontsize=8)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("change B − A (GiB)")
    ax.set_title(f"{_label(diff.a.file)} → {_label(diff.b.file)}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return fig
