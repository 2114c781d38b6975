"""What the snapshot loader reads from :class:`bufreuse.limits.Limits`, and the memory cap it loads under.

A snapshot file is untrusted input: a few kilobytes of pickle can declare a gigabyte string, grow
the unpickler's memo table to gigabytes, or repeat one shared trace entry thirty million times.
Its budgets are fields of the project's one :class:`~bufreuse.limits.Limits` (``max_file_bytes``,
``max_pickle_bytes``, ``max_trace_entries``, ``max_blocks``, ``max_memory_bytes``), with defaults
that admit the largest real snapshots (torch's ``_dump_snapshot`` of a 5M-entry trace), raised
by ``--limit NAME=N`` or by
``snapshot-report``'s shorthand flags (:data:`SHORTHANDS`). Past one the loader raises
:class:`SnapshotBudgetError`: a :class:`~bufreuse.limits.BudgetExceededError` and a
:class:`~bufreuse.errors.SnapshotFormatError` both (a refused budget is a refused snapshot).

The C unpickler has no per-opcode hook (and a Python one would cost minutes on a 4 GB file), so
objects and memo entries are bounded by memory rather than counted: while a file loads, is
normalised and is analysed (all the work on it, not only the unpickling), :func:`memory_limit`
lowers the process's data-segment limit (``RLIMIT_DATA``, Linux) to what the process uses now plus
the memory budget (``max_memory_bytes``, not scaled by the file's size), turning any allocation bomb into a
``MemoryError`` that the loader reports as that budget. The limit is restored on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

from bufreuse import limits as _limits
from bufreuse.errors import SnapshotFormatError
from bufreuse.limits import Limits

__all__ = [
    "GZIP_EXPANSION",
    "SHORTHANDS",
    "SnapshotBudgetError",
    "check",
    "memory_for",
    "memory_limit",
    "pickle_bytes_for",
]

_GiB = 1 << 30
GZIP_EXPANSION = 200
"""Decompressed bytes per compressed byte a gzip snapshot may reach unless ``max_pickle_bytes`` is set."""

SHORTHANDS: dict[str, str] = {
    "max_file_bytes": "--max-file-bytes",
    "max_pickle_bytes": "--max-pickle-bytes",
    "max_trace_entries": "--max-trace-entries",
    "max_blocks": "--max-blocks",
    "max_memory_bytes": "--max-memory-bytes",
}
"""Limits field -> ``snapshot-report``'s shorthand flag that sets it (``--limit NAME=N`` works everywhere)."""


class SnapshotBudgetError(_limits.BudgetExceededError, SnapshotFormatError):
    """A snapshot needs more than a budget allows: a budget error and a refused snapshot both."""

    SHORTHANDS: ClassVar[dict[str, str]] = SHORTHANDS


def check(budget: str, value: int, *, what: str, limits: Limits) -> None:
    """:func:`bufreuse.limits.check`, raising :class:`SnapshotBudgetError`."""
    _limits.check(budget, value, what=what, limits=limits, error=SnapshotBudgetError)


def pickle_bytes_for(limits: Limits, file_bytes: int) -> int:
    """The decompressed-bytes budget for a gzip file of ``file_bytes`` (``max_pickle_bytes``, or auto)."""
    if limits.max_pickle_bytes is not None:
        return limits.max_pickle_bytes
    return min(64 * _GiB, GZIP_EXPANSION * file_bytes + (64 << 20))


def memory_for(limits: Limits) -> int:
    """The memory one snapshot may add: ``max_memory_bytes``, whatever the file's size.

    Not scaled by the file: a big string planted in a file within the size budget can cost several
    times its bytes once loaded (one wide character makes a string four bytes per character).
    """
    return limits.max_memory_bytes


def _data_in_use() -> int | None:
    """Bytes of the process's data segment now (``VmData``), or None off Linux."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextlib.contextmanager
def memory_limit(extra_bytes: int) -> Iterator[None]:
    """Cap the data segment at its current size plus ``extra_bytes`` while the block runs.

    Allocations past the cap fail with ``MemoryError`` instead of growing the process; a cap that
    is already lower (set by the user or a batch scheduler) is kept. Does nothing where
    ``RLIMIT_DATA`` or ``/proc`` is missing.
    """
    try:
        import resource
    except ImportError:  # not POSIX
        yield
        return
    in_use = _data_in_use()
    if in_use is None or not hasattr(resource, "RLIMIT_DATA"):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    want = in_use + extra_bytes
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY and soft <= want:
        yield
        return
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (want, hard))
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
