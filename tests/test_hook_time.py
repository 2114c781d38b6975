"""The hooks' own host time (``bufreuse bench layer --hook-time``): hooks are charged, the work they wrap is not.

The clock is checked against busy-waits of known length (a hook's own wait is charged, an original's
is not, a hook nested inside an original is charged again), then on the real tiny CPU layer: a wait
injected into a hook's own code raises the figure by that wait, the same wait in the megatron stage the
hook calls does not move it, and the control arm runs no hook at all.
"""

from __future__ import annotations

import json

import pytest
from busy import spin
from typer.testing import CliRunner

from bufreuse.bench.hook_time import HookClock, calibrate

WAIT_US = 400
LAYER_WAIT_US = 5000
"""Beside a tiny layer call's own hook time: on the local spec that includes the SequentialMLP forward the hook
replaces (250-800 µs on the CPU box, up to ±300 µs between runs)."""


def test_clock_charges_a_hooks_own_time_and_not_the_originals_it_calls() -> None:
    clock = HookClock()
    original = clock.original(lambda: spin(3 * WAIT_US))
    nested_hook = clock.hook(lambda: spin(WAIT_US))
    original_calling_a_hook = clock.original(lambda: (spin(WAIT_US), nested_hook()))

    def body() -> None:
        spin(WAIT_US)
        original()
        original_calling_a_hook()

    clock.hook(body)()
    # own wait + the nested hook's wait; the originals' 4 waits are not charged
    assert 2 * WAIT_US <= clock.hook_ns / 1e3 < 3 * WAIT_US  # the originals would add 4 waits
    assert clock.entries == 2 and clock.originals == 2
    # positive control: the same work all as hooks is charged in full
    full = HookClock()
    full.hook(lambda: (spin(WAIT_US), full.hook(lambda: spin(3 * WAIT_US))()))()
    assert full.hook_ns / 1e3 >= 4 * WAIT_US


def test_a_stand_in_is_charged_its_frame_and_not_the_original_it_calls() -> None:
    clock = HookClock(empty=True)
    stand_in = clock.stand_in(clock.original(lambda x: (spin(3 * WAIT_US), x)[1]))
    assert stand_in(7) == 7 and clock.entries == 1 and clock.originals == 1
    assert clock.hook_ns / 1e3 < WAIT_US / 4  # the original's wait is not charged
    # positive control: the same frame as a hook doing the wait itself is charged the wait
    real = HookClock()
    real.hook(lambda x: (spin(3 * WAIT_US), x)[1])(7)
    assert real.hook_ns / 1e3 >= 3 * WAIT_US


def test_calibration_is_the_clocks_cost_of_an_empty_hook() -> None:
    bias = calibrate(repeats=2000)
    assert 0 < bias["entry_ns"] < 20_000 and 0 <= bias["original_ns"] < 20_000


pytest.importorskip("megatron.core")

from bufreuse.cli import app  # noqa: E402

runner = CliRunner()
FAST = ["--preset", "tiny", "--device", "cpu", "--microbatches", "2", "--steps", "2", "--rounds", "2",
        "--warmup", "0", "--json"]  # fmt: skip


