"""scripts/narrow_cost.py runs on CPU: the narrow and whole regions side by side (a smoke run; figures:
docs/benchmarks.md; the counts themselves are derived independently in tests/test_hot_path.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from script_module import load_script


def test_narrow_cost_reports_both_regions_and_restores_the_readers(tmp_path) -> None:
    from bufreuse.integrations.alltoall import hooks

    real = hooks.dispatch_slot_readers
    out = tmp_path / "n.json"
    assert load_script("narrow_cost").main(["--cycles", "3", "--steps", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    packs = data["packs_per_layer_call"]
    assert 0 < packs["narrow"] < packs["whole"]  # the whole stage packs the experts' other saved tensors too
    assert set(data["host_us"]) == {"control", "narrow", "whole"}
    for row in data["differences_us"].values():
        assert row["ci_low"] <= row["mean"] <= row["ci_high"]
    assert hooks.dispatch_slot_readers is real


def test_narrow_cost_refuses_too_few_cycles(capsys) -> None:
    assert load_script("narrow_cost").main(["--cycles", "2"]) == 2
    assert "--cycles must be >= 3" in capsys.readouterr().err
