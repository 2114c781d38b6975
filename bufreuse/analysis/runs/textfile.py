"""Read a training log that may be anything: binary junk, gzip, invalid UTF-8, one gigantic line.

The guard sits at file-open level, before any grammar sees the text: a gzip'd log is inflated
(within the ``max_log_bytes`` budget), a binary file or a line longer than any real log line
(``max_log_line_bytes``) is refused with one :class:`~bufreuse.errors.LogFormatError`, and
undecodable bytes become U+FFFD (a log cut mid-character by a killed job must still parse). A
number of a thousand digits is refused here too: no grammar can use it, and ``int()`` of one past
4,300 digits raises.
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from pathlib import Path

from bufreuse.errors import LogFormatError
from bufreuse.limits import BudgetExceededError, Limits, current

__all__ = ["MAX_DIGITS", "MAX_LINE_CHARS", "MAX_LOG_BYTES", "LogBudgetError", "check_log_text", "read_log_text"]

MAX_LOG_BYTES = Limits().max_log_bytes
"""The default ``max_log_bytes`` budget (an alias; the one in force is ``bufreuse.limits.current()``)."""
MAX_LINE_CHARS = Limits().max_log_line_bytes
"""The default ``max_log_line_bytes`` budget (an alias, as above)."""
MAX_DIGITS = 1000
"""Digits in one number; Python refuses to parse ints past 4,300 and no log figure has 1,000."""
_HUGE_NUMBER = re.compile(rf"\d{{{MAX_DIGITS}}}")
_SNIFF = 64 << 10
_GZIP_MAGIC = b"\x1f\x8b"


class LogBudgetError(BudgetExceededError, LogFormatError):
    """A log over a budget: a budget error (names ``--limit``) and a refused log both."""


def read_log_text(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> str:
    """The text of one log file, plain or gzip.

    Raises:
        LogFormatError: missing or unreadable, over ``max_bytes`` (default: the ``max_log_bytes``
            budget), a corrupt gzip stream, binary (NUL bytes or mostly control bytes near the
            start), or a line over the ``max_log_line_bytes`` budget.
    """
    p = Path(path)
    max_bytes = current().max_log_bytes if max_bytes is None else max_bytes
    try:
        with open(p, "rb") as f:
            magic = f.read(2)
            f.seek(0)
            if magic == _GZIP_MAGIC:
                with gzip.GzipFile(fileobj=f, mode="rb") as gz:
                    data = gz.read(max_bytes + 1)
            else:
                data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise LogFormatError(f"{p}: no such log file") from None
    except IsADirectoryError:
        raise LogFormatError(f"{p}: a folder, not a log file") from None
    except OSError as e:
        if isinstance(e, gzip.BadGzipFile) or magic == _GZIP_MAGIC:
            raise LogFormatError(f"{p}: corrupt gzip stream ({e})") from None
        raise LogFormatError(f"{p}: cannot read ({e.strerror or type(e).__name__})") from None
    except (EOFError, zlib.error) as e:
        raise LogFormatError(f"{p}: truncated or corrupt gzip stream ({type(e).__name__})") from None
    if len(data) > max_bytes:
        raise LogBudgetError("max_log_bytes", value=f"more than {max_bytes:,}", limit=max_bytes, what=f"{p}: bytes")
    return check_log_text(p, data.decode("utf-8", errors="replace"))


def check_log_text(p: Path, text: str) -> str:
    """Refuse text that is no training log: binary, a giant number, or an over-long line.

    Raises:
        LogFormatError: naming the file and what was found.
    """
    head = text[:_SNIFF]
    controls = sum(head.count(chr(c)) for c in (*range(0, 9), *range(14, 32)))
    if "\0" in head or (head and controls > len(head) // 10):
        raise LogFormatError(f"{p}: a binary file, not a text log")
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
