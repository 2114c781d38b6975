"""Make text from files and users safe to render: rich markup and matplotlib mathtext escaped.

Strings in a snapshot (frame and file names, actions), a log or a sweep folder (labels, modes,
statuses) are data, not markup: ``[/]`` would crash rich and ``$x$`` would be typeset (or fail to
parse) by matplotlib. Every such string passes through one of these before it is rendered.
"""

from __future__ import annotations

from typing import Any

from rich.markup import escape

__all__ = ["mpl_text", "rich_text"]

_MAX = 2000  # characters of one rendered string from a file (longer ones are cut)


def _cut(s: str) -> str:
    return s if len(s) <= _MAX else s[: _MAX - 1] + "…"


def rich_text(v: Any) -> str:
    """``v`` as a string rich prints literally (markup escaped), cut to a sane length."""
    return escape(_cut(v if isinstance(v, str) else str(v)))


def mpl_text(v: Any) -> str:
    """``v`` as a string matplotlib draws literally (``$`` escaped: no mathtext), cut to a sane length."""
    return _cut(v if isinstance(v, str) else str(v)).replace("$", r"\$")
