"""The host time the hooks add over the control (``bufreuse bench layer --added-time``).

The span timer is checked against busy-waits (the outermost span is timed once, nested points are inside it;
the wrapped attributes come back as they were), the pair statistics against hand-computed values, and the whole
measurement on the real tiny CPU layer: a wait injected into the hooks' own code raises the added figure by that
wait, the same wait in the megatron stage both arms run does not move it, and an arm with no hook entry point
(the production rule at EP = 1) gets no figure.
"""

from __future__ import annotations

import json
import math
import statistics
import threading

import pytest
from busy import spin

from bufreuse.bench.added_time import SpanTimer, pair_order, spanned, summarise_pairs

WAIT_US = 400
LAYER_WAIT_US = 5000
"""Beside the spans of a tiny CPU layer call (the local spec's SequentialMLP forward: 250-2,500 µs on the CPU box,
paired rounds differing by up to ±500 µs)."""


def test_the_outermost_span_is_timed_once_and_nested_points_are_inside_it() -> None:
    timer = SpanTimer()
    inner = timer.wrap(lambda: spin(WAIT_US), "inner")
    outer = timer.wrap(lambda: (spin(WAIT_US), inner()), "outer")
    outer()
    assert set(timer.by_point) == {"outer"} and timer.by_point["outer"][1] == 1
    assert 2 * WAIT_US <= timer.ns / 1e3 < 3 * WAIT_US  # both waits, once (counted twice it would be >= 3)
    # positive control: the inner point on its own is timed as itself
    inner()
    assert timer.by_point["inner"][1] == 1 and timer.by_point["inner"][0] / 1e3 >= WAIT_US


def test_spans_on_another_thread_are_their_own_outermost() -> None:
    timer = SpanTimer()
    inner = timer.wrap(lambda: spin(WAIT_US), "other thread")

    def outer_body() -> None:
        worker = threading.Thread(target=inner)  # autograd's device thread runs unpack / __del__ like this
        worker.start()
        worker.join()

    timer.wrap(outer_body, "main")()
    assert set(timer.by_point) == {"main", "other thread"} and timer.by_point["other thread"][0] / 1e3 >= WAIT_US


def test_counterparts_are_the_objects_at_the_same_paths_of_the_twin() -> None:
    import torch

    from bufreuse.bench.added_time import counterparts

    class Dispatcher:  # a plain object a module holds, as MoELayer's token_dispatcher
        pass

    def build() -> torch.nn.Module:
        layer = torch.nn.Module()
        layer.experts = torch.nn.Module()
        layer.experts.linear_fc2 = torch.nn.Linear(2, 2)
        layer.token_dispatcher = Dispatcher()
        return layer

    a, b = build(), build()
    got = counterparts(a, b, [(a.experts.linear_fc2, "forward"), (a.token_dispatcher, "combine"), (a, "forward")])
    assert got == [(b.experts.linear_fc2, "forward"), (b.token_dispatcher, "combine"), (b, "forward")]
    with pytest.raises(ValueError, match="not reachable"):  # positive control: an object of neither
        counterparts(a, b, [(Dispatcher(), "combine")])


def test_spanned_wraps_what_is_there_and_puts_it_back() -> None:
    class Stage:
        def run(self) -> str:
            return "class"

    hooked, plain = Stage(), Stage()
    hooked.run = lambda: "hook"  # an arm's instance override
    timer = SpanTimer()
    with spanned([(hooked, "run"), (plain, "run")], timer):
        assert hooked.run() == "hook" and plain.run() == "class"
        assert timer.by_point["Stage.run"][1] == 2
    assert hooked.run() == "hook" and "run" not in vars(plain) and plain.run() == "class"


def test_the_per_call_median_is_the_typical_span_and_a_long_call_does_not_move_it() -> None:
    timer = SpanTimer()
    spans = [WAIT_US, WAIT_US, 10 * WAIT_US, WAIT_US]  # one long call, as a page fault or an allocator segment
    for us in spans:
        timer.wrap(lambda us=us: spin(us), "stage")()
    timer.wrap(lambda: spin(WAIT_US), "unpack")()
    timer.wrap(lambda: spin(WAIT_US), "unpack")()
    assert [len(timer.samples[n]) for n in ("stage", "unpack")] == [4, 2]
    med = timer.per_call_median_ns(calls=4)  # four layer calls
    # the stage: the median of its four spans (~WAIT_US; the mean would be ~3.25 WAIT_US); unpack: 2 calls per 4
    assert WAIT_US <= med["stage"] / 1e3 < 1.5 * WAIT_US
    assert 0.5 * WAIT_US <= med["unpack"] / 1e3 < 0.9 * WAIT_US  # not 1.0: two calls per four layer calls
    # positive control: the mean of the same spans does see the long call
    assert timer.by_point["stage"][0] / 4 / 1e3 > 3 * WAIT_US
    timer.reset()
    assert timer.samples == {} and timer.per_call_median_ns(calls=4) == {}


