"""The Typer app; each command lives in its own module and registers itself here."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from bufreuse import __version__
from bufreuse.cli import bench, check_config, compare, demo, snapshot_diff, snapshot_report, sweep, what_if
from bufreuse.cli._common import CliState, set_debug

__all__ = ["app", "main"]

app = typer.Typer(
    name="bufreuse",
    help="Persistent buffer rings for MoE cross-stream buffers, and the tools that prove them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bufreuse {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks instead of one-line errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    ctx.obj = CliState(debug=debug)
    set_debug(debug)


for _module in (snapshot_report, snapshot_diff, what_if, sweep, compare, demo, check_config, bench):
    _module.register(app)


def main() -> None:
    """Console-script entry; ``--debug`` is accepted anywhere on the line."""
    argv = sys.argv[1:]
    if "--debug" in argv[1:]:
        argv = ["--debug", *[a for a in argv if a != "--debug"]]
    app(args=argv, prog_name="bufreuse")
