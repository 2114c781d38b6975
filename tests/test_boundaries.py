"""The bands, gates, quantiles, closed forms and constants the docs state, pinned at their edges.

Every expected value is derived here, by hand (the arithmetic is in the comments) or by a small
brute-force reference written in this file, never read back from the code under test.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from bufreuse.analysis.runs.megatron_log import parse_log_text
from bufreuse.analysis.runs.record import RunRecord
from bufreuse.analysis.runs.stats import bootstrap_diff, mean_diff_interval
from bufreuse.analysis.runs.verdicts import Bands, MetricDelta, explain_allocated, judge
from bufreuse.analysis.snapshot.allocator_model import AllocatorModel, allocation_size
from bufreuse.plan.depth import closed_form, ring_depths
from bufreuse.plan.ops import expand
from bufreuse.plan.rules import ReleasePoint, ReleaseRule
from bufreuse.plan.schedule import ScheduleKind, ScheduleSpec, build_steps
from bufreuse.pool import BufferRing

MiB = 1 << 20


# -- noise bands (docs/compare.md: 1% throughput, max(64 MiB, 0.1%) memory) -----------------------------


def _mem(baseline: float, value: float) -> MetricDelta:
    m = MetricDelta(
        metric="max_reserved", title="max reserved", unit="MiB", better="lower", baseline=baseline, value=value
    )
    judge(m, Bands(), differ=False)
    return m


def test_memory_band_is_64_mib_below_64_gib_baseline() -> None:
    # 10,000 MiB baseline: 0.1% = 10 MiB < 64 MiB, so the band is 64 MiB.
    assert _mem(10_000, 10_064).band == 64.0
    assert _mem(10_000, 10_064).verdict == "parity"  # exactly at the band edge
    assert _mem(10_000, 10_064.5).verdict == "regression"
    assert _mem(10_000, 9_935.5).verdict == "improvement"


def test_memory_band_relative_term_wins_above_64_gib_baseline() -> None:
    # 102,400 MiB (100 GiB) baseline: 0.1% = 102.4 MiB > 64 MiB.
    assert _mem(102_400, 102_400).band == pytest.approx(102.4)
    assert _mem(102_400, 102_400 + 100).verdict == "parity"  # regression under a 64 MiB-only band
    assert _mem(102_400, 102_400 - 100).verdict == "parity"
    assert _mem(102_400, 102_400 + 102.5).verdict == "regression"
    # The two terms are equal at 65,536 MiB: 0.1% of it is 65.536 MiB, just above 64.
    assert _mem(65_536, 65_536 + 65.5).verdict == "parity"
    assert _mem(65_536, 65_536 + 65.6).verdict == "regression"


def test_throughput_band_is_one_percent_of_the_baseline() -> None:
    def step(base: float, value: float) -> str:
        m = MetricDelta(metric="step_ms_median", title="step", unit="ms", better="lower", baseline=base, value=value)
        judge(m, Bands(), differ=False)
        return m.verdict

    assert step(200.0, 202.0) == "parity"  # +1.0% exactly
    assert step(200.0, 202.01) == "regression"
    assert step(200.0, 197.99) == "improvement"


def _sampled(lo: float, hi: float, n: int = 5, *, metric: str = "step_ms_median", differ: bool = False) -> MetricDelta:
    better = "higher" if metric.startswith("tflops") else "lower"
    m = MetricDelta(metric=metric, title=metric, unit="ms", better=better, baseline=100.0, value=100.0 + (lo + hi) / 2)
    m.n_baseline = m.n_value = n
    m.ci_low, m.ci_high = lo, hi
    judge(m, Bands(), differ=differ)
    return m


def test_interval_verdicts_at_five_samples_and_the_band_edges() -> None:
    # Band: 1% of 100 = 1.0 (ms). The interval decides, at exactly 5 samples a side (the documented minimum).
    assert _sampled(-1.0, 1.0).verdict == "parity"  # wholly inside, edges included
    assert _sampled(1.01, 3.0).verdict == "regression"  # wholly beyond on the bad side (step time: higher)
    assert _sampled(-3.0, -1.01).verdict == "improvement"
    assert _sampled(0.5, 1.5).verdict == "inconclusive"  # straddles an edge
    assert _sampled(-1.5, 1.5).verdict == "inconclusive"  # spans the band
    assert _sampled(1.01, 3.0, n=4).verdict == "inconclusive"  # one sample short of a verdict


def test_different_node_sets_never_claim_a_speedup_but_keep_regressions() -> None:
    assert _sampled(-3.0, -1.01, differ=True).verdict == "inconclusive"
    assert "not claimed as a speedup" in _sampled(-3.0, -1.01, differ=True).note
    assert _sampled(1.01, 3.0, differ=True).verdict == "regression"
    tf = _sampled(1.01, 3.0, metric="tflops_median", differ=True)  # higher throughput: a speedup
    assert tf.verdict == "inconclusive"
    mem = MetricDelta(metric="max_reserved", title="r", unit="MiB", better="lower", baseline=10_000, value=9_000)
    judge(mem, Bands(), differ=True)
    assert mem.verdict == "improvement"  # memory is not throughput: a saving stands across node sets


# -- the regression gate vs ring storage -----------------------------------------------------------------


def _gate(delta_mib: float, *, slots: int = 4, slot_mib: int = 256, explained: list | None = None) -> MetricDelta:
    base = RunRecord(label="base", source=Path("base"), kind="sweep", max_allocated_bytes=2_000 * MiB)
    run = RunRecord(
        label="ring",
        source=Path("ring"),
        kind="sweep",
        ring_slots={"dispatch_output": slots},
        ring_slot_bytes={"dispatch_output": slot_mib * MiB},
        slot_bytes_source="metrics.json",
    )
    m = MetricDelta(
        metric="max_allocated",
        title="max allocated",
        unit="MiB",
        better="lower",
        baseline=2_000,
        value=2_000 + delta_mib,
    )
    judge(m, Bands(), differ=False)
    text, ok = explain_allocated(base, run, m, Bands())
    if explained is not None:
        explained.append((text, ok))
    return m


def test_gate_excuses_growth_up_to_the_ring_storage_plus_the_band_and_no_more() -> None:
    # 4 slots x 256 MiB = 1,024 MiB of ring storage; the band on a 2,000 MiB baseline is 64 MiB.
    assert _gate(1_024).verdict == "regression" and not _gate(1_024).fails_gate
    assert not _gate(1_024 + 64).fails_gate  # at the edge: storage + band
    assert _gate(1_024 + 65).fails_gate  # 1 MiB beyond it
    assert _gate(2 * 1_024).fails_gate  # twice the storage is not what the rings cost
    assert _gate(500).explained_by is not None  # less than the storage: excused (rings may replace transients)


def test_rings_account_for_a_delta_within_the_band_of_their_storage() -> None:
    # |delta - 1,024 MiB| <= 64 MiB: "the rings account for it"; 65 MiB off: that much below / beyond the storage.
    for delta, expected in ((1_024 + 48, True), (1_024 - 64, True), (1_024 + 65, False), (1_024 - 65, False)):
        seen: list = []
        _gate(delta, explained=seen)
        ((text, ok),) = seen
        assert ok is expected, (delta, text)
        assert ("the rings account for it" in text) is expected
        if not expected:
            side = "below" if delta < 1_024 else "beyond"
            assert f"{abs(delta - 1_024):.0f} MiB {side} the ring storage" in text


def test_gate_excuses_nothing_without_rings() -> None:
    m = _gate(100, slots=0)
    assert m.verdict == "regression" and m.fails_gate


# -- Welch interval with Student's t ------------------------------------------------------------------------

# Student's t, two-sided 95% (the 0.975 quantile), from a printed table.
T975 = {2: 4.302653, 4: 2.776445, 8: 2.306004}


def test_welch_interval_uses_student_t_at_five_samples() -> None:
    # base has no spread, so Welch's df is other's n - 1 = 4 and se^2 = s^2 / n.
    # other = 1..5: mean 3, s^2 = (4 + 1 + 0 + 1 + 4) / 4 = 2.5, se = sqrt(2.5 / 5) = 0.70711.
    lo, hi = mean_diff_interval([0.0] * 5, [1.0, 2.0, 3.0, 4.0, 5.0])
    half = T975[4] * math.sqrt(0.5)  # 1.96322; the normal quantile would give 1.38590
    assert (lo + hi) / 2 == pytest.approx(3.0)
    assert (hi - lo) / 2 == pytest.approx(half, rel=1e-3)


def test_welch_interval_equal_spreads_has_twice_n_minus_one_degrees_of_freedom() -> None:
    # Equal variances and n = 5 a side: df = (2 v)^2 / (2 v^2 / 4) = 8; se^2 = 2 * 2.5 / 5 = 1.
    lo, hi = mean_diff_interval([1.0, 2.0, 3.0, 4.0, 5.0], [11.0, 12.0, 13.0, 14.0, 15.0])
    assert (lo + hi) / 2 == pytest.approx(10.0)
    assert (hi - lo) / 2 == pytest.approx(T975[8] * 1.0, rel=1e-3)


def test_welch_interval_at_three_samples_is_within_one_percent_of_the_t_table() -> None:
    # n = 3 against a constant: df = 2 (the docstring's "within 1% for df >= 2"); s^2 = 1, se = sqrt(1/3).
    lo, hi = mean_diff_interval([5.0] * 3, [1.0, 2.0, 3.0])
    assert (hi - lo) / 2 == pytest.approx(T975[2] / math.sqrt(3), rel=0.01)
    assert mean_diff_interval([5.0] * 2, [1.0, 2.0, 3.0]) is None  # fewer than 3 a side


def test_bootstrap_interval_is_the_central_95_percent_of_resampled_medians() -> None:
    # other = 1..9 against a constant 0: the difference is the median of a 9-draw resample of 1..9.
    # P(median <= k) = P(Bin(9, k/9) >= 5), computed here exactly; the 2.5% / 97.5% quantiles of that
    # distribution are 2 and 8 (a 90% interval would be 3 and 7), each 4.5 sigma of 20,000 resamples away.
    def cdf(k: int) -> float:
        p = k / 9
        return sum(math.comb(9, j) * p**j * (1 - p) ** (9 - j) for j in range(5, 10))

    def quantile(q: float) -> int:
        return next(k for k in range(1, 10) if cdf(k) >= q)

    assert (quantile(0.025), quantile(0.975)) == (2, 8) and (quantile(0.05), quantile(0.95)) == (3, 7)
    lo, hi = bootstrap_diff([0.0] * 9, [float(v) for v in range(1, 10)], stat="median", n_boot=20_000)
    assert (lo, hi) == (2.0, 8.0)


# -- the planner's closed forms against a brute-force schedule written here ----------------------------


def _ref_1f1b_peak(p: int, r: int, m: int) -> int:
    """Most microbatches in flight under 1F1B: min(p - r - 1, m) warm-up forwards, F/B pairs, cool-down."""
    warm = min(p - r - 1, m)
    order = ["F"] * warm
    for _ in range(m - warm):
        order += ["F", "B"]
    order += ["B"] * warm
    live = peak = 0
    for x in order:
        live += 1 if x == "F" else -1
        peak = max(peak, live)
    return peak


def _ref_interleaved_peak(p: int, r: int, m: int, v: int, g: int) -> int:
    """Most forwards in flight, over all chunks, under the interleaved schedule (groups of g microbatches)."""
    table = [(mb, c) for start in range(0, m, g) for c in range(v) for mb in range(start, min(start + g, m))]
    fwd_chunk = [c for _, c in table]
    bwd_chunk = [v - 1 - c for _, c in table]
    warm = min(2 * (p - r - 1) + (v - 1) * g, m * v)
    order = [("F", fwd_chunk[k]) for k in range(warm)]
    for k in range(len(table) - warm):
        order += [("F", fwd_chunk[k + warm]), ("B", bwd_chunk[k])]
    order += [("B", bwd_chunk[k]) for k in range(len(table) - warm, len(table))]
    # One ring shared by every chunk (what install() builds): all forwards in flight count, whatever the chunk.
    live = peak = 0
    for kind, _c in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def _simulated(spec: ScheduleSpec, layers: int) -> int:
    rules = {"dispatch": ReleaseRule(buffer="dispatch", point=ReleasePoint.BACKWARD, reason="")}
    return max(d.peak for d in ring_depths(expand(build_steps(spec), [layers] * spec.vpp, rules)).values())


@pytest.mark.parametrize("p", [3, 4, 8])
def test_1f1b_closed_form_takes_m_when_fewer_microbatches_than_stages_ahead(p: int) -> None:
    layers = 2
    cases = 0
    for r in range(p):
        for m in range(1, p - r):  # m < p - r: the min(m, ...) branch
            spec = ScheduleSpec(kind=ScheduleKind.ONE_F_ONE_B, pp=p, rank=r, microbatches=m)
            expected = layers * _ref_1f1b_peak(p, r, m)
            assert expected == layers * m  # the reference agrees with the docs' reading at m < p - r
            assert closed_form(spec, ReleasePoint.BACKWARD, layers)[0] == expected
            assert _simulated(spec, layers) == expected
            cases += 1
    assert cases == p * (p - 1) // 2


@pytest.mark.parametrize("p", [3, 4, 5])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_closed_form_with_group_p_plus_one(p: int, v: int) -> None:
    g, layers = p + 1, 2
    binding_mv = binding_w = 0
    for r in range(p):
        for m in range(1, 4 * p + 1):
            spec = ScheduleSpec(kind=ScheduleKind.INTERLEAVED, pp=p, rank=r, microbatches=m, vpp=v, group=g)
            expected = layers * _ref_interleaved_peak(p, r, m, v, g)
            assert closed_form(spec, ReleasePoint.BACKWARD, layers)[0] == expected, (p, r, m, v)
            assert _simulated(spec, layers) == expected, (p, r, m, v)
            w = min(2 * (p - r - 1) + (v - 1) * g, m * v)
            binding_mv += m * v < w + 1
            binding_w += w + 1 < m * v
    # Both terms of min(m v, w + 1) decide some of these cases (else a wrong term would pass unnoticed).
    assert binding_mv > 0 and binding_w > 0


def test_interleaved_shared_ring_by_hand() -> None:
    # p = 4, rank 0, v = 2, g = 5, m = 12: w = 2*3 + 1*5 = 11 warm-up forwards, then F before each B:
    # 12 forwards in flight at most, min(m v, w + 1) = min(24, 12) = 12, times 3 layers.
    spec = ScheduleSpec(kind=ScheduleKind.INTERLEAVED, pp=4, rank=0, microbatches=12, vpp=2, group=5)
    assert _ref_interleaved_peak(4, 0, 12, 2, 5) == 12
    assert closed_form(spec, ReleasePoint.BACKWARD, 3)[0] == 36
    assert _simulated(spec, 3) == 36


# -- the allocator model's constants (c10 CUDACachingAllocator) ------------------------------------------


def test_segment_size_boundaries() -> None:
    # <= 1 MiB: a 2 MiB small-pool segment; (1, 10) MiB: 20 MiB; >= 10 MiB: rounded up to 2 MiB.
    assert allocation_size(1 * MiB) == 2 * MiB
    assert allocation_size(1 * MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(10 * MiB + 512) == 12 * MiB


def test_small_and_large_pools_split_at_one_mib() -> None:
    m = AllocatorModel()
    m.malloc(1 * MiB, 0)  # small: a 2 MiB segment, 1 MiB left in the small pool
    assert m.stats.reserved == 2 * MiB
    m.malloc(1 * MiB + 512, 0)  # large: cannot use the small pool's free MiB, a 20 MiB segment
    assert m.stats.reserved == 22 * MiB
    m.malloc(1 * MiB, 0)  # small again: the cached small MiB serves it
    assert m.stats.reserved == 22 * MiB
    # A 2 MiB request is large: its 20 MiB segment's 18 MiB rest stays in the large pool, so a later
    # 1 MiB (small) request cannot use it and opens a 2 MiB small segment: 22 MiB reserved, not 20.
    m2 = AllocatorModel()
    m2.malloc(2 * MiB, 0)
    assert m2.stats.reserved == 20 * MiB
    m2.malloc(1 * MiB, 0)
    assert m2.stats.reserved == 22 * MiB


def test_large_pool_splits_only_when_more_than_one_mib_remains() -> None:
    m = AllocatorModel()
    m.malloc(19 * MiB, 0)  # 20 MiB segment, rest exactly 1 MiB: not split, the block is 20 MiB
    assert m.stats.allocated == 20 * MiB
    m2 = AllocatorModel()
    m2.malloc(19 * MiB - 512, 0)  # rest 1 MiB + 512: split
    assert m2.stats.allocated == 19 * MiB - 512


# -- the log grammar: a fragment never replaces a more complete copy --------------------------------------


def _lm(it: int, ms: float, tflops: float) -> str:
    return (
        f" [2026-01-05 14:03:51.123456] iteration {it:8d}/     100 | consumed samples: {it * 64:12d} |"
        f" elapsed time per iteration (ms): {ms} | throughput per GPU (TFLOP/s/GPU): {tflops} |"
        " learning rate: 1.000000E-04 | global batch size:    64 | lm loss: 6.500000E+00 | loss scale: 1.0 |"
        " grad norm: 0.412 | number of skipped iterations:   0 | number of nan iterations:   0 |"
    )


@pytest.mark.parametrize("order", ["complete_first", "fragment_first"])
def test_fragment_alone_on_its_line_never_replaces_the_complete_copy(order: str) -> None:
    full = _lm(5, 409.7, 200.3)
    # Cut before the throughput field's value; the rest of the line is another rank's unrelated text.
    fragment = full[: full.index("throughput")] + "[default6]: building GPT model ..."
    lines = [full, fragment] if order == "complete_first" else [fragment, full]
    log = parse_log_text(_lm(4, 400.0, 199.0) + "\n" + "\n".join(lines) + "\n")
    rec = next(r for r in log.iterations if r.iteration == 5)
    assert (rec.elapsed_ms, rec.tflops, rec.loss) == (409.7, 200.3, 6.5)
    # Control: the fragment alone is read, with the field it lacks missing (so it is a lesser copy).
    (alone,) = [r for r in parse_log_text(fragment + "\n").iterations if r.iteration == 5]
    assert alone.elapsed_ms == 409.7 and alone.tflops is None


# -- the ring's free-slot choice order (docs/pool.md: cursor if free, else next free in rotation) ----------


def _slot_of(ring: BufferRing, t: torch.Tensor) -> int:
    return next(i for i, s in enumerate(ring._slots) if s.base.data_ptr() == t.data_ptr())


def test_free_slot_order_by_hand() -> None:
    ring = BufferRing("dispatch_output", 5, (4, 2), torch.float32, "cpu")
    held = [ring.acquire() for _ in range(5)]
    assert [_slot_of(ring, t) for t in held] == [0, 1, 2, 3, 4]  # cursor wraps to 0
    ring.release(held[3])
    ring.release(held[1])
    # cursor 0 held: next free in rotation after 0 is 1 (not 3, not the lowest released last)
    a = ring.acquire()
    assert _slot_of(ring, a) == 1 and ring.cursor == 2
    # cursor 2 held: next free after 2 is 3
    b = ring.acquire()
    assert _slot_of(ring, b) == 3 and ring.cursor == 4
    ring.release(held[0])
    ring.release(held[2])
    # cursor 4 held: rotation 0, 1, 2 -> 0 is free
    c = ring.acquire()
    assert _slot_of(ring, c) == 0 and ring.cursor == 1
    ring.release(held[4])
    # cursor 1 held (a): rotation 2 (free)
    assert _slot_of(ring, ring.acquire()) == 2 and ring.cursor == 3


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_free_slot_order_matches_a_reference_over_a_fixed_random_sequence(n: int) -> None:
    rng = random.Random(1234 + n)
    ring = BufferRing("dispatch_output", n, (4, 2), torch.float32, "cpu")
    live: dict[int, torch.Tensor] = {}  # slot -> tensor
    cursor = 0
    checked = 0
    for _ in range(3_000):
        if live and (len(live) == n or rng.random() < 0.45):
            slot = rng.choice(sorted(live))
            ring.release(live.pop(slot))
            continue
        want = next(i for i in [(cursor + k) % n for k in range(n)] if i not in live)
        t = ring.acquire()
        assert _slot_of(ring, t) == want
        live[want] = t
        cursor = (want + 1) % n
        assert ring.cursor == cursor
        checked += 1
    assert checked > 1_000
