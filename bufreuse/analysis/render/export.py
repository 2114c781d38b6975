"""Renderables and figures as text and bytes, for the files the CLI and the demo write.

Nothing here writes a file: callers pass the result to ``bufreuse.fsutil``'s atomic writers.
"""

from __future__ import annotations

import csv
import io
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PNG_DPI", "csv_text", "png_bytes", "renderable_text"]

PNG_DPI = 110
"""Resolution every PNG is saved at."""


def renderable_text(renderable: Any, *, width: int = 160) -> str:
    """Any rich renderable (table, group) as plain text without colour, for a ``.txt`` file."""
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None, highlight=False)
    console.print(renderable)
    return console.export_text()


def csv_text(rows: list[dict[str, Any]]) -> str:
    """Rows of one shape as CSV text (header from the first row's keys); empty for no rows."""
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue()


def png_bytes(fig: Figure) -> bytes:
    """``fig`` encoded as PNG at :data:`PNG_DPI`."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI)
    return buf.getvalue()
