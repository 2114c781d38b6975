"""Checks for values read from an untrusted snapshot, and a description of a bad value that is always short.

A hostile file can hold an int of a million digits (``str()`` refuses it), a list nested a million
deep (``repr()`` recurses) or a gigabyte string; error messages must name such a value without
building its text, so :func:`short` never recurses and never prints more than a few dozen characters.
"""

from __future__ import annotations

from typing import Any

from bufreuse.errors import SnapshotFormatError

__all__ = ["MAX_DEVICES", "MAX_FRAMES", "MAX_TEXT", "U64", "check_uint", "clean_text", "short"]

U64 = 1 << 64
"""Sizes, addresses, streams and pool ids are unsigned 64-bit values in the allocator."""
MAX_DEVICES = 1024
"""Device indexes a snapshot may use (CUDA exposes far fewer per process)."""
MAX_FRAMES = 512
"""Frames of one stack read for its site and category (torch stacks are tens deep)."""
MAX_TEXT = 300
"""Characters of a frame's file or function name kept for a site (longer ones are cut)."""

_SHOWN = 40


def short(v: Any) -> str:
    """A description of ``v`` of at most ~80 characters, without recursion or ``str`` of big ints."""
    if v is None or isinstance(v, bool | float):
        return repr(v)
    if isinstance(v, int):
        return repr(v) if v.bit_length() <= 128 else f"an int of {v.bit_length():,} bits"
    if isinstance(v, str | bytes | bytearray):
        cut = v[:_SHOWN]
        more = f"… ({len(v):,} long)" if len(v) > _SHOWN else ""
        return repr(cut) + more
    if isinstance(v, list | tuple | dict | set | frozenset):
        return f"a {type(v).__name__} of {len(v):,} items"
    return f"a {type(v).__name__}"


def check_uint(v: Any, where: str, path: str, *, bound: int = U64) -> int:
    """``v`` if it is an int in ``0 <= v < bound``, else a ``SnapshotFormatError`` naming ``where``."""
    if type(v) is not int or not 0 <= v < bound:
        limit = "2^64" if bound == U64 else f"{bound:,}"
        raise SnapshotFormatError(f"{path}: {where} is {short(v)}, expected an int in [0, {limit})")
    return v


def clean_text(v: Any, default: str = "?") -> str:
    """A frame's string field for display: the string cut to ``MAX_TEXT`` characters, or ``default``."""
    if type(v) is not str:
        return default
    return v if len(v) <= MAX_TEXT else v[: MAX_TEXT - 1] + "…"
