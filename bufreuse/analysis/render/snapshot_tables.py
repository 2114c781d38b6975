"""Snapshot report tables: one per file (with the pending-free queue), combined over ranks, overview.

Each function takes the report dicts of :mod:`bufreuse.analysis.snapshot` and returns a rich
renderable; the CLI prints it, the demo writes it as text.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from bufreuse.analysis.render.safe import rich_text

__all__ = ["combined_table", "file_renderable", "fmt_bytes", "snapshots_table", "stream_name"]

_MiB = 1 << 20


def fmt_bytes(n: int | float | None) -> str:
    """``1,078 MiB`` style (GiB above 100 GiB); ``-`` for None."""
    if n is None:
        return "-"
    if abs(n) >= 100 * 1024 * _MiB:
        return f"{n / (1024 * _MiB):,.1f} GiB"
    if abs(n) >= _MiB:
        return f"{n / _MiB:,.0f} MiB" if abs(n) >= 100 * _MiB else f"{n / _MiB:,.1f} MiB"
    return f"{int(n):,} B"


_STREAMS = {0: "default", 1: "legacy default", 2: "per-thread default"}
"""The CUDA stream handles with a name (``cudaStreamLegacy`` is 0x1, ``cudaStreamPerThread`` 0x2)."""


def stream_name(stream: int | str) -> str:
    """A stream as a person reads it: torch's snapshot records a stream as its ``cudaStream_t`` handle (an
    int, no name), so 0 is the default stream and any other is shown as the handle, ``0x39f5a340``."""
    try:
        s = int(stream)
    except (TypeError, ValueError):
        return str(stream)
    return _STREAMS.get(s, f"0x{s:x}" if s > 0 else str(s))


def _when(report: dict[str, Any], key: str) -> str:
    idx = report.get(f"{key}_event_index")
    if idx is None:
        return "final state"
    return "before the first event" if idx < 0 else f"event {idx:,}"


def _lifted(report: dict[str, Any]) -> str:
    """A note when max reserved is shown as max active (the trace's segment entries gave less: a warning says)."""
    segments = report.get("max_reserved_in_segments_bytes")
    return (
        "; at least (max active: see warnings)"
        if segments is not None and segments < report["max_reserved_bytes"]
        else ""
    )


def file_renderable(report: dict[str, Any], *, top: int = 10) -> RenderableType:
    """Summary figures, the pending-free groups at the max-active point, per-stream totals, warnings."""
    title = f"{rich_text(report['file'])} (device {report['device']})"
    if others := [d for d in report.get("devices", {}) if d != str(report["device"])]:
        title += f": the device with the highest max reserved; also in the file: device {', '.join(others)} (--json)"
    s = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    s.add_column("figure", style="bold")
    s.add_column("value", justify="right")
    s.add_column("note", style="dim")
    rows = [
        ("max reserved", report["max_reserved_bytes"], _when(report, "max_reserved") + _lifted(report)),
        ("reserved at trace start", report["reserved_at_trace_start_bytes"], "memory from before recording"),
        ("max active", report["max_active_bytes"], _when(report, "max_active")),
        ("  allocated there", report["allocated_at_max_active_bytes"], ""),
        ("  pending free there", report["pending_free_at_max_active_bytes"], "blocks waiting on record_stream"),
        ("max pending free", report["max_pending_free_bytes"], "anywhere in the trace, freed in it"),
        ("final reserved", report["final_reserved_bytes"], f"{report['num_segments']} segments"),
    ]
    if before := report.get("pending_before_trace_at_max_active_bytes"):
        moves = report.get("max_active_depends_on_pending_before_trace")
        note = "cause unknown (freed before recording began)" + (
            "; the max-active point depends on it" if moves else ""
        )
        rows.insert(5, ("  pending before the trace", before, note))
    if report.get("pending_before_trace_bytes"):
        rows.append(("pending at trace start", report["pending_before_trace_bytes"], "freed before recording began"))
    rows += [(f"  {k}", v, "final state") for k, v in report["final_state_bytes"].items()]
    frag = report["fragmentation"]
    rows += [
        ("  rounding waste", frag["rounding_waste_bytes"], "active blocks: size - requested"),
    ]
    for name, value, note in rows:
        s.add_row(name, fmt_bytes(value), note)
    s.add_row("trace events", f"{report['num_trace_events']:,}", report["format"])
    for cat, b in report["pending_free_by_category_at_max_active"].items():
        if b:
            s.add_row(f"pending free: {rich_text(cat)}", fmt_bytes(b), "at max active")
    parts: list[RenderableType] = [s]
    groups = report["pending_free_groups_at_max_active"]
    if groups:
        g = Table(title="pending-free queue at max active (by site, size, stream)", title_justify="left")
        for col, j in (("count", "right"), ("size", "right"), ("total", "right"), ("stream", "right")):
            g.add_column(col, justify=j)  # type: ignore[arg-type]
        g.add_column("category")
        g.add_column("site", overflow="fold")
        for row in groups[:top]:
            g.add_row(
                f"{row['count']:,}",
                fmt_bytes(row["size_bytes"]),
                fmt_bytes(row["total_bytes"]),
                stream_name(row["stream"]),
                rich_text(row["category"]),
                rich_text(row["site"]),
            )
        if len(groups) > top:
            g.caption = f"{len(groups) - top} more groups (--top, or --json for all)"
        parts.append(g)
    if len(report["streams"]) > 1 or report["oom_events"]:
        st = Table(title="per stream", title_justify="left")
        for col in ("stream", "allocs", "alloc bytes", "pending free at max active", "final active"):
            st.add_column(col, justify="right")
        for sid, f in report["streams"].items():
            st.add_row(
                rich_text(stream_name(sid)),
                f"{f.get('alloc_count', 0):,}",
                fmt_bytes(f.get("alloc_bytes", 0)),
                fmt_bytes(f.get("pending_free_at_max_active_bytes", 0)),
                fmt_bytes(f.get("final_active_bytes", 0)),
            )
        parts.append(st)
    for oom in report["oom_events"]:
        parts.append(
            f"[red]OOM[/] at event {oom['event_index']:,}: asked {fmt_bytes(oom['size_bytes'])}, "
            f"device free {fmt_bytes(oom['device_free_bytes'])} (stream {stream_name(oom['stream'])})"
        )
    for w in report["warnings"]:
        parts.append(f"[yellow]warning:[/] {rich_text(w)}")
    return Group(*parts)


def combined_table(combined: dict[str, Any], labels: Sequence[str] = ()) -> Table:
    """Min / median / max of each figure over the files, naming the worst by the shortest path that tells the
    files apart (``slots4/snapshot.pickle.gz``; a rank's number is in its file name)."""
    t = Table(title=f"combined over {combined['reported']} of {combined['files']} files", title_justify="left")
    for col in ("figure", "min", "median", "max", "worst"):
        t.add_column(col, justify="left" if col in ("figure", "worst") else "right")
    for name, f in combined["figures"].items():
        fmt = (lambda v: f"{int(v):,}") if not name.endswith("_bytes") else fmt_bytes
        worst = rich_text(f.get("worst_label") or os.path.basename(f["worst_file"]))
        t.add_row(name.removesuffix("_bytes").replace("_", " "), fmt(f["min"]), fmt(f["median"]), fmt(f["max"]), worst)
    return t


def snapshots_table(reports: list[dict[str, Any]]) -> Table:
    """One row per snapshot: max reserved, max active, pending-free there and its categories (MiB)."""
    table = Table(title="allocator snapshots", title_justify="left")
    for name in ("snapshot", "max reserved MiB", "max active MiB", "pending-free @max-active MiB", "by category"):
        table.add_column(name, justify="left" if name in ("snapshot", "by category") else "right")
    for r in reports:
        if "error" in r:
            table.add_row(rich_text(r["file"]), "—", "—", "—", f"unreadable: {rich_text(r['error'])}")
            continue
        cats = r.get("pending_free_by_category_at_max_active") or {}
        table.add_row(
            rich_text(r["file"]),
            _mib(r.get("max_reserved_bytes")),
            _mib(r.get("max_active_bytes")),
            _mib(r.get("pending_free_at_max_active_bytes")),
            ", ".join(f"{rich_text(k)} {_mib(v)}" for k, v in sorted(cats.items()) if v) or "—",
        )
    return table


def _mib(v: Any) -> str:
    if not isinstance(v, int | float):
        return "—"
    return f"{v / _MiB:.2g}" if 0 < abs(v) < _MiB else f"{v / _MiB:,.0f}"  # a tiny value is not "0"
