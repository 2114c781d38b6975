"""scripts/region_cost.py runs on CPU and measures inside a region (a smoke run; figures: docs/benchmarks.md)."""

from __future__ import annotations

import json

from script_module import load_script


def test_region_cost_counts_the_saved_tensors_and_reports_every_arm(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert load_script("region_cost").main(["--blocks", "3", "--calls", "20", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    # the product saves both of its inputs for backward: the identity hooks saw at least those two
    assert data["saved_tensors_per_call"] >= 2
    arms = {"plain", "identity hooks", "pool tracker", "alloc", "alloc, identity hooks", "ring, deferred"}
    assert set(data["arms"]) == arms
    # every measured ring call deferred its release (the product saved the slot; warm-up calls on top)
    assert data["deferred_releases"] >= 3 * 20 and data["saved_tensors_per_ring_stage_call"] >= 1
    assert data["arms"]["ring, deferred"]["baseline"] == "alloc"
    assert "fwd_beyond_region_us" in data["arms"]["ring, deferred"] and data["bufreuse"]["path"]
    for name in ("identity hooks", "pool tracker", "alloc, identity hooks", "ring, deferred"):
        row = data["arms"][name]
        assert len(row["fwd_ci_us"]) == 2 and row["fwd_ci_us"][0] <= row["fwd_added_us"] <= row["fwd_ci_us"][1]
    assert "fwd_added_us" not in data["arms"]["plain"]


def test_region_cost_refuses_too_few_blocks(capsys) -> None:
    assert load_script("region_cost").main(["--blocks", "2"]) == 2
    assert "--blocks must be >= 3" in capsys.readouterr().err
