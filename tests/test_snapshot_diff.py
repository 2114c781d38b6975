"""`bufreuse snapshot-diff A B`: figures and per-site attribution on the H200 control vs ring recordings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from snapshot_synth import block, segment, write
from typer.testing import CliRunner

from bufreuse.analysis.snapshot import report_file
from bufreuse.analysis.snapshot.diff import BEFORE_TRACE, MEASURES
from bufreuse.cli import app

MiB = 1 << 20
SWEEP = Path(__file__).resolve().parent.parent / "examples" / "sweep-h200"
CONTROL = SWEEP / "slots0" / "snapshot.pickle.gz"
RING4 = SWEEP / "slots4" / "snapshot.pickle.gz"
DISPATCH = "bench/schedule.py:89:dispatch"
EXPERT = "bench/schedule.py:102:expert_fc2_output"
runner = CliRunner()


def _diff_json(a: Path, b: Path, *args: str) -> dict:
    res = runner.invoke(app, ["snapshot-diff", str(a), str(b), "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_headline_deltas_match_each_snapshot_report_h200() -> None:
    out = _diff_json(CONTROL, RING4)
    ra, rb = report_file(CONTROL), report_file(RING4)
    for key in ("max_reserved_bytes", "max_active_bytes", "pending_free_at_max_active_bytes"):
        assert out["a"][key] == ra[key] and out["b"][key] == rb[key]
        assert out["delta"][key] == rb[key] - ra[key]
    assert out["delta"]["pending_free_at_max_active_bytes"] == -4864 * MiB


def test_dispatch_and_expert_sites_carry_the_saving_h200() -> None:
    sites = {s["site"]: s for s in _diff_json(CONTROL, RING4)["sites"]}
    assert sites[DISPATCH]["category"] == "dispatch_output"
    assert sites[EXPERT]["category"] == "expert_output"
    # pending free at max active, by site: the control's report groups, summed independently
    by_site: dict[str, tuple[int, int]] = {}
    for g in report_file(CONTROL)["pending_free_groups_at_max_active"]:
        b, c = by_site.get(g["site"], (0, 0))
        by_site[g["site"]] = (b + g["total_bytes"], c + g["count"])
    for site in (DISPATCH, EXPERT):
        row = sites[site]
        assert (row["pending_a_bytes"], row["pending_a_count"]) == by_site[site]
        assert row["pending_b_bytes"] == row["active_b_bytes"] == row["reserved_b_bytes"] == 0
        assert row["active_delta_bytes"] < 0 and row["reserved_delta_bytes"] < 0
        assert row["reserved_a_bytes"] == row["reserved_a_count"] * 256 * MiB  # one 256 MiB segment each
    # the rings' storage was made before recording: B's growth is under <before trace>
    assert sites[BEFORE_TRACE]["reserved_delta_bytes"] == 4 * 2 * 256 * MiB


def test_each_column_sums_to_its_figure_h200() -> None:
    out = _diff_json(CONTROL, RING4)
    figure = {"reserved": "max_reserved_bytes", "active": "max_active_bytes",
              "pending": "pending_free_at_max_active_bytes"}  # fmt: skip
    for m in MEASURES:
        for side in ("a", "b"):
            assert sum(s[f"{m}_{side}_bytes"] for s in out["sites"]) == out[side][figure[m]], (m, side)


def test_same_snapshot_twice_changes_nothing_h200() -> None:
    out = _diff_json(CONTROL, CONTROL)
    assert set(out["delta"].values()) == {0}
    assert all(s[f"{m}_delta_bytes"] == 0 for s in out["sites"] for m in MEASURES)


def test_table_names_the_sites_and_plot_is_a_png(tmp_path: Path) -> None:
    png = tmp_path / "diff.png"
    res = runner.invoke(app, ["snapshot-diff", str(CONTROL), str(RING4), "--plot", str(png)], env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    for text in (DISPATCH, EXPERT, "dispatch_output", "expert_output", "-4,864 MiB", "pending free @max active"):
        assert text in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("which", ["missing", "no_trace", "bad_category"])
def test_bad_input_exits_2_with_one_error_line(tmp_path: Path, which: str) -> None:
    args = [str(CONTROL), str(RING4)]
    if which == "missing":
        args[1] = str(tmp_path / "nope.pickle")
    elif which == "no_trace":
        args[1] = str(
            write(tmp_path / "legacy.pickle", [segment(1 << 30, 2 * MiB, [block(1 << 30, 2 * MiB, "inactive")])])
        )
    else:
        args += ["--category", "nonsense"]
    res = runner.invoke(app, ["snapshot-diff", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:")
