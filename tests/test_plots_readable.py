"""The figures a newcomer opens first: nothing hidden, nothing implied, every figure labelled (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

from bufreuse.analysis.render.plots import memory_figure, throughput_figure, timeline_figure
from bufreuse.analysis.runs.compare import compare_specs
from bufreuse.analysis.snapshot.batch import analyze_file
from bufreuse.analysis.snapshot.report import ReportConfig

SWEEP = Path(__file__).resolve().parents[1] / "examples" / "sweep-h200"


def test_memory_bars_label_a_zero_and_define_device_used() -> None:
    result = compare_specs([str(SWEEP / "slots0"), str(SWEEP / "slots2")])
    ax = memory_figure(result, run="sweep-h200: proxy, NVIDIA H200").axes[0]
    labels = [t.get_text() for t in ax.texts]
    ring = json.loads((SWEEP / "slots2" / "metrics.json").read_text())
    assert ring["pending_free_at_max_active_bytes"] == 0  # the fixture's fact: the ring run has no pending free
    assert "0" in labels  # ... and its bar says so instead of vanishing
    control = json.loads((SWEEP / "slots0" / "metrics.json").read_text())
    assert f"{control['max_reserved_bytes'] / 2**20:,.0f}" in labels
    assert "total - free" in ax.get_xlabel()
    assert "NVIDIA H200" in ax.get_title()


def test_throughput_points_say_the_axis_is_cut() -> None:
    result = compare_specs([str(SWEEP / "slots0"), str(SWEEP / "stream-ordered")])
    ax = throughput_figure(result).axes[0]
    assert ax.get_ylim()[0] > 0 and "does not start at 0" in ax.get_title()
    assert not ax.patches  # points with error bars, not bars on a cut axis


def test_timeline_legend_sits_outside_and_reserved_is_drawn_over_active() -> None:
    res = analyze_file(str(SWEEP / "slots2" / "snapshot.pickle.gz"), ReportConfig(timeline_points=300))
    ax = timeline_figure(res.timeline, title="slots2 (device 0)").axes[0]
    legend = ax.get_legend()
    assert legend.get_bbox_to_anchor().y0 < ax.bbox.y0
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert lines["reserved"].get_zorder() > lines["active (allocated + pending free)"].get_zorder()
    assert lines["reserved"].get_linestyle() == "--"
    assert any("max active" in t.get_text() for t in ax.texts)
