"""`bufreuse snapshot-diff A B`: max reserved, max active and pending free, A vs B, by allocation site."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from bufreuse.cli._common import console, err_console, handle_errors, json_option, write_figure
from bufreuse.cli._validate import check_output_file

__all__ = ["register"]


@handle_errors
def snapshot_diff(
    a: Annotated[Path, typer.Argument(help="Snapshot A (the baseline, e.g. the control run).")],
    b: Annotated[Path, typer.Argument(help="Snapshot B (e.g. the ring run).")],
    json_out: Annotated[bool, json_option("the figures and every site's change")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the biggest per-site changes.")] = None,
    mkdir: Annotated[bool, typer.Option("--mkdir", help="Create the --plot file's missing folders.")] = False,
    category: Annotated[
        list[str] | None,
        typer.Option(help="Category rule NAME=REGEX on the alloc stack's 'file:function' lines; repeatable."),
    ] = None,
    site_frame: Annotated[int, typer.Option(min=0, help="Which user frame names a site (0 = innermost).")] = 0,
    top: Annotated[int, typer.Option(min=1, help="Sites shown in the table and the plot.")] = 15,
) -> None:
    """Compare two allocator snapshots and attribute the difference to allocation sites."""
    check_output_file(plot, suffixes=(".png",), mkdir=mkdir, option="--plot")
    from bufreuse.analysis.snapshot.diff import diff_files
    from bufreuse.analysis.snapshot.sites import parse_category_options
    from bufreuse.errors import InputError

    try:
        cats = parse_category_options(category or [])
    except ValueError as e:
        raise InputError(str(e)) from None
    diff = diff_files(a, b, categories=cats, site_frame=site_frame)
    if json_out:
        from bufreuse.analysis.render.export import json_text
        typer.echo(json_text(diff.to_json()))
    else:
        from bufreuse.analysis.render.whatif import diff_renderable

        console.print(diff_renderable(diff, top=top))
    if plot is not None:
        from bufreuse.analysis.render.whatif import diff_figure

        err_console.print(f"wrote {escape(str(write_figure(plot, diff_figure(diff, top=top))))}")


def register(app: typer.Typer) -> None:
    """Add ``snapshot-diff`` to ``app``."""
    app.command("snapshot-diff")(snapshot_diff)