def test_pairs_alternate_control_first_and_the_interval_is_over_the_abba_groups() -> None:
    assert pair_order(3, "ring") == ["control", "ring", "ring", "control", "control", "ring"]
    control = [{"us": c, "by_point": {"p": c}} for c in (100.0, 104.0, 98.0, 101.0, 99.0, 103.0)]
    arm = [{"us": a, "by_point": {"p": a - 3.0, "unpack": 3.0}} for a in (106.0, 112.0, 103.0, 109.0, 104.0, 107.0)]
    got = summarise_pairs(control, arm)
    diffs = [6.0, 8.0, 5.0, 8.0, 5.0, 4.0]
    groups = [7.0, 6.5, 4.5]  # pairs (0, 1), (2, 3), (4, 5): one C A A C group each
    mean, sd = statistics.fmean(groups), statistics.stdev(groups)
    half = 4.302653 * sd / math.sqrt(len(groups))  # t(0.975, df 2)
    assert got["added_us"] == pytest.approx(statistics.fmean(diffs)) == pytest.approx(mean)
    assert got["pair_added_us"] == diffs and got["interval_over"] == "3 A B B A groups"
    assert got["ci_low_us"] == pytest.approx(mean - half, rel=0.02)
    assert got["ci_high_us"] == pytest.approx(mean + half, rel=0.02)
    points = {row["point"]: row for row in got["points"]}
    assert points["unpack"]["added_us"] == pytest.approx(3.0) and points["unpack"]["control_us"] == 0.0
    assert points["p"]["added_us"] == pytest.approx(mean - 3.0)
    assert "per_call_median" not in got  # rounds without medians: the means only
    # an odd count of pairs: the interval over the pairs themselves (t, df 4)
    odd = summarise_pairs(control[:5], arm[:5])
    sd5 = statistics.stdev(diffs[:5])
    assert odd["interval_over"] == "5 pairs"
    assert odd["ci_high_us"] - odd["added_us"] == pytest.approx(2.776445 * sd5 / math.sqrt(5), rel=0.02)

    # with per-call medians: the same statistics of the medians, apart from the means
    medians = ((90.0, 91.0, 92.0, 90.0, 91.0, 90.0), (95.0, 97.0, 96.0, 94.0, 95.0, 96.0))
    for rounds, values in zip((control, arm), medians, strict=True):
        for r, m in zip(rounds, values, strict=True):
            r["median_us"], r["by_point_median"] = m, {"p": m}
    got = summarise_pairs(control, arm)
    med = got["per_call_median"]
    mdiffs = [5.0, 6.0, 4.0, 4.0, 4.0, 6.0]
    mgroups = [5.5, 4.0, 5.0]
    mhalf = 4.302653 * statistics.stdev(mgroups) / math.sqrt(3)
    assert med["pair_added_us"] == mdiffs and med["added_us"] == pytest.approx(statistics.fmean(mgroups))
    assert med["ci_low_us"] == pytest.approx(statistics.fmean(mgroups) - mhalf, rel=0.02)
    assert med["ci_high_us"] == pytest.approx(statistics.fmean(mgroups) + mhalf, rel=0.02)
    assert med["median_us"] == pytest.approx(4.5) and med["control_us"] == pytest.approx(90.666667)
    assert got["added_us"] == pytest.approx(mean)  # the means' figure unchanged beside it


pytest.importorskip("megatron.core")

from typer.testing import CliRunner  # noqa: E402

from bufreuse.cli import app  # noqa: E402

runner = CliRunner()
FAST = ["--preset", "tiny", "--device", "cpu", "--microbatches", "2", "--steps", "2", "--rounds", "2",
        "--warmup", "0", "--no-hook-time", "--added-pairs", "8", "--json"]  # fmt: skip


