"""A slot sweep's results as rows, a rich table and plots (no torch; reads only JSON).

Rows come from each configuration's ``metrics.json`` (``bufreuse.sweepdir``). Deltas compare with
the control of the same kind: ``slots0`` for eager configurations, ``slots0-graph`` for CUDA-graph
ones. ``bufreuse sweep`` and ``bufreuse demo`` render the same rows.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bufreuse.fsutil import atomic_write_bytes
from bufreuse.sweepdir import SweepDir

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.table import Table

__all__ = [
    "PLOT_FILES",
    "SweepRow",
    "checksum_mismatches",
    "load_sweep_rows",
    "plot_reserved",
    "plot_step_time",
    "rows_from_metrics",
    "sweep_table",
    "write_sweep_plots",
]

MIB = 1024 * 1024
PLOT_FILES = ("reserved_vs_slots.png", "step_time_vs_slots.png")


@dataclass(kw_only=True, slots=True)
class SweepRow:
    """One configuration's figures (None where the run did not produce them)."""

    config_id: str
    mode: str
    """control, stream-ordered or ring."""
    slots: int
    cuda_graph: bool
    status: str
    """ok, failed, hung, timeout, cancelled, or pending (no metrics.json yet)."""
    max_reserved_bytes: int | None = None
    max_allocated_bytes: int | None = None
    reserved_delta_bytes: int | None = None
    """Max reserved minus the control's."""
    pending_free_bytes: int | None = None
    """Pending-free bytes at the max-active point of the recorded snapshot."""
    step_ms: float | None = None
    """Median step time."""
    step_p10_ms: float | None = None
    step_p90_ms: float | None = None
    step_delta_pct: float | None = None
    """Median step time vs the control's, in percent."""
    tflops: float | None = None
    checksum: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rows_from_metrics(metrics_by_id: dict[str, dict[str, Any] | None]) -> list[SweepRow]:
    """Rows from ``{config_id: metrics.json content or None}``, with deltas against the controls."""
    rows: list[SweepRow] = []
    for cid, m in metrics_by_id.items():
        cfg = _obj((m or {}).get("config"))
        graph = bool(cfg.get("cuda_graph", cid.endswith("-graph")))
        base = cid.removesuffix("-graph")
        mode = str(cfg.get("mode") or ("control" if base == "slots0" else "ring" if base.startswith("slots") else base))
        default_slots = int(base[5:]) if base.startswith("slots") and base[5:].isdigit() else 0
        slots = int(_num(cfg.get("slots")) or default_slots)
        if m is None:
            rows.append(SweepRow(config_id=cid, mode=mode, slots=slots, cuda_graph=graph, status="pending"))
            continue
        step = _obj(m.get("step_ms"))  # a hand-edited or foreign file: wrong types show as "—", not a crash
        rows.append(
            SweepRow(
                config_id=cid,
                mode=mode,
                slots=slots,
                cuda_graph=graph,
                status=str(m.get("status")),
                max_reserved_bytes=_num(m.get("max_reserved_bytes")),
                max_allocated_bytes=_num(m.get("max_allocated_bytes")),
                pending_free_bytes=_num(m.get("pending_free_at_max_active_bytes")),
                step_ms=_num(step.get("median")),
                step_p10_ms=_num(step.get("p10")),
                step_p90_ms=_num(step.get("p90")),
                tflops=_num(m.get("tflops")),
                checksum=m.get("checksum"),
                error=m.get("error"),
            )
        )
    controls = {r.cuda_graph: r for r in rows if r.mode == "control" and r.status == "ok"}
    for r in rows:
        c = controls.get(r.cuda_graph)
        if c is None or r.status != "ok":
            continue
        if r.max_reserved_bytes is not None and c.max_reserved_bytes is not None:
            r.reserved_delta_bytes = r.max_reserved_bytes - c.max_reserved_bytes
        if r.step_ms is not None and c.step_ms:
            r.step_delta_pct = 100.0 * (r.step_ms / c.step_ms - 1.0)
    return rows


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _num(value: Any) -> Any:
    """``value`` when it is a finite number (int or float, not bool), else None."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def load_sweep_rows(folder: str | os.PathLike[str], config_ids: list[str] | None = None) -> list[SweepRow]:
    """Rows of the sweep in ``folder`` (manifest order), unfinished configurations as ``pending``."""
    sweep = SweepDir(folder)
    ids = config_ids if config_ids is not None else sweep.config_ids()
    return rows_from_metrics({cid: sweep.paths(cid).read_metrics() for cid in ids})


def checksum_mismatches(rows: list[SweepRow]) -> dict[str, list[str]]:
    """``{checksum: [config ids]}`` when finished runs disagree (empty when all agree)."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r.status == "ok" and r.checksum is not None:
            groups.setdefault(r.checksum, []).append(r.config_id)
    return groups if len(groups) > 1 else {}


def _mib(v: int | None, *, signed: bool = False) -> str:
    if v is None:
        return "—"
    return f"{v / MIB:+,.0f}" if signed else f"{v / MIB:,.0f}"


def sweep_table(rows: list[SweepRow], *, title: str | None = None) -> Table:
    """A rich table: slots, mode, max reserved (+delta vs control), pending-free, step time (+delta %).

    Compact enough for 80 columns; a ``status`` column appears only when some row is not ``ok``.
    """
    from rich.table import Table

    show_status = any(r.status != "ok" for r in rows)
    t = Table(title=title, title_justify="left")
    columns = [("slots", "right"), ("mode", "left")] + ([("status", "left")] if show_status else [])
    columns += [
        ("reserved MiB", "right"), ("Δ vs control", "right"), ("alloc MiB", "right"),
        ("pending-free MiB", "right"), ("step ms", "right"), ("Δ step", "right"),
    ]  # fmt: skip
    for name, justify in columns:
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        step = "—" if r.step_ms is None else f"{r.step_ms:.2f}"
        delta = "—" if r.step_delta_pct is None else f"{r.step_delta_pct:+.1f}%"
        cells = [str(r.slots), r.mode + (" +graph" if r.cuda_graph else "")]
        if show_status:
            cells.append(r.status if r.status == "ok" else f"[red]{r.status}[/]")
        cells += [
            _mib(r.max_reserved_bytes), _mib(r.reserved_delta_bytes, signed=True), _mib(r.max_allocated_bytes),
            _mib(r.pending_free_bytes), step, delta,
        ]  # fmt: skip
        t.add_row(*cells)
    return t


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
            ax.plot(xs, [y / scale for y in ys], marker="o", label=label)
        else:
            ax.axhline(data / scale, linestyle="--", color="tab:red" if "graph" not in label else "tab:purple",
                       label=label)  # fmt: skip
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


def write_sweep_plots(folder: str | os.PathLike[str], rows: list[SweepRow]) -> list[Path]:
    """Write both plots as PNG into ``folder`` (atomically) and return their paths."""
    out = []
    for name, fig in zip(PLOT_FILES, (plot_reserved(rows), plot_step_time(rows)), strict=True):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        out.append(atomic_write_bytes(Path(folder) / name, buf.getvalue()))
    return out
