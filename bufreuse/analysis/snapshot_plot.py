"""PNG timeline of a snapshot: reserved, active, and the pending-free band, max-active point marked.

Takes a :class:`~bufreuse.analysis.snapshot_report.Timeline` (a few thousand points, downsampled
by bucket maxima of active memory) and returns a matplotlib ``Figure`` (Agg backend); it never
reads files or prints. ``write_timeline_png`` is the one place that writes the PNG (atomically).
matplotlib is imported here only, so reports without ``--plot`` never pay its ~0.5 s import.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING

from bufreuse.analysis.snapshot_report import Timeline
from bufreuse.fsutil import atomic_write_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["timeline_figure", "write_timeline_png"]

_GiB = float(1 << 30)


def timeline_figure(timeline: Timeline, *, title: str = "") -> Figure:
    """Reserved and active memory over time, with the pending-free queue as a shaded band."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg; pyplot is never touched

    fig = Figure(figsize=(10, 4.5), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    x = timeline.x
    ax.plot(x, timeline.reserved / _GiB, color="tab:gray", lw=1.2, drawstyle="steps-post", label="reserved")
    ax.plot(
        x,
        timeline.active / _GiB,
        color="tab:blue",
        lw=1.0,
        drawstyle="steps-post",
        label="active (allocated + pending free)",
    )
    if timeline.pending_by_site:  # the pending-free band, stacked by allocation site
        low = timeline.allocated / _GiB
        for k, (site, b) in enumerate(timeline.pending_by_site.items()):
            high = low + b / _GiB
            ax.fill_between(x, low, high, color=f"C{(k + 1) % 10}", alpha=0.5, lw=0, step="post",
                            label=f"pending free: {site}")  # fmt: skip
            low = high
    else:
        ax.fill_between(x, timeline.allocated / _GiB, timeline.active / _GiB, color="tab:orange", alpha=0.45,
                        lw=0, step="post", label="pending free")  # fmt: skip
    ax.axvline(timeline.max_active_x, color="tab:red", ls="--", lw=0.8)
    ax.scatter(
        [timeline.max_active_x],
        [timeline.max_active_bytes / _GiB],
        color="tab:red",
        zorder=5,
        s=18,
        label=f"max active {timeline.max_active_bytes / _GiB:.2f} GiB",
    )
    ax.set_xlabel(timeline.x_label)
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def write_timeline_png(timeline: Timeline, path: str | os.PathLike[str], *, title: str = "") -> Path:
    """Render ``timeline`` to a PNG at ``path`` (written atomically)."""
    buf = io.BytesIO()
    timeline_figure(timeline, title=title).savefig(buf, format="png")
    return atomic_write_bytes(path, buf.getvalue())
