"""What every command shares: the error boundary, the debug switch and the consoles."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console

from bufreuse.errors import BufreuseError, exit_code_for

__all__ = [
    "CliState",
    "TickFn",
    "console",
    "err_console",
    "handle_errors",
    "is_debug",
    "json_option",
    "progress_bar",
    "root_option",
    "set_debug",
    "write_figures",
]

F = TypeVar("F", bound=Callable[..., Any])
TickFn = Callable[[int, int], None]
"""``tick(done, total)``: what :func:`progress_bar` yields."""

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


@dataclass(kw_only=True, slots=True)
class CliState:
    debug: bool = False
    """Show tracebacks instead of one-line errors (``--debug`` or ``BUFREUSE_CLI_DEBUG=1``)."""


# Set by the root callback on every invocation (so CliRunner tests never inherit a stale value).
_debug: contextvars.ContextVar[bool] = contextvars.ContextVar("bufreuse_cli_debug", default=False)


def set_debug(value: bool) -> None:
    _debug.set(value)


def is_debug() -> bool:
    """``--debug`` was given, or ``BUFREUSE_CLI_DEBUG`` is set to something other than 0."""
    return _debug.get() or os.environ.get("BUFREUSE_CLI_DEBUG", "") not in ("", "0")


def handle_errors(fn: F) -> F:
    """Turn library errors into one line on stderr and the error's exit code (no traceback).

    ``BufreuseError`` subclasses choose the code (2 bad input, 1 failed check); anything
    unexpected exits 1 with a hint to rerun with ``--debug``, which re-raises instead.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except BufreuseError as e:
            if is_debug():
                raise
            err_console.print(f"[bold red]error:[/] {_one_line(e)}", soft_wrap=True)
            raise typer.Exit(exit_code_for(e)) from None
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None
        except Exception as e:
            if is_debug():
                raise
            err_console.print(
                f"[bold red]internal error:[/] {type(e).__name__}: {_one_line(e)} "
                "(rerun with --debug for the traceback)",
                soft_wrap=True,
            )
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def _one_line(e: BaseException) -> str:
    """The message on one line, rich markup escaped (messages quote file names and file contents)."""
    from rich.markup import escape

    return escape(" ".join(str(e).split()) or type(e).__name__)


def json_option(what: str = "the result") -> Any:
    """The ``--json`` flag every command has: print ``what`` as JSON for scripts instead of a table."""
    return typer.Option("--json", help=f"Print {what} as JSON instead of a table.")


def root_option(purpose: str = "Folder of sweeps") -> Any:
    """The ``--root`` option: where sweeps live (``bufreuse.sweepdir.sweeps_root`` resolves None)."""
    return typer.Option(help=f"{purpose} (default $BUFREUSE_SWEEPS or ./bufreuse-sweeps).")


@contextlib.contextmanager
def progress_bar(label: str, *, unit: str = "items", refresh_thread: bool = True) -> Iterator[TickFn]:
    """Show a transient rich progress bar on stderr while the block runs; yield ``tick(done, total)``.

    ``unit`` is ``"items"`` (shows 3/10) or ``"bytes"`` (shows 1.2/4.0 GB). Off a terminal nothing
    is drawn and ``tick`` costs one call. ``refresh_thread=False`` redraws only on ``tick`` (no
    thread: required when the block forks worker processes, since fork with threads can deadlock).
    """
    if not err_console.is_terminal:
        yield lambda done, total: None
        return
    from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    bar = Progress(
        TextColumn(label), BarColumn(), count, TimeElapsedColumn(),
        console=err_console, transient=True, auto_refresh=refresh_thread,
    )  # fmt: skip
    task = bar.add_task(label, total=None)

    def tick(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)
        if not refresh_thread:
            bar.refresh()

    with bar:
        yield tick


def write_figures(folder: str | os.PathLike[str], figures: Mapping[str, Any]) -> list[Path]:
    """Write ``{file name: matplotlib Figure}`` as PNGs into ``folder`` (atomically); returns the paths."""
    from bufreuse.analysis.render.export import png_bytes
    from bufreuse.fsutil import atomic_write_bytes

    return [atomic_write_bytes(Path(folder) / name, png_bytes(fig)) for name, fig in figures.items()]
