"""Rendering: every rich table and matplotlib figure of the analyses, and their text/PNG forms.

Functions take data (reports, comparisons, sweep rows) and return rich renderables or
matplotlib ``Figure``s; they never read files or print. The CLI and the demo print or write them.
"""

from __future__ import annotations

from bufreuse.analysis.render.compare_tables import comparison_json, comparison_renderable, comparison_text
from bufreuse.analysis.render.export import PNG_DPI, csv_text, png_bytes, renderable_text
from bufreuse.analysis.render.plots import (
    COMPARISON_PLOT_FILES,
    SWEEP_PLOT_FILES,
    comparison_figures,
    iteration_figure,
    memory_figure,
    plot_reserved,
    plot_step_time,
    sweep_figures,
    throughput_figure,
    timeline_figure,
)
from bufreuse.analysis.render.snapshot_tables import combined_table, file_renderable, fmt_bytes, snapshots_table
from bufreuse.analysis.render.sweep_tables import sweep_table

__all__ = [
    "COMPARISON_PLOT_FILES",
    "PNG_DPI",
    "SWEEP_PLOT_FILES",
    "combined_table",
    "comparison_figures",
    "comparison_json",
    "comparison_renderable",
    "comparison_text",
    "csv_text",
    "file_renderable",
    "fmt_bytes",
    "iteration_figure",
    "memory_figure",
    "plot_reserved",
    "plot_step_time",
    "png_bytes",
    "renderable_text",
    "snapshots_table",
    "sweep_figures",
    "sweep_table",
    "throughput_figure",
    "timeline_figure",
]
