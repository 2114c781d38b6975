"""`bufreuse compare`: a baseline against one or more runs, side by side, with verdicts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from bufreuse.cli._common import (
    console,
    err_console,
    handle_errors,
    json_option,
    return_freed_memory,
    root_option,
    write_figures,
)
from bufreuse.cli._validate import check_output_dir, check_output_file, finite

__all__ = ["register"]


@handle_errors
def compare(
    runs: Annotated[
        list[str],
        typer.Argument(
            help="Runs to compare, baseline first: labels of the latest sweep (control: the record_stream run; "
            "feature: every run that is not the control; slots4, stream-ordered: one configuration), sweep or "
            "configuration folders, Megatron run folders or log files, snapshot files."
        ),
    ],
    root: Annotated[str | None, root_option("Sweeps root for labels")] = None,
    warmup: Annotated[
        int,
        typer.Option(min=0, help="Iterations to skip at the start of a Megatron log (log windows overlapping them)."),
    ] = 3,
    throughput_band: Annotated[
        float,
        typer.Option(
            callback=finite(lo=0, hi=1000), help="Parity band for throughput and step time, percent of baseline."
        ),
    ] = 1.0,
    memory_band_mib: Annotated[
        float, typer.Option(callback=finite(lo=0), help="Parity band for memory, MiB (or the % band).")
    ] = 64.0,
    memory_band_pct: Annotated[
        float,
        typer.Option(
            callback=finite(lo=0, hi=1000), help="Parity band for memory, percent of baseline (larger band wins)."
        ),
    ] = 0.1,
    slot_bytes: Annotated[
        list[str] | None,
        typer.Option(help="Slot size BUF=BYTES (dispatch, expert) to explain the allocated delta; repeatable."),
    ] = None,
    slot_mib: Annotated[
        list[str] | None, typer.Option(help="Slot size BUF=MIB, or MIB for every ring buffer; repeatable.")
    ] = None,
    json_out: Annotated[bool, json_option("the comparison")] = False,
    csv_path: Annotated[Path | None, typer.Option("--csv", help="Also write one CSV row per run and metric.")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write memory, throughput and per-iteration PNG plots into this folder.")
    ] = None,
    mkdir: Annotated[bool, typer.Option("--mkdir", help="Create missing folders for --csv and --plot.")] = False,
    force: Annotated[
        bool, typer.Option(help="Compare a Megatron log with a snapshot anyway (different scopes; caveat stated).")
    ] = False,
    fail_on_regression: Annotated[
        bool,
        typer.Option(
            help="Exit 1 when any metric regresses beyond its band (for CI gating); allocated growth "
            "covered by the runs' ring storage does not count."
        ),
    ] = False,
) -> None:
    """Compare runs against the first one: deltas, noise bands, verdicts, ring-storage explanation.

    `compare control feature` compares the latest sweep's control with every other run in it. Verdicts:
    improvement, parity, regression, inconclusive (the interval straddles the band's edge), or explained (an
    allocated rise the rings' own storage accounts for). Exit 1 with --fail-on-regression when a metric regresses.
    """
    from bufreuse.analysis.render.compare_tables import comparison_json, comparison_renderable
    from bufreuse.analysis.render.export import csv_text
    from bufreuse.analysis.runs.compare import compare_specs
    from bufreuse.analysis.runs.record import parse_slot_sizes
    from bufreuse.analysis.runs.verdicts import Bands
    from bufreuse.errors import CheckFailedError
    from bufreuse.fsutil import atomic_write_text

    check_output_file(csv_path, suffixes=(".csv",), mkdir=mkdir, option="--csv")
    check_output_dir(plot, mkdir=mkdir, option="--plot")
    return_freed_memory()  # one log's columns go back to the OS before the next log is read
    bands = Bands(throughput_pct=throughput_band, memory_mib=memory_band_mib, memory_pct=memory_band_pct)
    sizes = parse_slot_sizes(slot_bytes, slot_mib)
    with err_console.status("reading runs (snapshots can take a while)"):
        result = compare_specs(runs, root=root, warmup=warmup, bands=bands, slot_bytes=sizes, force=force)
    written = [atomic_write_text(csv_path, csv_text(result.to_rows()))] if csv_path else []
    if plot is not None:
        from bufreuse.analysis.render.plots import comparison_figures

        written += write_figures(plot, comparison_figures(result))
    if json_out:
        typer.echo(comparison_json(result))
    else:
        console.print(comparison_renderable(result))
        for path in written:
            console.print(f"wrote {escape(str(path))}")
    if fail_on_regression and result.failing:
        shown = ", ".join(f"{run}:{metric}" for run, metric in result.failing)
        excused = [f"{run}:{metric}" for run, metric in result.regressions if (run, metric) not in result.failing]
        note = f" (not counted, covered by ring storage: {', '.join(excused)})" if excused else ""
        raise CheckFailedError(f"regression beyond the noise band: {shown}{note}")


def register(app: typer.Typer) -> None:
    """Add ``compare`` to ``app``."""
    app.command("compare")(compare)
