"""Load a pickle that may come from anywhere without running any of its code, within a budget.

A pickle can name any importable callable (``os.system``, say) and have the loader call it. The
:class:`SafeUnpickler` here is the C-accelerated ``pickle.Unpickler`` with ``find_class`` and
``persistent_load`` refusing everything, so only the opcodes that build plain containers and
scalars (dict, list, tuple, set, str, bytes, int, float, bool, None) can succeed. Allocator
snapshots written by ``torch.cuda.memory._dump_snapshot`` (torch 1.13 → 2.13) contain nothing
else: ``segment_pool_id`` and ``pool_id`` are plain tuples. ``find_class`` is only consulted for
globals, which plain data never names, so the restriction leaves the C loader's speed alone.

Plain data can still be hostile: a declared length beyond the end of the file, a gzip stream that
inflates a thousandfold, a memo index that makes the loader allocate gigabytes. The stream the
unpickler reads is metered (file bytes, decompressed bytes, reads past the end refused) and the
load runs under :func:`~.budget.memory_limit`, so each ends in a :class:`~.budget.SnapshotBudgetError`
(budgets: :class:`bufreuse.limits.Limits`) or a :class:`SnapshotFormatError`, never in a swapping machine.

Plain and gzip files are told apart by their first two bytes, not by the file name.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bufreuse.analysis.snapshot.budget import SnapshotBudgetError, check, memory_for, memory_limit, pickle_bytes_for
from bufreuse.errors import SnapshotFormatError
from bufreuse.fsutil import refuse_special_file
from bufreuse.limits import Limits, current

__all__ = ["GZIP_MAGIC", "RefusedGlobalError", "SafeUnpickler", "load_pickle_file", "loads_restricted"]

GZIP_MAGIC = b"\x1f\x8b"
_PROGRESS_STEP = 4 << 20  # report progress every 4 MiB read

ProgressFn = Callable[[int, int], None]
"""Called as ``progress(bytes_read, total_bytes)`` while a file loads."""


class RefusedGlobalError(SnapshotFormatError, pickle.UnpicklingError):
    """The pickle named a global (class or function); plain snapshot data never does (a refused snapshot)."""


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that refuses every global and persistent id (never runs code)."""

    def find_class(self, module: str, name: str) -> Any:
        raise RefusedGlobalError(
            f"refused to load global {str(module)[:60]}.{str(name)[:60]}: "
            "a snapshot holds only plain containers and scalars"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedGlobalError("refused a persistent id: a snapshot holds only plain data")


def loads_restricted(data: bytes, *, limits: Limits | None = None) -> Any:
    """Unpickle ``data`` (plain or gzip) with :class:`SafeUnpickler`; raises ``pickle``/``OSError`` errors."""
    limits = limits or current()
    src: Any = io.BytesIO(data)
    if data[:2] == GZIP_MAGIC:
        src = gzip.GzipFile(fileobj=src, mode="rb")
        src = _MeteredStream(src, limit=pickle_bytes_for(limits, len(data)), end=None, where="<bytes>")
    return SafeUnpickler(src).load()


class _CountingReader(io.RawIOBase):
    """Raw reader over a file that reports bytes read; the buffered layer above gives ``peek``."""

    def __init__(self, f: io.BufferedReader, total: int, progress: ProgressFn) -> None:
        self._f = f
        self._total = total
        self._progress = progress
        self._done = 0
        self._next = _PROGRESS_STEP

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        self._done += n
        if self._done >= self._next:
            self._next = self._done + _PROGRESS_STEP
            self._progress(self._done, self._total)
        return n


class _MeteredStream:
    """What the unpickler reads: counts bytes handed out, refuses reads past ``end`` or ``limit``.

    ``end`` is the stream's length when known (a plain file): a read of more than what is left is a
    declared length beyond the file, refused before anything is allocated. ``limit`` bounds the
    bytes of a decompressed stream (``max_pickle_bytes`` and the expansion ratio).
    """

    def __init__(self, f: Any, *, limit: int, end: int | None, where: str) -> None:
        self._f = f
        self._limit = limit
        self._end = end
        self._where = where
        self._done = 0

    def _admit(self, n: int) -> None:
        if self._end is not None and n > self._end - self._done and n > _PROGRESS_STEP:
            raise SnapshotFormatError(
                f"{self._where}: the pickle declares {n:,} bytes at offset {self._done:,}, "
                f"beyond the end of the file ({self._end:,} bytes)"
            )
        if self._done + min(n, 1 << 62) > self._limit + _PROGRESS_STEP and n > 0:
            self._over(self._done + n)

    def _over(self, got: int) -> None:
        raise SnapshotBudgetError(
            "max_pickle_bytes", value=got, limit=self._limit, what=f"{self._where}: decompressed bytes"
        )

    def _count(self, k: int) -> None:
        self._done += k
        if self._done > self._limit:
            self._over(self._done)

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = max(self._limit - self._done, 0) + 1
        self._admit(n)
        data = self._f.read(n)
        self._count(len(data))
        return data

    def readinto(self, b: Any) -> int:
        self._admit(len(b))
        k = self._f.readinto(b)
        self._count(k)
        return k

    def readline(self, size: int = -1) -> bytes:
        data = self._f.readline(_PROGRESS_STEP if size is None or size < 0 else min(size, _PROGRESS_STEP))
        self._count(len(data))
        return data

    def peek(self, n: int = 0) -> bytes:
        return self._f.peek(n) if hasattr(self._f, "peek") else b""


def load_pickle_file(
    path: str | os.PathLike[str], *, progress: ProgressFn | None = None, limits: Limits | None = None
) -> Any:
    """Load a plain or gzip pickle file with :class:`SafeUnpickler`, within ``limits`` (default: in force).

    The object graph is built straight from the (buffered) file, so peak memory is the loaded data
    plus one read buffer; ``progress`` is called every few MiB of the file read.

    Raises:
        SnapshotFormatError: a missing or empty file, a truncated gzip stream, bytes that are not a
            pickle, a declared length beyond the file, or a pickle that names a global.
        SnapshotBudgetError: the file, its decompressed stream or the memory it needs is over
            ``limits`` (the message names the budget and the flags that raise it).
    """
    limits = limits or current()
    path = Path(path)
    refuse_special_file(path, error=SnapshotFormatError, what="an allocator snapshot")
    try:
        total = path.stat().st_size
        raw = open(path, "rb")  # noqa: SIM115 - closed below, wrapped in several layers
    except OSError as e:
        raise SnapshotFormatError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None
    try:
        if total == 0:
            raise SnapshotFormatError(f"{path}: empty file, not an allocator snapshot")
        check("max_file_bytes", total, what=f"{path}: file bytes", limits=limits)
        magic = raw.peek(2)[:2]
        src: Any = raw
        if progress is not None:
            src = io.BufferedReader(_CountingReader(raw, total, progress), buffer_size=1 << 20)
        if magic == GZIP_MAGIC:
            src = gzip.GzipFile(fileobj=src, mode="rb")
            src = _MeteredStream(src, limit=pickle_bytes_for(limits, total), end=None, where=str(path))
        else:
            src = _MeteredStream(src, limit=total, end=total, where=str(path))
        memory = memory_for(limits)
        try:
            with memory_limit(memory):
                obj = SafeUnpickler(src).load()
                trailing = magic == GZIP_MAGIC and src.read(1)
            if trailing:
                raise SnapshotFormatError(f"{path}: trailing data after the pickle in the gzip stream")
        except RefusedGlobalError as e:
            raise SnapshotFormatError(f"{path}: {e}") from None
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            kind = "truncated or corrupt gzip stream" if magic == GZIP_MAGIC else "truncated pickle"
            raise SnapshotFormatError(f"{path}: {kind} ({type(e).__name__}: {_msg(e) or 'ended early'})") from None
        except SnapshotFormatError:  # budget errors included
            raise
        except MemoryError:
            raise SnapshotBudgetError(
                "max_memory_bytes", value="needs more memory", limit=memory, what=f"{path}: loading the pickle"
            ) from None
        except RecursionError:
            raise SnapshotFormatError(f"{path}: pickle nested too deep to load") from None
        except Exception as e:  # random bytes raise anything from UnpicklingError to KeyError
            raise SnapshotFormatError(f"{path}: not a pickle ({type(e).__name__}: {_msg(e)})") from None
        if progress is not None:
            progress(total, total)
        return obj
    finally:
        raw.close()


def _msg(e: BaseException) -> str:
    """An exception's message on one line, cut short (random bytes make odd ones)."""
    text = " ".join(str(e).split())
    return text if len(text) <= 120 else text[:119] + "…"
