"""`bufreuse demo`: snapshot report, sweep table, compare and plots over the bundled recordings."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from bufreuse.cli._common import console, err_console, handle_errors
from bufreuse.cli._validate import check_output_dir

__all__ = ["register"]

LIVE_SLOTS = [0, 2, 4, 10]


def _record_live(out: Path) -> Path:
    """Re-record the example sweep on this machine's GPU; returns the folder holding it."""
    import torch

    from bufreuse.errors import InputError
    from bufreuse.launch.sweep import SweepSpec, run_sweep

    if not torch.cuda.is_available():
        raise InputError("--live re-records the sweep on a local CUDA GPU and none is visible; drop --live")
    root = out / "live-sweeps"
    spec = SweepSpec(slots=list(LIVE_SLOTS), modes=["stream-ordered"], root=str(root), name="live", force=True)
    with err_console.status("recording the sweep on the local GPU (slots 0, 2, 4, 10 + stream-ordered)"):
        result = run_sweep(spec, launcher="local")
    bad = {c: s for c, s in result.statuses.items() if s != "ok"}
    if bad:
        err_console.print(f"[yellow]warning:[/] not ok: {', '.join(f'{c} {s}' for c, s in bad.items())}")
    return root


@handle_errors
def demo(
    out: Annotated[Path, typer.Option(help="Folder the tables (txt/json/csv) and PNG plots go to.")] = Path(
        "bufreuse-demo"
    ),
    examples: Annotated[
        Path | None,
        typer.Option(help="Folder of recorded sweeps and snapshots (default: ./examples, else the checkout's)."),
    ] = None,
    live: Annotated[
        bool, typer.Option("--live", help="Re-record the sweep on a local CUDA GPU first, then analyse that.")
    ] = False,
    mkdir: Annotated[bool, typer.Option("--mkdir", help="Create the --out folder's missing parents.")] = False,
) -> None:
    """Run snapshot-report, the sweep table, compare control feature and the plots end to end."""
    check_output_dir(out, mkdir=mkdir, option="--out")
    from bufreuse.demo import default_examples_dir, run_demo

    source = _record_live(out) if live else (examples or default_examples_dir())
    _check_examples(Path(source))
    with err_console.status("demo") as status:
        result = run_demo(source, out, step=lambda msg: status.update(f"demo: {msg}"))
    console.print(
        f"[bold]bufreuse demo[/] over {escape(str(result.examples))} ({len(result.sweeps)} sweep(s)):", soft_wrap=True
    )
    for line in result.summary:
        console.print(f"  {escape(line)}", soft_wrap=True)
    console.print(f"wrote {len(result.files)} files into {escape(str(result.out))}/", soft_wrap=True)


def _check_examples(source: Path) -> None:
    """Read every sweep's manifest (and its configuration ids) and every finished run's metrics first: a broken
    one refuses the demo before any table or plot is written, instead of after the snapshot reports. A
    metrics.json whose figures are no measurement (a wrong type, NaN) is a recording the demo would compare into
    no comparison: one error line, exit 2 (``compare`` over a whole sweep keeps it as a labelled failed row)."""
    from bufreuse.demo import find_sweeps
    from bufreuse.errors import InputError
    from bufreuse.fsutil import read_json
    from bufreuse.sweepdir import STATUSES, metrics_problem

    for sweep in find_sweeps(source):
        for cid in sweep.config_ids():
            paths = sweep.paths(cid)
            try:
                metrics = read_json(paths.metrics)
            except (OSError, ValueError):
                continue  # not finished: the demo reports it as such
            finished = isinstance(metrics, dict) and metrics.get("status") in STATUSES
            if finished and (problem := metrics_problem(metrics)):
                raise InputError(f"{paths.metrics}: refused: {problem}: {cid} would yield no comparison")


def register(app: typer.Typer) -> None:
    """Add ``demo`` to ``app``."""
    app.command("demo")(demo)
