"""What every command shares: the error boundary, the debug switch and the consoles.

The boundary is :class:`BoundaryGroup`, the root command's class: usage errors (unknown option, bad
integer, missing argument), project errors and anything unexpected leave it as one line on stderr and
an exit code, whichever command raised them. Every message is escaped before rich sees it, so a file
name like ``snap[red].pickle`` is printed as typed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from bufreuse.errors import BufreuseError, exit_code_for

try:  # typer >= 0.22 vendors click as typer._click; older ones depend on click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[no-redef]

__all__ = [
    "DEPRECATED_OPTIONS",
    "OFF_TTY_WIDTH",
    "BoundaryGroup",
    "CliState",
    "TickFn",
    "console",
    "err_console",
    "handle_errors",
    "is_debug",
    "json_option",
    "print_error",
    "progress_bar",
    "renew_options",
    "report_exception",
    "return_freed_memory",
    "root_option",
    "set_debug",
    "unknown_flags_text",
    "write_figures",
]

F = TypeVar("F", bound=Callable[..., Any])
TickFn = Callable[[int, int], None]
"""``tick(done, total)``: what :func:`progress_bar` yields."""

OFF_TTY_WIDTH = 200
"""Table width when output is not a terminal and ``$COLUMNS`` is unset (logs keep whole headers)."""


def _width(stream: Any) -> int | None:
    """None (rich decides: the terminal, or ``$COLUMNS``) on a terminal or with COLUMNS, else a wide default."""
    if os.environ.get("COLUMNS", "").strip().isdigit():
        return None
    try:
        return None if stream.isatty() else OFF_TTY_WIDTH
    except (AttributeError, ValueError):
        return OFF_TTY_WIDTH


console = Console(highlight=False, width=_width(sys.stdout))
err_console = Console(stderr=True, highlight=False, width=_width(sys.stderr))


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


def print_error(message: str, *, label: str = "error") -> None:
    """Print ``label: message`` as one line on stderr; ``message`` is escaped (no rich markup from users)."""
    err_console.print(f"[bold red]{label}:[/] {escape(_one_line(message))}", soft_wrap=True, highlight=False)


def return_freed_memory() -> None:
    """Make glibc serve every allocation of 128 KiB or more from its own mapping, for this process.

    glibc raises that threshold (up to 32 MiB) each time a mapped block is freed, after which big blocks
    come from the heap and stay resident once freed: ``compare`` frees a long log's columns before reading
    the next log, and two 3,000,000-iteration logs then peaked at 313 MB instead of 242 MB. Elsewhere
    (musl, macOS) nothing changes.
    """
    import contextlib
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed (no longer dynamic)


def unknown_flags_text(file: str | os.PathLike[str]) -> str:
    """One line naming an args file's flags that Megatron-LM would refuse, with a close match; "" when none."""
    import difflib
    from dataclasses import fields

    from bufreuse.config import BufReuseConfig, unknown_flags
    from bufreuse.megatron_flags import MEGATRON_CORE_VERSION, MEGATRON_FLAGS

    unknown = unknown_flags(file)
    if not unknown:
        return ""
    shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
    knobs = {f.name.replace("_", "-") for f in fields(BufReuseConfig)}
    close = next((m for u in unknown if (m := difflib.get_close_matches(u[2:], MEGATRON_FLAGS | knobs, n=1))), [])
    hint = f" (did you mean --{close[0]}?)" if close else ""
    return (
        f"{file}: {shown}: not Megatron-LM arguments (megatron-core {MEGATRON_CORE_VERSION}) nor bufreuse knobs; "
        f"Megatron would refuse them and nothing here reads them{hint}"
    )


def report_exception(e: BaseException) -> int:
    """Print ``e`` as one line on stderr and return its exit code (2 bad input, 1 failed check or bug)."""
    if isinstance(e, BufreuseError):
        print_error(str(e) or type(e).__name__)
        return exit_code_for(e)
    if isinstance(e, KeyboardInterrupt):
        err_console.print("[yellow]interrupted[/]")
        return 130
    print_error(f"{type(e).__name__}: {e} (rerun with --debug for the traceback)", label="internal error")
    return 1


