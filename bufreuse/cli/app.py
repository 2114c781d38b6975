"""The Typer app; each command lives in its own module and registers itself here."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from bufreuse import __version__
from bufreuse.cli import (
    advise,
    bench,
    check_config,
    compare,
    demo,
    plan,
    snapshot_diff,
    snapshot_report,
    sweep,
    what_if,
)
from bufreuse.cli._common import BoundaryGroup, CliState, set_debug

__all__ = ["app", "main"]

app = typer.Typer(
    name="bufreuse",
    help="Persistent buffer rings for MoE cross-stream buffers, and the tools that prove them.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    cls=BoundaryGroup,
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
        bool, typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    limit: Annotated[
        list[str] | None,
        typer.Option(
            "--limit",
            metavar="NAME=N",
            help="Raise a resource budget for this run (max-workers, max-hosts, max-trace-entries, max-dim, "
            "...; docs/facts.md lists them); repeatable. Also $BUFREUSE_LIMITS.",
        ),
    ] = None,
) -> None:
    from bufreuse import limits

    ctx.obj = CliState(debug=debug)
    set_debug(debug)
    if limit:
        ctx.with_resource(limits.override(**limits.parse_overrides(limit)))


for _module in (snapshot_report, snapshot_diff, what_if, advise, plan, sweep, compare, demo, check_config, bench):
    _module.register(app)


def main() -> None:
    """Console-script entry; ``--debug`` is accepted anywhere on the line."""
    argv = sys.argv[1:]
    if "--debug" in argv[1:]:
        argv = ["--debug", *[a for a in argv if a != "--debug"]]
    app(args=argv, prog_name="bufreuse")
