"""Option values checked where they are parsed, so no bad value reaches a library call.

Typer callbacks (``callback=finite(...)``) turn a bad value into a usage error (one ``error:`` line,
exit 2) before the command body runs; the ``check_*`` helpers do the same for checks that need more
than one option (an output path and ``--mkdir``). Shape bounds come from :mod:`bufreuse.limits`.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import typer

from bufreuse import limits
from bufreuse.errors import InputError, OutputError

__all__ = [
    "TEXT_FILE_MAX_BYTES",
    "check_output_dir",
    "check_output_file",
    "check_sweeps_root",
    "dim",
    "finite",
    "text_file",
    "text_file_or",
]

TEXT_FILE_MAX_BYTES = 1 * 2**20
"""Largest site file or template read (1 MiB: these are a few hundred bytes)."""


def finite(*, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Callable[[Any], Any]:
    """A callback accepting finite floats in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); None passes."""

    def callback(value: float | None) -> float | None:
        if value is None:
            return None
        if not math.isfinite(value):
            raise typer.BadParameter(f"{value}: give a finite number")
        if lo is not None and (value <= lo if lo_open else value < lo):
            raise typer.BadParameter(f"{value}: must be {'>' if lo_open else '>='} {lo:g}")
        if hi is not None and value > hi:
            raise typer.BadParameter(f"{value}: must be <= {hi:g}")
        return value

    return callback


def dim(param: typer.CallbackParam, value: int | None) -> int | None:
    """A callback bounding a shape option (tokens, hidden, sequence length) by the ``max_dim`` budget."""
    if value is not None:
        limits.check("max_dim", value, what=(param.opts or [str(param.name)])[0])
    return value


def text_file(value: str | Path | None) -> str | Path | None:
    """A callback accepting a readable UTF-8 text file of at most :data:`TEXT_FILE_MAX_BYTES`."""
    if value is not None:
        _check_text_file(Path(value))
    return value


def text_file_or(names: Iterable[str]) -> Callable[[Any], Any]:
    """Like :func:`text_file`, but one of ``names`` (a builtin template name) passes as it is."""
    allowed = frozenset(names)

    def callback(value: str | None) -> str | None:
        if value is not None and value not in allowed:
            if not Path(value).exists():
                choices = ", ".join(sorted(allowed))
                raise typer.BadParameter(f"{value}: no such file; use a file path or one of {choices}")
            _check_text_file(Path(value))
        return value

    return callback


def _check_text_file(path: Path) -> None:
    if not path.exists():
        raise typer.BadParameter(f"{path}: no such file")
    if not path.is_file():
        raise typer.BadParameter(f"{path}: not a regular file")
    try:
        size = path.stat().st_size
        if size > TEXT_FILE_MAX_BYTES:
            raise typer.BadParameter(f"{path}: {size:,} bytes; a text file of at most {TEXT_FILE_MAX_BYTES:,} expected")
        data = path.read_bytes()
    except OSError as e:
        raise typer.BadParameter(f"{path}: cannot read ({e.strerror or e})") from None
    if b"\0" in data:
        raise typer.BadParameter(f"{path}: a binary file; a UTF-8 text file expected")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise typer.BadParameter(f"{path}: not UTF-8 text (byte {e.start}); a UTF-8 text file expected") from None


def check_sweeps_root(root: str | None, *, option: str = "--root", mkdir: bool = True) -> None:
    """Raise InputError unless ``root`` is (or can be created as) a folder this process can write.

    The root itself may be created; its missing parent folders only with ``mkdir`` (``--mkdir``).
    Probes with a real temporary folder, because permission bits lie for root and for ``/proc``.
    Creates nothing that stays.
    """
    if root is None:
        return
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise InputError(f"{option} {root}: is a file; give a folder for the sweeps")
    probe = path
    while not probe.exists() and not probe.is_symlink():
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(f"{option} {root}: {probe} is a file; give a folder for the sweeps")
    if not mkdir and probe != path and probe != path.parent:
        raise InputError(f"{option} {root}: folder {path.parent} does not exist; create it or pass --mkdir")
    try:
        made = tempfile.mkdtemp(prefix=".bufreuse-probe-", dir=probe)
    except OSError as e:
        raise InputError(f"{option} {root}: cannot create folders in {probe} ({e.strerror or e})") from None
    with contextlib.suppress(OSError):
        os.rmdir(made)


def check_output_file(path: Path | None, *, suffixes: tuple[str, ...], mkdir: bool, option: str) -> None:
    """Raise InputError unless ``path`` ends in one of ``suffixes`` and its folder exists (or ``mkdir``).

    With ``mkdir`` the missing folders must be creatable (checked now, so a refused write happens before
    the work); the writer creates them with the result, so a refused command leaves none behind.
    """
    if path is None:
        return
    if path.suffix.lower() not in suffixes:
        raise InputError(f"{option} {path}: the file name must end in {' or '.join(suffixes)} (the format written)")
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a folder; give a file name to write")
    _check_parent(path.parent, mkdir=mkdir, option=f"{option} {path}")


def check_output_dir(path: Path | None, *, mkdir: bool, option: str) -> None:
    """Raise InputError unless ``path`` is a folder, or can be made one in an existing folder (or ``mkdir``)."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise OutputError(f"{option} {path}: is a file, cannot write here; give a folder")
    if not path.exists():
        _check_parent(path.parent, mkdir=mkdir, option=f"{option} {path}")


def _check_parent(parent: Path, *, mkdir: bool, option: str) -> None:
    if parent.is_dir():
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutputError(f"{option}: cannot write in {parent} (permission denied)")
        return
    if parent.exists():
        raise OutputError(f"{option}: {parent} is a file, not a folder")
    if not mkdir:
        raise OutputError(f"{option}: folder {parent} does not exist; create it or pass --mkdir")
    probe = parent  # nothing is created now: the writer makes the folders once there is a result to write
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"{option}: cannot create {parent} ({probe} is a file)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{option}: cannot create {parent} (permission denied in {probe})")