def handle_errors(fn: F) -> F:
    """Turn library errors into one line on stderr and the error's exit code (no traceback).

    ``BufreuseError`` subclasses choose the code (2 bad input, 1 failed check); anything
    unexpected exits 1 with a hint to rerun with ``--debug``, which re-raises instead.
    :class:`BoundaryGroup` does the same for whatever escapes a command (option callbacks, usage).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except (KeyboardInterrupt, Exception) as e:
            if is_debug() and not isinstance(e, KeyboardInterrupt):
                raise
            raise typer.Exit(report_exception(e)) from None

    return wrapper  # type: ignore[return-value]


def _no_placeholder_for_flags(command: Any) -> None:
    """Show a pure flag (``--json``, ``--help``) without a value placeholder in help (Typer prints ``<bool>``).

    An empty metavar is what the help table prints for the type; parsing never reads it. Walks sub-groups too.
    """
    for param in command.params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    helper = command.get_help_option(command.context_class(command))
    if helper is not None:
        helper.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _no_placeholder_for_flags(sub)


DEPRECATED_OPTIONS: dict[tuple[str, ...], dict[str, str]] = {
    ("sweep",): {"--microbatches": "--num-microbatches"},
    ("bench", "layer"): {
        "--microbatches": "--num-microbatches", "--warmup": "--warmup-rounds", "--slots": "--ring-slots",
    },
    ("bench", "pool"): {"--slots": "--ring-slots", "--tokens": "--rows"},
}
"""Old option spellings still accepted, by command path: one name means one thing in every command (``--slots``
a list of slot counts, ``--warmup`` log iterations, ``--num-microbatches``), so these were renamed."""

_ROOT_VALUE_OPTIONS = frozenset({"--limit"})


def renew_options(group: Any, args: Sequence[str]) -> list[str]:
    """``args`` with every deprecated option of its command renamed, each with a warning on stderr."""
    out, i = list(args), 0
    while i < len(out) and out[i].startswith("-"):
        i += 2 if out[i] in _ROOT_VALUE_OPTIONS else 1
    path: list[str] = []
    command = group
    while i < len(out) and out[i] in (getattr(command, "commands", None) or {}):
        command = command.commands[out[i]]
        path.append(out[i])
        i += 1
    renamed = DEPRECATED_OPTIONS.get(tuple(path), {})
    for k in range(i, len(out) if renamed else i):
        if out[k] == "--":
            break
        name, eq, value = out[k].partition("=")
        if name in renamed:
            out[k] = renamed[name] + eq + value
            print_error(f"bufreuse {' '.join(path)} {name} is deprecated; use {renamed[name]}", label="warning")
    return out


class BoundaryGroup(TyperGroup):
    """The root command: usage errors as one ``error:`` line (exit 2), and a last boundary for the rest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _no_placeholder_for_flags(self)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        args = renew_options(self, sys.argv[1:] if args is None else args)
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as e:  # bare ``bufreuse`` or ``bufreuse bench``: the help, as Typer shows it
            from typer import rich_utils

            rich_utils.rich_format_error(e)
            sys.exit(e.exit_code)
        except ClickException as e:
            print_error(_usage_line(e))
            sys.exit(e.exit_code)
        except typer.Abort:
            print_error("aborted")
            sys.exit(1)
        except Exception as e:
            if is_debug():
                raise
            sys.exit(report_exception(e))
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


def _usage_line(e: ClickException) -> str:
    """``bufreuse sweep: No such option: --bogus; see bufreuse sweep --help``."""
    ctx = getattr(e, "ctx", None)
    if ctx is None:
        return e.format_message()
    return f"{ctx.command_path}: {e.format_message().rstrip('.')}; see '{ctx.command_path} --help'"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def json_option(what: str = "the result") -> Any:
    """The ``--json`` flag every command has: print ``what`` as JSON for scripts instead of a table."""
    return typer.Option("--json", help=f"Print {what} as JSON instead of a table.")


def torch_version_option() -> Any:
    """``--torch-version``: the torch the training run uses, for the EP >= 2 stream rule (default: installed)."""
    return typer.Option(
        "--torch-version",
        help="The training run's torch version (e.g. 2.7.1): NCCL before 2.8 records streams, so the EP >= 2 "
        "rule keeps rings it otherwise leaves unused. Default: the torch installed here (none: >= 2.8 assumed).",
    )


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


def write_figure(path: str | os.PathLike[str], fig: Any) -> Path:
    """Write one matplotlib Figure as a PNG to ``path`` (atomically); returns the path."""
    from bufreuse.analysis.render.export import png_bytes
    from bufreuse.fsutil import atomic_write_bytes

    return atomic_write_bytes(path, png_bytes(fig))


def write_figures(folder: str | os.PathLike[str], figures: Mapping[str, Any]) -> list[Path]:
    """Write ``{file name: matplotlib Figure}`` as PNGs into ``folder`` (atomically); returns the paths."""
    from bufreuse.analysis.render.export import png_bytes
    from bufreuse.fsutil import atomic_write_bytes

    return [atomic_write_bytes(Path(folder) / name, png_bytes(fig)) for name, fig in figures.items()]
