"""Renderables and figures as text and bytes, for the files the CLI and the demo write.

Nothing here writes a file: callers pass the result to ``bufreuse.fsutil``'s atomic writers.
"""

from __future__ import annotations

import csv
import io
import json
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["JSON_DIGITS", "PNG_DPI", "csv_text", "json_ready", "json_text", "png_bytes", "renderable_text"]

PNG_DPI = 110
"""Resolution every PNG is saved at."""

JSON_DIGITS = 10
"""Significant digits of a non-whole float in every ``--json`` output and JSON file: float noise
(``8297.650000000001``, a median of two 0.05-step figures) goes, and no figure loses what was measured
(a log prints at most ~6 digits; a byte count is an int or a whole float, kept exact)."""


def json_ready(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples, scalars) with each non-whole finite float cut to :data:`JSON_DIGITS`
    significant digits; whole floats, ints, bools, NaN and infinities unchanged (``allow_nan`` decides)."""
    if isinstance(obj, float):
        if obj != obj or obj in (float("inf"), float("-inf")) or obj.is_integer():
            return obj
        return float(f"{obj:.{JSON_DIGITS}g}")
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def json_text(obj: Any, *, indent: int | None = None, sort_keys: bool = False, default: Any = None) -> str:
    """The one JSON encoder of the analysis commands' ``--json``: :func:`json_ready`, then strict JSON (no NaN)."""
    return json.dumps(json_ready(obj), indent=indent, sort_keys=sort_keys, allow_nan=False, default=default)


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
