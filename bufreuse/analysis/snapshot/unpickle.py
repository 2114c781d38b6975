"""Load a pickle that may come from anywhere without running any of its code.

A pickle can name any importable callable (``os.system``, say) and have the loader call it. The
:class:`SafeUnpickler` here is the C-accelerated ``pickle.Unpickler`` with ``find_class`` and
``persistent_load`` refusing everything, so only the opcodes that build plain containers and
scalars (dict, list, tuple, set, str, bytes, int, float, bool, None) can succeed. Allocator
snapshots written by ``torch.cuda.memory._dump_snapshot`` (torch 1.13 → 2.13) contain nothing
else: ``segment_pool_id`` and ``pool_id`` are plain tuples. ``find_class`` is only consulted for
globals, which plain data never names, so the restriction leaves the C loader's speed alone.

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

from bufreuse.errors import SnapshotFormatError

__all__ = ["GZIP_MAGIC", "RefusedGlobalError", "SafeUnpickler", "load_pickle_file", "loads_restricted"]

GZIP_MAGIC = b"\x1f\x8b"
_PROGRESS_STEP = 4 << 20  # report progress every 4 MiB read

ProgressFn = Callable[[int, int], None]
"""Called as ``progress(bytes_read, total_bytes)`` while a file loads."""


class RefusedGlobalError(pickle.UnpicklingError):
    """The pickle named a global (class or function); plain snapshot data never does."""


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that refuses every global and persistent id (never runs code)."""

    def find_class(self, module: str, name: str) -> Any:
        raise RefusedGlobalError(
            f"refused to load global {module}.{name}: a snapshot holds only plain containers and scalars"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedGlobalError(f"refused persistent id {pid!r}: a snapshot holds only plain data")


def loads_restricted(data: bytes) -> Any:
    """Unpickle ``data`` (plain or gzip) with :class:`SafeUnpickler`; raises ``pickle``/``OSError`` errors."""
    if data[:2] == GZIP_MAGIC:
        data = gzip.decompress(data)
    return SafeUnpickler(io.BytesIO(data)).load()


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


def load_pickle_file(path: str | os.PathLike[str], *, progress: ProgressFn | None = None) -> Any:
    """Load a plain or gzip pickle file with :class:`SafeUnpickler`.

    Raises :class:`SnapshotFormatError` naming the file for anything unreadable: a missing or empty
    file, a truncated gzip stream, bytes that are not a pickle, or a pickle that names a global.
    The object graph is built straight from the (buffered) file, so peak memory is the loaded data
    plus one read buffer; ``progress`` is called every few MiB of the file read.
    """
    path = Path(path)
    try:
        total = path.stat().st_size
        raw = open(path, "rb")  # noqa: SIM115 - closed below, wrapped in several layers
    except OSError as e:
        raise SnapshotFormatError(f"{path}: cannot read ({e.strerror or e})") from e
    try:
        if total == 0:
            raise SnapshotFormatError(f"{path}: empty file, not an allocator snapshot")
        magic = raw.peek(2)[:2]
        src: Any = raw
        if progress is not None:
            src = io.BufferedReader(_CountingReader(raw, total, progress), buffer_size=1 << 20)
        if magic == GZIP_MAGIC:
            src = gzip.GzipFile(fileobj=src, mode="rb")
        try:
            obj = SafeUnpickler(src).load()
            if magic == GZIP_MAGIC and src.read(1):
                raise SnapshotFormatError(f"{path}: trailing data after the pickle in the gzip stream")
        except RefusedGlobalError as e:
            raise SnapshotFormatError(f"{path}: {e}") from e
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            kind = "truncated or corrupt gzip stream" if magic == GZIP_MAGIC else "truncated pickle"
            raise SnapshotFormatError(f"{path}: {kind} ({type(e).__name__}: {e or 'ended early'})") from e
        except SnapshotFormatError:
            raise
        except (RecursionError, MemoryError) as e:
            raise SnapshotFormatError(f"{path}: pickle too deep or too large to load ({type(e).__name__})") from e
        except Exception as e:  # random bytes raise anything from UnpicklingError to KeyError
            raise SnapshotFormatError(f"{path}: not a pickle ({type(e).__name__}: {e})") from e
        if progress is not None:
            progress(total, total)
        return obj
    finally:
        raw.close()
