"""`bufreuse bench layer` on CPU: the tiny real megatron-core MoELayer, its table, JSON, plot and refusals.

The command runs twice in-process (JSON with --output/--plot, then the table) on few rounds; the test
re-derives the round order, the ratios and the hooks' acquisitions from the recorded rounds itself.
The H200 half (TE spec, bf16 and FP8) is ``tests/test_bench_layer_gpu.py``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from bufreuse.bench.layer_bench import LayerBenchConfig, _check_te, round_order, schedule_steps
from bufreuse.cli import app
from bufreuse.errors import InputError

runner = CliRunner()
MB, STEPS, ROUNDS, WARMUP = 4, 1, 2, 1
FAST = ["--preset", "tiny", "--device", "cpu", "--num-microbatches", str(MB), "--steps", str(STEPS),
        "--rounds", str(ROUNDS), "--warmup-rounds", str(WARMUP)]  # fmt: skip


def test_schedules_are_the_named_orders() -> None:
    def names(steps):
        return " ".join(f"{k}{i}" for k, i in steps)

    assert names(schedule_steps("sequential", 3)) == "F0 B0 F1 B1 F2 B2"
    assert names(schedule_steps("interleaved", 4)) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert names(schedule_steps("interleaved", 1)) == "F0 B0"


def test_round_order_is_warmup_then_a_b_b_a_cycles() -> None:
    order = [(r["arm"], r["warmup"], r["cycle"]) for r in round_order(["C", "P", "Q"], 4, 1)]
    assert order == [
        ("C", True, None), ("P", True, None), ("Q", True, None),
        ("C", False, 0), ("P", False, 0), ("Q", False, 0), ("Q", False, 0), ("P", False, 0), ("C", False, 0),
        ("C", False, 1), ("P", False, 1), ("Q", False, 1), ("Q", False, 1), ("P", False, 1), ("C", False, 1),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-layer")
    files = ["--output", str(out / "r.json"), "--plot", str(out / "r.png")]
    result = runner.invoke(app, ["bench", "layer", *FAST, "--policies", "ring,stream-ordered", "--json", *files])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out


def test_json_records_a_b_b_a_rounds_control_first(json_run) -> None:
    data, _ = json_run
    arms = ["control", "ring", "stream-ordered"]
    assert data["arms"] == arms
    expected = arms * WARMUP + (arms + arms[::-1]) * (ROUNDS // 2)
    assert data["order"] == expected == [r["arm"] for r in data["rounds"]]
    assert [r["warmup"] for r in data["rounds"]] == [True] * len(arms) * WARMUP + [False] * len(arms) * ROUNDS
    assert data["config"]["hidden"] == 32 and data["config"]["experts"] == 8 and data["config"]["tokens"] == 64


def test_json_figures_per_round_and_gpu_absent_on_cpu(json_run) -> None:
    data, _ = json_run
    assert data["gpu_figures"] is False and "no GPU figure" in data["note"]
    assert "gpu_ms" not in data["metrics"] and data["headline"] == "host_us"
    for r in data["rounds"]:
        assert r["fwd_host_us"] > 0 and r["bwd_host_us"] > 0 and r["gpu_ms"] is None
        assert r["host_us"] == pytest.approx(r["fwd_host_us"] + r["bwd_host_us"])
        # wall includes the host calls of the round's timed schedules (and more)
        assert r["wall_ms"] * 1e3 >= r["host_us"]


def test_hooked_arms_acquire_once_per_microbatch_and_control_not_at_all(json_run) -> None:
    data, _ = json_run
    per_round = (STEPS + 1) * MB  # one untimed schedule + the timed ones, one acquisition per forward
    for r in data["rounds"]:
        if r["arm"] == "control":
            assert r["acquisitions"] == {}
        else:  # EP = 1: the dispatch is an identity upstream, so only the FC2 ring is hooked (and it says why)
            assert r["acquisitions"] == {"expert_fc2_output": per_round}, r
            assert "EP = 1" in r["unused"]["dispatch_output"]


def test_as_installed_arm_runs_production_at_ep_1_and_hooks_nothing() -> None:
    result = runner.invoke(app, ["bench", "layer", *FAST, "--policies", "ring,as-installed", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    per_round = (STEPS + 1) * MB
    rounds = {arm: [r for r in data["rounds"] if r["arm"] == arm] for arm in ("ring", "as-installed")}
    # positive control: the ring arm (the expert ring exercised at EP = 1) acquires every forward; the production
    # rule uses no ring at EP x ETP = 1: nothing acquired, both buffers said unused
    assert all(r["acquisitions"] == {"expert_fc2_output": per_round} for r in rounds["ring"])
    assert all(r["acquisitions"] == {} and r["deferred_releases"] == {} for r in rounds["as-installed"])
    assert all(set(r["unused"]) == {"dispatch_output", "expert_fc2_output"} for r in rounds["as-installed"])


def test_dispatch_ring_exercises_the_dispatch_hooks_at_ep_1() -> None:
    """``--dispatch-ring``: both rings acquire every forward; without it (the positive control in the JSON run)
    only the FC2 ring is hooked."""
    result = runner.invoke(app, ["bench", "layer", *FAST, "--policies", "ring", "--dispatch-ring", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    per_round = (STEPS + 1) * MB
    ring = [r for r in data["rounds"] if r["arm"] == "ring"]
    assert all(r["acquisitions"] == {"dispatch_output": per_round, "expert_fc2_output": per_round} for r in ring)
    # the experts read the dispatch slot directly at EP = 1 and save it: its release waits for those saved references
    assert all(r["deferred_releases"]["dispatch_output"] > 0 for r in ring), ring
    assert data["config"]["dispatch_ring"] is True
    table = runner.invoke(app, ["bench", "layer", *FAST, "--policies", "ring", "--dispatch-ring"])
    assert table.exit_code == 0 and "dispatch and expert buffers" in " ".join(table.output.split()), table.output


def test_ratios_and_verdicts_follow_from_the_rounds(json_run) -> None:
    data, _ = json_run
    measured = [r for r in data["rounds"] if not r["warmup"]]
    controls = [r for r in measured if r["arm"] == "control"]
    for arm in ("ring", "stream-ordered"):
        mine = [r for r in measured if r["arm"] == arm]
        # each arm round's partner: the nearest control round of its cycle
        partner = {
            r["index"]: min(
                (c for c in controls if c["cycle"] == r["cycle"]), key=lambda c: abs(c["index"] - r["index"])
            )
            for r in mine
        }
        assert [r["paired_with"] for r in mine] == [partner[r["index"]]["index"] for r in mine]
        assert len({r["paired_with"] for r in mine}) == len(mine)  # disjoint pairs
        for m in ("host_us", "fwd_host_us", "bwd_host_us", "wall_ms"):
            fig = data["summary"][arm][m]
            assert fig["median"] == pytest.approx(statistics.median(r[m] for r in mine))
            ratios = [r[m] / partner[r["index"]][m] for r in mine]
            assert fig["round_ratios"] == pytest.approx(ratios)
            judged = fig["vs_control"]
            assert judged["ratio"] == pytest.approx(math.exp(statistics.fmean(map(math.log, ratios))))
            # 2 pairs: below the verdict rule's sample floor, said so
            assert judged["verdict"] == "inconclusive" and "< 5 a side" in judged["note"]
            unpaired = math.exp(
                statistics.fmean(math.log(r[m]) for r in mine) - statistics.fmean(math.log(c[m]) for c in controls)
            )
            assert fig["unpaired"]["ratio"] == pytest.approx(unpaired)
    assert data["drift"]["host_us"]["ratio"] == pytest.approx(controls[1]["host_us"] / controls[0]["host_us"])


def test_output_file_and_plot_written(json_run) -> None:
    data, out = json_run
    assert json.loads((out / "r.json").read_text())["order"] == data["order"]
    png = (out / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_table_names_arms_ratios_drift_and_the_missing_gpu_figure() -> None:
    result = runner.invoke(app, ["bench", "layer", *FAST, "--schedule", "sequential"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("MoE layer: hidden 32", "sequential schedule", "control", "ring", "ratio to the control",
                 "control drift", "— (CPU)", "there is no GPU figure", "inconclusive"):  # fmt: skip
        assert text in out, text
    assert "internal error" not in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--precision", "fp8"], "--precision fp8 needs --spec te"),
        (["--spec", "te"], "--spec te needs a CUDA device"),
        (["--rounds", "3"], "--rounds must be even"),
        (["--policies", "ring,bogus"], "--policies"),
        (["--experts", "4", "--topk", "5"], "--topk 5 is more than --experts 4"),
        (["--ring-slots", "1"], "--ring-slots 1 is fewer than the 2 microbatches"),
        (["--preset", "huge"], "--preset must be one of"),
        (["--tokens", "0"], "--tokens must be >= 1"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--gc", "sometimes"], "--gc must be one of auto, manual"),
        (["--plot", "ratios.txt"], "--plot ratios.txt: the file name must end in .png"),
        (["--device", "meta"], "use cuda, cuda:N or cpu"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_two(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["bench", "layer", "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "internal error" not in result.output and "Traceback" not in result.output


def test_te_spec_without_transformer_engine_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails as where TE is not installed
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(InputError, match="--spec te needs Transformer Engine"):
        _check_te(LayerBenchConfig(spec="te"))


def test_manual_gc_keeps_the_collector_off_inside_a_round_and_restores_it() -> None:
    """``--gc manual`` (Megatron's ``--manual-gc``): collected before the round, off during it, on again after;
    ``auto`` leaves the collector alone (positive control: it stays on inside)."""
    import gc

    from bufreuse.bench.layer_bench import _collector

    assert gc.isenabled()
    with _collector(LayerBenchConfig(gc="manual")):
        inside_manual = gc.isenabled()
    with _collector(LayerBenchConfig(gc="auto")):
        inside_auto = gc.isenabled()
    assert not inside_manual and inside_auto and gc.isenabled()
    gc.disable()  # a process that runs with the collector off already keeps it off
    try:
        with _collector(LayerBenchConfig(gc="manual")):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
