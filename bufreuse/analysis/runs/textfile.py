"""Read a training log that may be anything: binary junk, gzip, invalid UTF-8, one gigantic line, a FIFO.

The guard sits at file-open level, before any grammar sees the text. A FIFO, device or socket is
refused before it is opened (reading one would wait forever or never end). The file is read in
bounded pieces (:data:`CHUNK_BYTES`), never with a buffer of the budget's size: a gzip'd log is
inflated piece by piece within ``max_log_bytes``, and each piece is checked as it arrives, so a
binary file, a line longer than any real log line (``max_log_line_bytes``) or a number of a
thousand digits (no grammar can use one; ``int()`` of one past 4,300 digits raises) is refused
with one :class:`~bufreuse.errors.LogFormatError` as soon as it is seen. Undecodable bytes become
U+FFFD (a log cut mid-character by a killed job must still parse). :class:`LogLines` yields lines
one by one (the parser reads a log so), so a reader that keeps no per-line state needs memory
independent of the log's size.
"""

from __future__ import annotations

import codecs
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from bufreuse.errors import LogFormatError
from bufreuse.fsutil import refuse_special_file
from bufreuse.limits import BudgetExceededError, Limits, current

__all__ = [
    "CHUNK_BYTES",
    "MAX_DIGITS",
    "MAX_LINE_CHARS",
    "MAX_LOG_BYTES",
    "LogBudgetError",
    "LogLines",
    "check_log_text",
    "iter_log_lines",
    "read_log",
    "read_log_text",
]

