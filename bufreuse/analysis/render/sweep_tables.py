"""The sweep table: slots, mode, the process's peak reserved (+delta), pending-free, step time (+delta %)."""

from __future__ import annotations

from rich.table import Table

from bufreuse.analysis.render.safe import rich_text
from bufreuse.analysis.runs.record import MIB
from bufreuse.analysis.runs.sweep_rows import SweepRow

__all__ = ["sweep_table"]


def _mib(v: int | None, *, signed: bool = False) -> str:
    if v is None:
        return "—"
    return f"{v / MIB:+,.0f}" if signed else f"{v / MIB:,.0f}"


def sweep_table(rows: list[SweepRow], *, title: str | None = None) -> Table:
    """A rich table: slots, mode, the process's peak reserved (+delta), pending-free, step time (+delta %).

    Compact enough for 80 columns; a ``status`` column appears only when some row is not ``ok``.
    """
    show_status = any(r.status != "ok" for r in rows)
    t = Table(title=None if title is None else rich_text(title), title_justify="left")
    columns = [("slots", "right"), ("mode", "left")] + ([("status", "left")] if show_status else [])
    columns += [
        ("peak reserved MiB", "right"), ("Δ vs control", "right"), ("alloc MiB", "right"),
        ("pending-free MiB", "right"), ("step ms", "right"), ("Δ step", "right"),
    ]  # fmt: skip
    for name, justify in columns:
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        step = "—" if r.step_ms is None else f"{r.step_ms:.2f}"
        delta = "—" if r.step_delta_pct is None else f"{r.step_delta_pct:+.1f}%"
        cells = [str(r.slots), rich_text(r.mode) + (" +graph" if r.cuda_graph else "")]
        if show_status:
            cells.append(r.status if r.status == "ok" else f"[red]{rich_text(r.status)}[/]")
        cells += [
            _mib(r.max_reserved_bytes), _mib(r.reserved_delta_bytes, signed=True), _mib(r.max_allocated_bytes),
            _mib(r.pending_free_bytes), step, delta,
        ]  # fmt: skip
        t.add_row(*cells)
    return t
