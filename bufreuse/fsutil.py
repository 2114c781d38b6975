"""Atomic file writes: a reader sees the old file or the whole new one, never half of it.

Every result the toolkit writes (metrics, manifests, reports, plots, compressed snapshots) goes
through here, so a run killed midway leaves no half-written file that a resume would take as
finished. Costs one ``fsync`` per file (milliseconds on a local disk, more on NFS/Lustre).

Files get the mode a plain ``open()`` would give (0644 under the usual umask 022; an existing
file keeps its mode), not the 0600 of the temporary file, so results can be shared on a cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from bufreuse.errors import InputError, OutputError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_writer",
    "current_umask",
    "read_json",
    "refuse_special_file",
    "special_kind",
]


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """Yield a binary file that becomes ``path`` when the block ends without an error.

    The data goes to a temporary file in the same folder, is flushed to disk and renamed over
    ``path``; on any error (or interrupt) the temporary file is removed and ``path`` is untouched.
    A folder that cannot be created or written raises :class:`~bufreuse.errors.OutputError` (exit 2).
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path}: is a folder; give a file name to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise OutputError(f"{path}: cannot write here ({e.strerror or e}); choose another output path") from None
    try:
        os.fchmod(fd, _target_mode(path))
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        try:
            os.replace(tmp, path)
        except OSError as e:  # a folder appeared at ``path``, or the target is not writable
            raise OutputError(f"{path}: cannot write here ({e.strerror or e}); choose another output path") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _target_mode(path: Path) -> int:
    """The existing file's permission bits, else what ``open(path, "w")`` would create (0666 minus umask)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return 0o666 & ~current_umask()


def current_umask() -> int:
    """This process's umask, read without changing it where the OS allows (Linux: /proc/self/status)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, hence the fallback only)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (:func:`atomic_writer`); returns the path."""
    with atomic_writer(path) as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented JSON (NaN refused: JSON readers elsewhere reject it)."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


_SPECIAL = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is if it is a FIFO, device or socket (links followed), else None (also if missing).

    Uses ``stat``, which never blocks, where ``open`` of a FIFO waits for a writer forever.
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return next((kind for test, kind in _SPECIAL if test(mode)), None)


def refuse_special_file(
    path: str | os.PathLike[str], *, error: type[InputError] = InputError, what: str = "a regular file"
) -> None:
    """Raise ``error`` if ``path`` is a FIFO, device or socket: call before opening anything to read."""
    kind = special_kind(path)
    if kind is not None:
        raise error(f"{path}: {kind}, not {what}; give a regular file")


def read_json(path: str | os.PathLike[str], *, max_bytes: int = 256 << 20) -> Any:
    """A JSON file's object; a FIFO/device/socket or a file over ``max_bytes`` raises InputError first."""
    refuse_special_file(path, what="a JSON file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise InputError(f"{path}: {size:,} bytes, over {max_bytes:,}; not a result file of this toolkit")
        data = f.read()  # grows with the file: no buffer of the limit's size
    return json.loads(data)
