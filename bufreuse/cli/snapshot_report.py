"""`bufreuse snapshot-report FILE...`: pending-free queue at max active, max reserved, who holds what."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from bufreuse.cli._common import (
    TickFn,
    console,
    err_console,
    handle_errors,
    is_debug,
    json_option,
    print_error,
    progress_bar,
)
from bufreuse.cli._validate import check_output_file

__all__ = ["register"]


def _budget(name: str, what: str) -> Any:
    return typer.Option(
        min=1,
        help=f"Budget: {what} Shorthand for --limit {name}=N.",
        rich_help_panel="Budgets (raise for trusted big files)",
    )


@handle_errors
def snapshot_report(
    ctx: typer.Context,
    files: Annotated[
        list[Path],
        typer.Argument(help="Allocator snapshots (torch.cuda.memory._dump_snapshot pickles, plain or gzip)."),
    ],
    json_out: Annotated[bool, json_option("each file's report (one object per line)")] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Write a PNG timeline (reserved, active, pending-free band); several files: PATH-<file>.png, "
            "<file> the file's name (with its folders when names repeat)."
        ),
    ] = None,
    mkdir: Annotated[bool, typer.Option("--mkdir", help="Create the --plot file's missing folders.")] = False,
    category: Annotated[
        list[str] | None,
        typer.Option(help="Category rule NAME=REGEX on the alloc stack's 'file:function' lines; repeatable."),
    ] = None,
    site_frame: Annotated[
        int, typer.Option(min=0, help="Which user frame names a site: 0 = innermost user frame, 1 = its caller.")
    ] = 0,
    site_skip: Annotated[
        list[str] | None,
        typer.Option(help="Extra filename REGEX whose frames are not user frames (besides torch, stdlib); repeatable."),
    ] = None,
    top: Annotated[int, typer.Option(min=1, help="Pending-free groups shown per file in the table.")] = 10,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1, help="Processes for several files (default and cap: one per file, at most one per CPU, at most 64)."
        ),
    ] = None,
    max_file_bytes: Annotated[int | None, _budget("max-file-bytes", "bytes of a file on disk (default 4 GiB).")] = None,
    max_pickle_bytes: Annotated[
        int | None, _budget("max-pickle-bytes", "decompressed pickle bytes (default 200 x gzip file + 64 MiB).")
    ] = None,
    max_trace_entries: Annotated[
        int | None, _budget("max-trace-entries", "trace entries, all devices (default 8,000,000).")
    ] = None,
    max_blocks: Annotated[int | None, _budget("max-blocks", "segments plus blocks (default 2,000,000).")] = None,
    max_memory_bytes: Annotated[
        int | None, _budget("max-memory-bytes", "memory loading and analysing one file may add (default 1.5 GiB).")
    ] = None,
) -> None:
    """Report allocator snapshots: max reserved, max active and the pending-free queue there, by site."""
    from bufreuse import limits
    from bufreuse.analysis.snapshot import ReportConfig, combine, parse_category_options, report_files
    from bufreuse.errors import InputError

    raised = {
        "max_file_bytes": max_file_bytes,
        "max_pickle_bytes": max_pickle_bytes,
        "max_trace_entries": max_trace_entries,
        "max_blocks": max_blocks,
        "max_memory_bytes": max_memory_bytes,
    }
    in_force = limits.current().replace(**{k: v for k, v in raised.items() if v is not None})

    for pattern in site_skip or ():  # one pattern at a time, so the message names the option and the pattern
        try:
            re.compile(pattern)
        except re.error as e:
            raise InputError(f"--site-skip {pattern!r}: not a regular expression ({e})") from None
    try:
        cats = parse_category_options(category or [])
        config = ReportConfig(
            categories=cats,
            site_frame=site_frame,
            site_skip=tuple(site_skip or ()),
            timeline_points=2000 if plot is not None else 0,
        )
        config.rules()  # compiles every regex now: a bad one is one error line, not one per file
    except (ValueError, re.error) as e:
        raise InputError(str(e)) from None

    check_output_file(plot, suffixes=(".png",), mkdir=mkdir, option="--plot")
    paths = [str(f) for f in files]
    workers = _worker_count(workers, len(paths))
    with _file_progress(len(paths)) as (on_bytes, on_done):
        results = report_files(
            paths,
            config,
            progress=on_bytes,
            on_file_done=on_done,
            workers=workers,
            raise_errors=_debug(ctx),
            limits=in_force,
        )

    from bufreuse.analysis.snapshot.batch import plot_stems

    stems = plot_stems([r.file for r in results])  # one plot per file, named by the file (runs of a sweep: its folder)
    failed = 0
    for i, res in enumerate(results):
        if res.error is not None or res.report is None:
            failed += 1
            print_error(str(res.error))
            continue
        if json_out:
            from bufreuse.analysis.render.export import json_text
            typer.echo(json_text(res.report, default=str))
        else:
            from bufreuse.analysis.render.snapshot_tables import file_renderable

            console.print(file_renderable(res.report, top=top))  # the renderer escapes file strings
            console.print()
        if plot is not None and res.timeline is not None:
            from bufreuse.analysis.render.export import png_bytes
            from bufreuse.analysis.render.plots import timeline_figure
            from bufreuse.fsutil import atomic_write_bytes

            out = plot if len(results) == 1 else plot.with_name(f"{plot.stem}-{stems[i]}{plot.suffix or '.png'}")
            atomic_write_bytes(out, png_bytes(timeline_figure(res.timeline, title=res.file)))
            err_console.print(f"wrote {escape(str(out))}")
        elif plot is not None:
            err_console.print(f"[yellow]no plot for {escape(str(res.file))}: the snapshot has no trace[/]")
    if len(results) - failed > 1 and not json_out:  # a summary over one (or no) readable file says nothing
        from bufreuse.analysis.render.snapshot_tables import combined_table

        console.print(combined_table(combine(results)))
    if failed:  # every bad file had its own error line; the good ones were reported above
        if len(results) > 1:
            err_console.print(f"{failed} of {len(results)} files could not be reported", highlight=False)
        raise typer.Exit(2)


def _worker_count(requested: int | None, n_files: int) -> int:
    """Workers for ``n_files``: never more than the files, the CPUs or the ``max_workers`` budget."""
    import os

    from bufreuse import limits

    cap = max(1, min(n_files, os.cpu_count() or 1, limits.current().max_workers))
    return cap if requested is None else min(requested, cap)


def _debug(ctx: typer.Context) -> bool:
    """``--debug`` from the root context (read through ``ctx``: no click context is current here)."""
    return is_debug() or bool(getattr(ctx.find_root().obj, "debug", False))


@contextlib.contextmanager
def _file_progress(n_files: int) -> Iterator[tuple[TickFn, Callable[[object], None]]]:
    """Bytes loaded for one file, files done for several (no refresh thread then: workers fork)."""
    if n_files == 1:
        with progress_bar("loading", unit="bytes") as tick:
            yield tick, lambda _res: None
        return
    done = 0
    with progress_bar("snapshots", refresh_thread=False) as tick:

        def on_done(_res: object) -> None:
            nonlocal done
            done += 1
            tick(done, n_files)

        tick(0, n_files)
        yield (lambda _done, _total: None), on_done


def register(app: typer.Typer) -> None:
    """Add ``snapshot-report`` to ``app``."""
    app.command("snapshot-report")(snapshot_report)
