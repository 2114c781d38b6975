"""The one screen of ``bufreuse advise``: verdict, MoE pending-free sites, depth, prediction, checks, flags."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from bufreuse.analysis.advise import Advice
from bufreuse.analysis.render.snapshot_tables import fmt_bytes

__all__ = ["advice_renderable"]


def advice_renderable(a: Advice) -> RenderableType:
    """Everything on one screen, the answer first."""
    parts: list[RenderableType] = [
        Text.from_markup(
            f"[bold]{escape(a.file)}[/] (device {a.device}): "
            + ("[green]" if a.gain else "[yellow]")
            + escape(a.verdict)
            + "[/]"
        ),
        Text(
            f"max reserved {fmt_bytes(a.max_reserved_bytes)}; max active {fmt_bytes(a.max_active_bytes)}, of which "
            f"pending free {fmt_bytes(a.pending_free_bytes)} ({fmt_bytes(a.moe_pending_bytes)} MoE buffers)"
            + ("" if a.recording else "; final state only (no trace)")
        ),
    ]
    parts += [Text.from_markup(f"[bold yellow]caveat:[/] {escape(c)}") for c in a.caveats]
    if a.moe_sites:
        t = Table(title="MoE buffers pending free at max active", title_justify="left", pad_edge=False)
        for col, just in (("buffer", "left"), ("count", "right"), ("size", "right"), ("total", "right"),
                          ("site", "left")):  # fmt: skip
            t.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
        for s in a.moe_sites:
            t.add_row(s["category"], str(s["count"]), fmt_bytes(s["size_bytes"]), fmt_bytes(s["total_bytes"]),
                      escape(s["site"]))  # fmt: skip
        parts.append(t)
    if a.depth:
        src = {"planner": "bufreuse plan", "trace": "this trace"}.get(a.depth_source, a.depth_source)
        parts.append(Text(f"slot depth ({src}): " + ", ".join(f"{b} {n}" for b, n in a.depth.items())))
    for note in a.depth_notes:
        parts.append(Text.from_markup(f"  [dim]{escape(note)}[/]"))
    if a.predictions:
        t = Table(title="what-if (allocator model replaying this trace)", title_justify="left", pad_edge=False)
        for col in ("slots", "max reserved", "vs control", "ring storage"):
            t.add_column(col, justify="right")
        ctl = a.predictions[0]["control_model_max_reserved_bytes"]
        t.add_row("0 (control)", fmt_bytes(ctl) if ctl is not None else "-", "", "")
        for p in a.predictions:
            if not p["feasible"]:
                t.add_row(str(p["slots"]), "infeasible", escape(p["note"]), "")
                continue
            ch = "-" if p["change"] is None else f"{p['change']:+.1%}"
            t.add_row(str(p["slots"]), fmt_bytes(p["max_reserved_bytes"]), ch, fmt_bytes(p["ring_bytes"]))
        parts.append(t)
        if a.calibration_error is not None:
            parts.append(Text(f"model calibration on the unchanged trace: {a.calibration_error:+.1%}", style="dim"))
    if a.checked:
        if a.unmet:
            parts.append(Text.from_markup(f"[red]check-config: {len(a.unmet)} requirement(s) unmet[/]"))
            for r in a.unmet:
                note = f" ({r['note']})" if r["note"] else ""
                parts.append(Text(f"  ✗ {r['buffer']}: {r['text']}{note}; {r['fix']}"))
        else:
            parts.append(Text.from_markup("[green]check-config: every requirement met[/]"))
    else:
        parts.append(Text("check-config: not run (pass --config or --args)", style="dim"))
    if a.flags:
        parts.append(Text("Megatron flags to add:", style="bold"))
        parts.append(Text("  " + " \\\n  ".join(a.flags)))
    for w in a.warnings:
        parts.append(Text.from_markup(f"[yellow]warning:[/] {escape(w)}"))
    return Group(*parts)