def _added(*extra: str) -> dict:
    result = runner.invoke(app, ["bench", "layer", *FAST, *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["added_time"]


def test_added_time_moves_with_the_hooks_code_not_with_megatrons(monkeypatch) -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    from bufreuse.integrations import core

    base = _added("--policies", "ring,as-installed")
    ring = base["arms"]["ring"]
    assert set(ring["entry_points"]) == {"SequentialMLP.forward", "MoEAlltoAllTokenDispatcher.combine_postprocess"}
    assert ring["pairs"] == 8 and ring["ci_low_us"] is not None and len(ring["halves_added_us"]) == 2
    points = {row["point"]: row for row in ring["points"]}
    assert points["saved-tensor unpack"]["control_us"] == 0 < points["saved-tensor unpack"]["arm_us"]
    assert points["MoEAlltoAllTokenDispatcher.combine_postprocess"]["control_us"] > 0  # timed in the control too
    assert base["arms"]["as-installed"]["entry_points"] == []  # EP x ETP = 1: no hook, no figure

    # a wait in megatron's combine stage runs in both arms: the difference does not move
    stage = D.combine_postprocess
    monkeypatch.setattr(D, "combine_postprocess", lambda self, *a, **k: (spin(LAYER_WAIT_US), stage(self, *a, **k))[1])
    slow_megatron = _added()["arms"]["ring"]
    monkeypatch.setattr(D, "combine_postprocess", stage)
    # the same wait inside the hook's own code (the FC2 acquisition's record, made in the experts' hook) runs in the
    # arm only (the release after the combine stage is C's where it builds: nothing can be patched in there)
    init = core.Held.__init__
    monkeypatch.setattr(core.Held, "__init__", lambda self, *a, **k: (spin(LAYER_WAIT_US), init(self, *a, **k))[1])
    slow_hook = _added()["arms"]["ring"]

    stage_point = "MoEAlltoAllTokenDispatcher.combine_postprocess"
    assert slow_megatron["points"] and {r["point"]: r for r in slow_megatron["points"]}[stage_point]["control_us"] > (
        0.8 * LAYER_WAIT_US
    )
    assert abs(slow_megatron["added_us"] - ring["added_us"]) < 0.5 * LAYER_WAIT_US
    assert slow_hook["added_us"] - ring["added_us"] > 0.8 * LAYER_WAIT_US
    # the per-call medians move alike: every call waits, so the typical call does too
    med, slow_med, slow_meg_med = (r["per_call_median"] for r in (ring, slow_hook, slow_megatron))
    assert {r["point"] for r in med["points"]} == set(points) and med["pairs"] == 8 and med["ci_low_us"] is not None
    assert abs(slow_meg_med["added_us"] - med["added_us"]) < 0.5 * LAYER_WAIT_US
    assert slow_med["added_us"] - med["added_us"] > 0.8 * LAYER_WAIT_US


def test_a_drained_schedule_waits_for_the_gpu_before_every_layer_call_and_only_then(monkeypatch) -> None:
    """The added-time rounds drain the GPU before each forward and backward (outside the spans): recorded here
    with the calls in order, over stand-in tensors that say they are on CUDA."""
    import torch

    from bufreuse.bench.layer_bench import _schedule, schedule_steps

    events: list[str] = []

    class Out:
        def __init__(self, i: int) -> None:
            self.i = i

        def backward(self, grad: object) -> None:
            events.append(f"B{self.i}")

    class OnCuda:
        is_cuda = True

        def __init__(self, i: int) -> None:
            self.i = i

        def detach(self) -> OnCuda:
            return self

        def requires_grad_(self, flag: bool) -> OnCuda:
            return self

    def forward(x: OnCuda) -> Out:
        events.append(f"F{x.i}")
        return Out(x.i)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: events.append("sync"))
    steps = schedule_steps("interleaved", 2)
    xs, grads = [OnCuda(0), OnCuda(1)], [None, None]
    _schedule(forward, steps, xs, grads, None, drain=True)
    calls = [f"{kind}{i}" for kind, i in steps]
    assert events == [e for c in calls for e in ("sync", c)]
    events.clear()  # positive control: the timed rounds of the main A/B do not drain
    _schedule(forward, steps, xs, grads, None)
    assert events == calls


def test_only_the_added_time_schedules_drain_and_the_layers_swap_roles_halfway(monkeypatch) -> None:
    from bufreuse.bench import layer_bench

    seen: list[bool] = []
    installed: list[int] = []
    real, real_installed = layer_bench._schedule, layer_bench._installed

    def recording(*args, drain: bool = False, **kwargs):
        seen.append(drain)
        return real(*args, drain=drain, **kwargs)

    def installing(layer, arm, *args, **kwargs):
        if arm != "control":
            installed.append(id(layer))
        return real_installed(layer, arm, *args, **kwargs)

    monkeypatch.setattr(layer_bench, "_schedule", recording)
    monkeypatch.setattr(layer_bench, "_installed", installing)
    _added("--added-pairs", "4")
    # FAST: 2 main rounds of each arm x (1 untimed + 2 timed schedules); then, per half, one untimed schedule of
    # each layer and 2 pairs of one schedule each, drained
    assert seen == [False] * (2 * 2 * 3) + [True] * (2 * (2 + 2 * 2))
    # the arm's installations: 2 main rounds and the points on the bench's layer, then the twin (first half), then
    # the bench's layer again (second half: the twin is the control)
    bench, twin = installed[0], installed[-2]
    assert installed == [bench, bench, bench, twin, bench] and twin != bench