def _hook_us() -> dict:
    result = runner.invoke(app, ["bench", "layer", *FAST, "--hook-rounds", "1"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["hook_time"]


def test_layer_hook_time_moves_with_the_hooks_code_not_with_megatrons(monkeypatch) -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    from bufreuse.integrations import core

    base = _hook_us()
    assert list(base["arms"]) == ["ring"]  # the control is never instrumented: no hooks run there
    ring = base["arms"]["ring"]
    assert ring["entries_per_layer_call"] >= 2 and ring["originals_per_layer_call"] >= 1
    assert base["calibration_ns"]["entry_ns"] > 0
    # the stand-in round: an empty frame at each override point (the experts' forward, the hooked combine stage),
    # none of the pool's pack/unpack or the Functions' backward, which only ring storage triggers
    assert ring["stand_in_entries_per_layer_call"] == 2 < ring["entries_per_layer_call"]
    assert ring["stand_in_originals_per_layer_call"] <= ring["originals_per_layer_call"]
    assert 0 < ring["stand_in_raw_us"] < ring["raw_us"]

    # a wait in megatron's combine stage (an original the hook calls) is not the hooks' time
    stage = D.combine_postprocess
    monkeypatch.setattr(D, "combine_postprocess", lambda self, *a, **k: (spin(LAYER_WAIT_US), stage(self, *a, **k))[1])
    slow = _hook_us()["arms"]["ring"]
    slow_original, slow_original_net = slow["us"], slow["net_us"]
    monkeypatch.setattr(D, "combine_postprocess", stage)

    # the same wait inside the hook's own code (the FC2 acquisition's record, made in the experts' hook) is: once
    # per layer call (the release after the combine stage is C's where it builds, where nothing can be patched in)
    init = core.Held.__init__
    monkeypatch.setattr(core.Held, "__init__", lambda self, *a, **k: (spin(LAYER_WAIT_US), init(self, *a, **k))[1])
    slow = _hook_us()["arms"]["ring"]
    slow_hook, slow_hook_net = slow["us"], slow["net_us"]

    assert slow_hook - ring["us"] > 0.8 * LAYER_WAIT_US
    assert abs(slow_original - ring["us"]) < 0.5 * LAYER_WAIT_US
    # the net figure (real less stand-in) moves the same way: the stand-in never runs the hook's own code
    assert slow_hook_net - ring["net_us"] > 0.8 * LAYER_WAIT_US
    assert abs(slow_original_net - ring["net_us"]) < 0.5 * LAYER_WAIT_US


def test_te_route_check_holds_on_the_recorded_h200_run_and_refuses_an_experts_wrapper() -> None:
    """The H200 test's check (``tests/test_bench_layer_gpu.py``) against its own recorded output, and a positive
    control: the same record with an experts' wrapper entry added fails it."""
    import copy
    from pathlib import Path

    from test_bench_layer_gpu import check_te_pad_hook_entries

    root = Path(__file__).resolve().parents[1]
    summary = json.loads((root / "examples/gpu-h200-2026-12-04/megatron-gpu-summary.json").read_text())
    for precision in ("bf16", "fp8"):
        ring = summary[f"bench_layer_hook_time_te_{precision}"]["arms"]["ring"]
        check_te_pad_hook_entries(ring)
        wrapped = copy.deepcopy(ring)
        wrapped["by_hook"].append(
            {"hook": "integrations.core.tracked.<locals>.when_read", "raw_us": 3.0, "entries": 1.0}
        )
        wrapped["entries_per_layer_call"] += 1
        with pytest.raises(AssertionError):
            check_te_pad_hook_entries(wrapped)


def test_hook_rounds_give_the_median_and_range_of_independent_rounds() -> None:
    import statistics

    result = runner.invoke(app, ["bench", "layer", *FAST, "--hook-rounds", "3"])
    assert result.exit_code == 0, result.output
    hook = json.loads(result.stdout)["hook_time"]
    ring = hook["arms"]["ring"]
    assert hook["rounds"] == 3 and len(ring["rounds_us"]) == 3
    assert ring["us"] == statistics.median(ring["rounds_us"])
    assert ring["min_us"] == min(ring["rounds_us"]) <= ring["us"] <= ring["max_us"] == max(ring["rounds_us"])
    assert ring["entries_per_layer_call"] >= 2  # exact counts: the same every round


def _round(raw: float, entries: float, originals: float) -> dict:
    return {"us": raw - 1.0, "raw_us": raw, "entries_per_layer_call": entries, "originals_per_layer_call": originals,
            "by_hook": []}  # fmt: skip


def test_net_is_real_less_stand_in_less_the_warm_cost_of_unmatched_boundaries() -> None:
    from bufreuse.bench.layer_bench import _hook_time_summary

    bias = {"entry_ns": 500.0, "original_ns": 300.0}
    real = [_round(100.0, 4, 2), _round(90.0, 4, 2), _round(130.0, 4, 2)]
    stand = [_round(20.0, 2, 2), _round(30.0, 2, 2), _round(10.0, 2, 2)]
    h = _hook_time_summary(real, stand, bias)
    # per round: real - stand-in - 2 unmatched entries x 0.5 µs (the originals all match)
    assert h["rounds_net_us"] == pytest.approx([79.0, 59.0, 119.0])
    assert h["net_us"] == pytest.approx(79.0) and h["net_min_us"] == pytest.approx(59.0)
    assert h["net_max_us"] == pytest.approx(119.0) and h["stand_in_raw_us"] == 20.0
    # unmatched originals are taken out at their warm cost too, paired round by round (not medians of each)
    h2 = _hook_time_summary([_round(100.0, 4, 5)], [_round(20.0, 2, 2)], bias)
    assert h2["net_us"] == pytest.approx(100.0 - 20.0 - 1.0 - 0.9)
    assert "net_us" not in _hook_time_summary(real)  # no stand-ins: no net figure


def test_stand_in_rounds_alternate_with_the_real_ones(monkeypatch) -> None:
    from bufreuse.bench import layer_bench

    order: list[bool] = []

    def fake_arm(p, arm, bias, *, empty=False):
        order.append(empty)
        return _round(10.0 if empty else 50.0, 2 if empty else 4, 1)

    monkeypatch.setattr(layer_bench, "_hook_time_arm", fake_arm)
    result = runner.invoke(app, ["bench", "layer", *FAST, "--hook-rounds", "4"])
    assert result.exit_code == 0, result.output
    assert order == [False, True, True, False, False, True, True, False]  # A B B A over rounds
    ring = json.loads(result.stdout)["hook_time"]["arms"]["ring"]
    bias = json.loads(result.stdout)["hook_time"]["calibration_ns"]
    assert ring["net_us"] == pytest.approx(50.0 - 10.0 - 2 * bias["entry_ns"] / 1e3)
    # the table shows the stand-in and net columns
    table = runner.invoke(app, ["bench", "layer", *FAST[:-1], "--hook-rounds", "2"])
    assert table.exit_code == 0 and "empty hooks" in table.output and "net" in table.output