MAX_LOG_BYTES = Limits().max_log_bytes
"""The default ``max_log_bytes`` budget (an alias; the one in force is ``bufreuse.limits.current()``)."""
MAX_LINE_CHARS = Limits().max_log_line_bytes
"""The default ``max_log_line_bytes`` budget (an alias, as above)."""
MAX_DIGITS = 1000
"""Digits in one number; Python refuses to parse ints past 4,300 and no log figure has 1,000."""
CHUNK_BYTES = 1 << 20
"""Bytes read (or inflated) at a time: the reader's working memory, whatever the budget."""
_HUGE_NUMBER = re.compile(rf"\d{{{MAX_DIGITS}}}")
_DIGITS = b"0123456789"
_DIGIT_MAP = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_DIGIT_RUN = b"0" * MAX_DIGITS
_SNIFF = 64 << 10
_GZIP_MAGIC = b"\x1f\x8b"
_LINE_ENDS = ("\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


class LogBudgetError(BudgetExceededError, LogFormatError):
    """A log over a budget: a budget error (names ``--limit``) and a refused log both."""


class _LogReader:
    """One pass over a log file: decoded, checked text pieces; ``warning`` says if a gzip stream was cut."""

    def __init__(self, path: Path, max_bytes: int | None) -> None:
        self.path = path
        self.limits = current()
        self.max_bytes = self.limits.max_log_bytes if max_bytes is None else max_bytes
        self.warning: str | None = None

    def pieces(self) -> Iterator[str]:
        p = self.path
        refuse_special_file(p, error=LogFormatError, what="a log file")
        try:
            f = open(p, "rb")  # noqa: SIM115 - closed in the finally below (a generator)
        except FileNotFoundError:
            raise LogFormatError(f"{p}: no such log file") from None
        except IsADirectoryError:
            raise LogFormatError(f"{p}: a folder, not a log file") from None
        except OSError as e:
            raise LogFormatError(f"{p}: cannot read ({e.strerror or type(e).__name__})") from None
        try:
            try:
                magic = f.read(2)
                f.seek(0)
            except OSError as e:
                raise LogFormatError(f"{p}: cannot read ({e.strerror or type(e).__name__})") from None
            raw = self._gzip(f) if magic == _GZIP_MAGIC else self._plain(f)
            yield from self._checked(raw)
        finally:
            f.close()

    def _plain(self, f: BinaryIO) -> Iterator[bytes]:
        size = os.fstat(f.fileno()).st_size
        self._check_size(size, exact=True)
        done = 0
        while True:
            try:
                data = f.read(CHUNK_BYTES)
            except OSError as e:
                raise LogFormatError(f"{self.path}: cannot read ({e.strerror or type(e).__name__})") from None
            if not data:
                return
            done += len(data)
            self._check_size(done, exact=False)
            yield data

    def _check_size(self, size: int, *, exact: bool) -> None:
        if size > self.max_bytes:
            value: int | str = size if exact else f"more than {self.max_bytes:,}"
            raise LogBudgetError("max_log_bytes", value=value, limit=self.max_bytes, what=f"{self.path}: bytes")

    def _gzip(self, f: BinaryIO) -> Iterator[bytes]:
        """Inflate every gzip member in turn, ``CHUNK_BYTES`` at a time; a cut or corrupt tail is a warning."""
        p, size, buf = self.path, 0, b""
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        while True:
            if not buf:
                try:
                    buf = f.read(CHUNK_BYTES)
                except OSError as e:
                    raise LogFormatError(f"{p}: cannot read ({e.strerror or type(e).__name__})") from None
                if not buf:
                    if not d.eof:
                        if not size:
                            raise LogFormatError(f"{p}: corrupt gzip stream (it ends before any data)")
                        self.warning = f"gzip stream ends early (a cut file): read the {size:,} bytes it holds"
                    return
            if d.eof:
                if buf[:2] != _GZIP_MAGIC:
                    return  # trailing bytes after the last member are ignored
                d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                out = d.decompress(buf, CHUNK_BYTES)
            except zlib.error as e:
                if not size:
                    raise LogFormatError(f"{p}: corrupt gzip stream ({e})") from None
                self.warning = f"gzip data corrupt after {size:,} bytes ({e}): read what came before"
                return
            buf = d.unused_data if d.eof else d.unconsumed_tail
            if out:
                size += len(out)
                if size > self.max_bytes:
                    raise LogBudgetError(
                        "max_log_bytes", value=f"more than {self.max_bytes:,}", limit=self.max_bytes,
                        what=f"{p}: decompressed bytes",
                    )  # fmt: skip
                yield out

    def _checked(self, raw: Iterator[bytes]) -> Iterator[str]:
        """Decode ``raw`` and refuse binary data, a giant number or an over-long line as they arrive."""
        p = self.path
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        line_limit = self.limits.max_log_line_bytes
        head: list[str] = []
        head_len, sniffed = 0, False
        run, digits, newlines = 0, 0, 0  # open line's length, trailing digits, lines before this piece
        for data in _with_end(raw):
            if data:
                at = _huge_number(data, digits)
                if at is not None:
                    line = newlines + data.count(b"\n", 0, max(at, 0)) + 1
                    raise LogFormatError(f"{p}: a number of {MAX_DIGITS:,}+ digits at line {line}; not a training log")
                tail = len(data) - len(data.rstrip(_DIGITS))
                digits = digits + tail if tail == len(data) else tail
                newlines += data.count(b"\n")
            text = decoder.decode(data or b"", final=data is None)
            if not text:
                continue
            if not sniffed:
                head.append(text[: _SNIFF - head_len])
                head_len += len(head[-1])
                if head_len >= _SNIFF:
                    _sniff(p, "".join(head))
                    sniffed, head = True, []
            lines = text.splitlines()
            closed = text.endswith(_LINE_ENDS)
            first = run + len(lines[0]) if lines else run
            longest = max(first, max(map(len, lines[1:]), default=0)) if closed or len(lines) > 1 else 0
            if longest > line_limit:
                check("max_log_line_bytes", longest, what=f"{p}: characters in one line")
            run = 0 if closed else (first if len(lines) == 1 else len(lines[-1]))
            if run > line_limit:
                check("max_log_line_bytes", run, what=f"{p}: characters in one line")
            yield text
        if not sniffed and head:
            _sniff(p, "".join(head))


def _huge_number(data: bytes, carry: int) -> int | None:
    """Where a run of :data:`MAX_DIGITS` ASCII digits starts in ``data`` (``carry`` digits ended the piece before).

    Bytes, not text: a translate and a substring search run at memory speed, a ``\\d{1000}`` regex at 30 MB/s.
    """
    if carry:
        lead = len(data) - len(data.lstrip(_DIGITS))
        if carry + lead >= MAX_DIGITS:
            return 0
    at = data.translate(_DIGIT_MAP).find(_DIGIT_RUN)
    return None if at < 0 else at


def _with_end(raw: Iterator[bytes]) -> Iterator[bytes | None]:
    yield from raw
    yield None


def _sniff(p: Path, head: str) -> None:
    controls = sum(head.count(chr(c)) for c in (*range(0, 9), *range(14, 32)))
    if "\0" in head or (head and controls > len(head) // 10):
        raise LogFormatError(f"{p}: a binary file, not a text log")


def read_log(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> tuple[str, str | None]:
    """The text of one log file (plain or gzip, sniffed by its magic bytes) and a warning if a gzip stream was cut.

    Memory: the text itself plus one :data:`CHUNK_BYTES` piece, never a buffer of the budget's size.

    Raises:
        LogFormatError: missing, unreadable, a FIFO/device/socket, over ``max_bytes`` (default: the
            ``max_log_bytes`` budget), a corrupt gzip stream, binary (NUL bytes or mostly control
            bytes near the start), a number of 1,000+ digits, or a line over ``max_log_line_bytes``.
    """
    reader = _LogReader(Path(path), max_bytes)
    text = "".join(reader.pieces())
    return text, reader.warning


def read_log_text(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> str:
    """:func:`read_log` without the warning."""
    return read_log(path, max_bytes=max_bytes)[0]


class LogLines:
    """The lines of one log file, line ends kept, checked as :func:`read_log` checks them.

    Iterate once; afterwards ``warning`` says whether a gzip stream was cut (as :func:`read_log`'s).
    A ``"\\r\\n"`` split across two pieces stays one line end (as ``str.splitlines`` on the whole text).
    Memory: one :data:`CHUNK_BYTES` piece plus the longest line, however long the log.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int | None = None) -> None:
        self._reader = _LogReader(Path(path), max_bytes)

    @property
    def warning(self) -> str | None:
        return self._reader.warning

    def __iter__(self) -> Iterator[str]:
        rest = ""
        for piece in self._reader.pieces():
            lines = (rest + piece).splitlines(keepends=True)
            # an open last line, or one ending in "\r" whose "\n" may start the next piece, waits for it
            rest = lines.pop() if lines and (lines[-1].endswith("\r") or not lines[-1].endswith(_LINE_ENDS)) else ""
            yield from lines
        if rest:
            yield rest


def iter_log_lines(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> Iterator[str]:
    """The lines of one log file, line ends kept (:class:`LogLines` without the gzip warning)."""
    return iter(LogLines(path, max_bytes=max_bytes))


def check_log_text(p: Path, text: str) -> str:
    """Refuse text that is no training log: binary, a giant number, or an over-long line.

    Raises:
        LogFormatError: naming the file and what was found.
    """
    _sniff(p, text[:_SNIFF])
    if m := _HUGE_NUMBER.search(text):
        line = text.count("\n", 0, m.start()) + 1
        raise LogFormatError(f"{p}: a number of {MAX_DIGITS:,}+ digits at line {line}; not a training log")
    longest = max(map(len, text.splitlines()), default=0)
    check("max_log_line_bytes", longest, what=f"{p}: characters in one line")
    return text


def check(budget: str, value: int, *, what: str) -> None:
    """:func:`bufreuse.limits.check` for a log (the budgets in force), raising :class:`LogBudgetError`."""
    from bufreuse import limits

    limits.check(budget, value, what=what, error=LogBudgetError)
