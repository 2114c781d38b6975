"""Sweep rows, table and plots from recorded metrics (no torch needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.figure import Figure
from rich.console import Console

from bufreuse.analysis.render.plots import SWEEP_PLOT_FILES, plot_reserved, plot_step_time, sweep_figures
from bufreuse.analysis.render.sweep_tables import sweep_table
from bufreuse.analysis.runs.sweep_rows import checksum_mismatches, load_sweep_rows, rows_from_metrics
from bufreuse.cli._common import write_figures
from bufreuse.fsutil import atomic_write_json
from bufreuse.sweepdir import SweepDir

MIB = 1 << 20
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "sweep-h200"


def _m(mode: str, slots: int, reserved_mib: int, step: float, *, graph: bool = False, checksum: str = "abc") -> dict:
    return {
        "status": "ok",
        "error": None,
        "config": {"mode": mode, "slots": slots, "cuda_graph": graph},
        "max_reserved_bytes": reserved_mib * MIB,
        "max_allocated_bytes": 1264 * MIB,
        "pending_free_at_max_active_bytes": 4352 * MIB if mode == "control" else 0,
        "step_ms": {"median": step, "p10": step - 0.1, "p90": step + 0.1},
        "tflops": 400.0,
        "checksum": checksum,
    }


def _rows() -> list:
    return rows_from_metrics(
        {
            "slots0": _m("control", 0, 5672, 36.0),
            "slots4": _m("ring", 4, 3112, 36.36),
            "stream-ordered": _m("stream-ordered", 0, 1444, 39.6),
            "slots0-graph": _m("control", 0, 6000, 30.0, graph=True),
            "slots4-graph": _m("ring", 4, 3200, 30.3, graph=True),
            "slots10": None,
        }
    )


def test_rows_deltas_against_matching_control() -> None:
    rows = {r.config_id: r for r in _rows()}
    assert rows["slots4"].reserved_delta_bytes == (3112 - 5672) * MIB
    assert rows["slots4"].step_delta_pct == pytest.approx(1.0)
    assert rows["stream-ordered"].step_delta_pct == pytest.approx(10.0)
    assert rows["slots4-graph"].reserved_delta_bytes == (3200 - 6000) * MIB  # against the graph control
    assert rows["slots10"].status == "pending" and rows["slots10"].mode == "ring" and rows["slots10"].slots == 10


def test_rows_malformed_metrics_fields_become_blank() -> None:
    bad = {**_m("ring", 4, 3112, 36.36), "step_ms": "fast", "max_reserved_bytes": "lots", "config": {"slots": "4"}}
    rows = {r.config_id: r for r in rows_from_metrics({"slots0": _m("control", 0, 5672, 36.0), "slots4": bad})}
    assert rows["slots4"].step_ms is None and rows["slots4"].max_reserved_bytes is None
    assert rows["slots4"].reserved_delta_bytes is None and rows["slots4"].slots == 4
    Console(width=200, record=True).print(sweep_table(list(rows.values())))  # renders, no TypeError


def test_checksum_mismatch_names_groups() -> None:
    rows = rows_from_metrics({"slots0": _m("control", 0, 1, 1.0), "slots2": _m("ring", 2, 1, 1.0, checksum="zzz")})
    assert checksum_mismatches(rows) == {"abc": ["slots0"], "zzz": ["slots2"]}
    assert checksum_mismatches(_rows()) == {}


def test_table_renders_deltas_and_pending() -> None:
    console = Console(record=True, width=200)
    console.print(sweep_table(_rows(), title="t"))
    text = console.export_text()
    assert "-2,560" in text and "+1.0%" in text and "+10.0%" in text and "pending" in text and "4,352" in text


def test_plots_are_figures_with_series(tmp_path: Path) -> None:
    fig = plot_reserved(_rows())
    assert isinstance(fig, Figure)
    labels = sorted(t.get_text() for t in fig.axes[0].get_legend().get_texts())
    assert labels == sorted(["control: record_stream", "ring", "stream-ordered 1,444",
                             "control: record_stream (graph)", "ring (graph)"])  # fmt: skip
    assert isinstance(plot_step_time([]), Figure)  # nothing finished: an empty plot, no error
    paths = write_figures(tmp_path, sweep_figures(_rows()))
    assert [p.name for p in paths] == list(SWEEP_PLOT_FILES)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_load_sweep_rows_reads_folder_in_manifest_order(tmp_path: Path) -> None:
    sweep = SweepDir(tmp_path / "s")
    sweep.write_manifest({"name": "s", "configs": ["slots0", "slots2"]})
    atomic_write_json(sweep.paths("slots2").metrics, _m("ring", 2, 2088, 36.3))
    rows = load_sweep_rows(sweep.folder)
    assert [(r.config_id, r.status) for r in rows] == [("slots0", "pending"), ("slots2", "ok")]


@pytest.mark.skipif(not (EXAMPLES / "manifest.json").is_file(), reason="examples/sweep-h200 not recorded yet")
def test_recorded_h200_example_sweep_reads() -> None:
    rows = {r.config_id: r for r in load_sweep_rows(EXAMPLES)}
    assert rows["slots0"].status == "ok" and rows["slots4"].reserved_delta_bytes < 0
    assert not checksum_mismatches(list(rows.values()))
    assert rows["slots4"].pending_free_bytes is not None


def test_sweep_plot_never_joins_points_and_labels_every_value() -> None:
    from matplotlib.lines import Line2D

    rows = rows_from_metrics(
        {
            "slots0": _m("control", 0, 5672, 36.0),
            "slots2": _m("ring", 2, 2000, 36.2),
            "slots10": _m("ring", 10, 4000, 36.1),
            "stream-ordered": _m("stream-ordered", 0, 1444, 39.6),
        }
    )
    ax = plot_reserved(rows, run="sweep-x: proxy, NVIDIA H200").axes[0]
    # no drawn line joins measured points (a line from 2 to 10 would imply values at 3..9); the only
    # line is the stream-ordered level across the axes
    joined = [ln for ln in ax.get_lines() if isinstance(ln, Line2D) and len(ln.get_xdata()) > 1
              and ln.get_linestyle() not in ("None", "", " ") and len(set(ln.get_ydata())) > 1]  # fmt: skip
    assert joined == []
    texts = {t.get_text() for t in ax.texts}
    assert {"5,672", "2,000", "4,000"} <= texts  # each point labelled with its MiB
    assert "NVIDIA H200" in ax.get_title()
    legend = ax.get_legend()
    assert legend.get_bbox_to_anchor().y0 < ax.bbox.y0  # below the axes: it covers no data
    st = plot_step_time(rows).axes[0]
    assert "does not start at 0" in st.get_title() and st.get_ylim()[0] > 0
    assert len(st.collections) >= 2  # p10-p90 error bars of control and rings (LineCollections) ...
    # ... whose extent is the spread written into metrics.json (±0.1 ms around each median)
    segs = [seg for c in st.collections if hasattr(c, "get_segments") for seg in c.get_segments()]
    spans = sorted(round(float(seg[1][1] - seg[0][1]), 6) for seg in segs if len(seg) == 2 and seg[0][0] == seg[1][0])
    assert spans and all(abs(v - 0.2) < 1e-6 for v in spans)
