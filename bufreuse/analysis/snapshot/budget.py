"""Resource budgets for reading a snapshot someone else wrote: bytes, entries, blocks and memory.

A snapshot file is untrusted input: a few kilobytes of pickle can declare a gigabyte string, grow
the unpickler's memo table to gigabytes, or repeat one shared trace entry thirty million times.
Each budget here is named, has a default that admits the largest real snapshots (torch's
``_dump_snapshot`` of a 5M-entry trace, a 4 GB file), and is raised by one CLI flag; past a budget
the loader raises :class:`BudgetExceededError` naming the budget, the figure and the flag.

The C unpickler has no per-opcode hook (and a Python one would cost minutes on a 4 GB file), so
objects and memo entries are bounded by memory rather than counted: while a file loads and is
analysed, :func:`memory_limit` lowers the process's data-segment limit (``RLIMIT_DATA``, Linux) to
what the process uses now plus the memory budget, turning any allocation bomb into a
``MemoryError`` that the loader reports as this budget. The limit is restored on exit.

Designed to fold into ``bufreuse.limits``: the same shape (named budgets with defaults, each
with the flag that raises it) and an error subclassing :class:`bufreuse.errors.InputError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields

from bufreuse.errors import InputError, SnapshotFormatError

__all__ = ["BUDGET_FLAGS", "GZIP_EXPANSION", "BudgetExceededError", "SnapshotBudget", "memory_limit"]

_GiB = 1 << 30
GZIP_EXPANSION = 200
"""Decompressed bytes per compressed byte a gzip snapshot may reach unless ``--max-pickle-bytes`` says."""

BUDGET_FLAGS: dict[str, str] = {
    "max_file_bytes": "--max-file-bytes",
    "max_pickle_bytes": "--max-pickle-bytes",
    "max_trace_entries": "--max-trace-entries",
    "max_blocks": "--max-blocks",
    "max_memory_bytes": "--max-memory-bytes",
}
"""Budget field -> the CLI flag that raises it (``snapshot-report``)."""


class BudgetExceededError(SnapshotFormatError):
    """An input needs more than a budget allows; the message names the budget, the figure and the flag.

    Pickles across processes (the batch's workers send it back), so its fields are rebuilt from args.
    """

    def __init__(self, budget: str, *, got: int | str, limit: int, where: str = "", flag: str | None = None) -> None:
        self.budget = budget
        self.got = got
        self.limit = limit
        self.where = where
        self.flag = flag or BUDGET_FLAGS.get(budget, f"--{budget.replace('_', '-')}")
        prefix = f"{where}: " if where else ""
        super().__init__(
            f"{prefix}over the {budget} budget ({got} > {limit:,}); raise it with {self.flag} if the file is trusted"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (self.budget, self.got, self.limit, self.where, self.flag))


def _rebuild(budget: str, got: int | str, limit: int, where: str, flag: str) -> BudgetExceededError:
    return BudgetExceededError(budget, got=got, limit=limit, where=where, flag=flag)


@dataclass(kw_only=True, slots=True, frozen=True)
class SnapshotBudget:
    """How much one snapshot file may cost to read; every field is raised by its flag in ``BUDGET_FLAGS``."""

    max_file_bytes: int = 4 * _GiB
    """Bytes of the file on disk (``--max-file-bytes``)."""
    max_pickle_bytes: int | None = None
    """Bytes of pickle after gzip decompression (``--max-pickle-bytes``): stops gzip bombs. None:
    ``GZIP_EXPANSION`` times the file plus 64 MiB (real snapshots compress 5-30x), at most 64 GiB."""
    max_trace_entries: int = 8_000_000
    """Trace entries over all devices (``--max-trace-entries``); 5M-entry recordings fit."""
    max_blocks: int = 2_000_000
    """Segments plus blocks in the final state (``--max-blocks``)."""
    max_memory_bytes: int = 1536 << 20
    """Memory the load and the analysis may add (``--max-memory-bytes``); the floor for any file."""
    memory_per_file_byte: int = 40
    """Memory allowed per byte of (decompressed) file above the floor: big real files need it."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "max_pickle_bytes":
                continue
            if type(v) is not int or v <= 0:
                flag = BUDGET_FLAGS.get(f.name, f.name)
                raise InputError(f"{flag} must be a positive integer, got {v!r}")

    def pickle_bytes_for(self, file_bytes: int) -> int:
        """The decompressed-bytes budget for a gzip file of ``file_bytes``."""
        if self.max_pickle_bytes is not None:
            return self.max_pickle_bytes
        return min(64 * _GiB, GZIP_EXPANSION * file_bytes + (64 << 20))

    def memory_for(self, file_bytes: int) -> int:
        """The memory budget for a file of ``file_bytes``: the floor, or more for big files."""
        return max(self.max_memory_bytes, self.memory_per_file_byte * file_bytes)

    def check(self, budget: str, got: int, *, where: str = "") -> None:
        """Raise :class:`BudgetExceededError` when ``got`` is over the budget field ``budget``."""
        limit = getattr(self, budget)
        if got > limit:
            raise BudgetExceededError(budget, got=f"{got:,}", limit=limit, where=where)


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
