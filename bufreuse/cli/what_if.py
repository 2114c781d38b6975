"""`bufreuse what-if CONTROL_SNAPSHOT --slots 2,4,10`: predicted memory with the MoE buffers on rings."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from bufreuse.cli._common import console, err_console, handle_errors, json_option, write_figure
from bufreuse.cli._validate import check_output_file

__all__ = ["register"]


def _slot_counts(text: str) -> list[int]:
    """``--slots`` as numbers, each within the ``max_ring_slots`` budget (a huge count would overflow later)."""
    from bufreuse import limits
    from bufreuse.errors import InputError

    try:
        counts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise InputError(f"--slots must be comma-separated integers, got {_short(text)!r}") from None
    if not counts or any(n < 1 for n in counts):
        raise InputError(f"--slots must list slot counts >= 1 (0, the control, is always shown), got {_short(text)!r}")
    limits.check("max_ring_slots", max(counts), what="--slots: slots of one ring")
    limits.check("max_ring_slots", len(counts), what="--slots: slot counts listed")
    return counts


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:79] + "…"


def _measured(options: list[str], counts: list[int]) -> dict[int, str]:
    """``--measured SLOTS=PATH`` options; SLOTS must be one of ``--slots`` (or 0, the control)."""
    from bufreuse.errors import InputError
    from bufreuse.fsutil import refuse_special_file

    out: dict[int, str] = {}
    for opt in options:
        n, sep, path = opt.partition("=")
        if not sep or not n.strip().isdigit() or not path:
            raise InputError(f"--measured must be SLOTS=PATH (a snapshot or metrics.json), got {_short(opt)!r}")
        refuse_special_file(path, what="a snapshot or metrics.json")
        if not Path(path).is_file():
            raise InputError(f"--measured {opt}: no such file")
        slots = int(n)
        if slots != 0 and slots not in counts:
            asked = ",".join(map(str, counts))
            raise InputError(f"--measured {opt}: {slots} slot(s) is not predicted (--slots {asked}); add it to --slots")
        if slots in out:
            raise InputError(f"--measured {opt}: {slots} slot(s) given twice")
        out[slots] = path
    return out


@handle_errors
def what_if(
    snapshot: Annotated[Path, typer.Argument(help="A control allocator snapshot with a trace (record_stream run).")],
    slots: Annotated[str, typer.Option(help="Slot counts per ring to predict, comma-separated.")] = "2,4,10",
    site: Annotated[
        list[str] | None,
        typer.Option(
            help="REGEX on a block's site (path:line:function); each is one ring. Default: the "
            "MoE categories (dispatch_output, expert_output). Repeatable."
        ),
    ] = None,
    category: Annotated[
        list[str] | None,
        typer.Option(help="Extra category NAME=REGEX on the alloc stack (each becomes a ring); repeatable."),
    ] = None,
    site_frame: Annotated[int, typer.Option(min=0, help="Which user frame names a site (0 = innermost).")] = 0,
    measured: Annotated[
        list[str] | None,
        typer.Option(help="SLOTS=PATH: a measured run (snapshot or metrics.json) to show the error against."),
    ] = None,
    json_out: Annotated[bool, json_option("the rings and predictions")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of predicted (and measured) memory per N.")] = None,
    mkdir: Annotated[bool, typer.Option("--mkdir", help="Create the --plot file's missing folders.")] = False,
) -> None:
    """Predict max reserved and allocated if the named sites were served from N persistent slots."""
    check_output_file(plot, suffixes=(".png",), mkdir=mkdir, option="--plot")
    from bufreuse.analysis.snapshot.sites import parse_category_options
    from bufreuse.analysis.snapshot.whatif import what_if as run
    from bufreuse.errors import InputError

    counts = _slot_counts(slots)
    try:
        cats = parse_category_options(category or [])
        for p in site or []:
            re.compile(p)
    except (ValueError, re.error) as e:
        raise InputError(f"bad --site/--category: {e}") from None
    result = run(
        snapshot, counts, sites=tuple(site or ()), categories=cats, site_frame=site_frame,
        measured=_measured(measured or [], counts),
    )  # fmt: skip
    if json_out:
        from bufreuse.analysis.render.export import json_text
        typer.echo(json_text(result.to_json()))
    else:
        from bufreuse.analysis.render.whatif import whatif_renderable

        console.print(whatif_renderable(result))
    if plot is not None:
        from bufreuse.analysis.render.whatif import whatif_figure

        err_console.print(f"wrote {escape(str(write_figure(plot, whatif_figure(result))))}")


def register(app: typer.Typer) -> None:
    """Add ``what-if`` to ``app``."""
    app.command("what-if")(what_if)
