"""Minimum safe slots: the simulation against the closed forms of bufreuse.plan.depth (and the issue's checks)."""

from __future__ import annotations

import pytest

from bufreuse.plan.depth import ALL_CHUNKS, closed_form, grows_with, pending_at, ring_depths
from bufreuse.plan.ops import expand
from bufreuse.plan.rules import ReleasePoint, ReleaseRule
from bufreuse.plan.schedule import ScheduleKind, ScheduleSpec, build_steps
from bufreuse.plan.slots import proxy_minimum, proxy_ops

K, P = ScheduleKind, ReleasePoint


def _rules(point, buffer="dispatch"):
    return {buffer: ReleaseRule(buffer=buffer, point=point, reason="")}


def _minimum(spec, point, layers, *, buffer="dispatch", recompute=False):
    rules = {buffer: ReleaseRule(buffer=buffer, point=point, reason="", recompute=recompute)}
    depths = ring_depths(expand(build_steps(spec), [layers] * spec.vpp, rules))
    return max(d.peak for d in depths.values())


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("layers", [1, 3])
def test_1f1b_backward_release_needs_layers_times_p_minus_r(p, layers):
    for r in range(p):
        for m in (p, p + 3, 3 * p):
            spec = ScheduleSpec(kind=K.ONE_F_ONE_B, pp=p, rank=r, microbatches=m)
            assert _minimum(spec, P.BACKWARD, layers) == layers * (p - r)


@pytest.mark.parametrize(
    "spec",
    [
        ScheduleSpec(kind=K.NONE, microbatches=6),
        ScheduleSpec(kind=K.ONE_F_ONE_B, pp=4, rank=0, microbatches=8),
        ScheduleSpec(kind=K.INTERLEAVED, pp=4, rank=0, microbatches=8, vpp=2),
        ScheduleSpec(kind=K.COMBINED, microbatches=6),
        ScheduleSpec(kind=K.COMBINED, pp=4, rank=1, microbatches=8, vpp=2),
    ],
)
@pytest.mark.parametrize("buffer", ["dispatch", "expert"])
def test_forward_release_needs_one_slot(spec, buffer):
    assert _minimum(spec, P.FORWARD, 4, buffer=buffer) == 1


def test_backward_release_without_pipelining_needs_one_slot_per_layer():
    assert _minimum(ScheduleSpec(kind=K.NONE, microbatches=5), P.BACKWARD, 3) == 3


def test_combined_pp1_wgrad_release_needs_one_more_than_backward():
    spec = ScheduleSpec(kind=K.COMBINED, microbatches=5)
    assert _minimum(spec, P.BACKWARD, 3) == 3
    assert _minimum(spec, P.WGRAD, 3) == 4


def test_recompute_keeps_the_ring_at_one_slot_with_backward_release():
    spec = ScheduleSpec(kind=K.ONE_F_ONE_B, pp=4, rank=0, microbatches=8)
    assert _minimum(spec, P.BACKWARD, 3, recompute=True) == 1


@pytest.mark.parametrize("kind", [K.INTERLEAVED, K.COMBINED])
@pytest.mark.parametrize("p,v", [(2, 2), (3, 3), (4, 2), (4, 4), (8, 2)])
def test_interleaved_and_combined_backward_match_the_closed_form(kind, p, v):
    for r in range(p):
        for m in (p, 2 * p, 3 * p + 1):
            for layers in (1, 2):
                spec = ScheduleSpec(kind=kind, pp=p, rank=r, microbatches=m, vpp=v)
                want, formula = closed_form(spec, P.BACKWARD, layers)
                assert _minimum(spec, P.BACKWARD, layers) == want, (p, v, r, m, layers, formula)


def test_interleaved_rank0_shared_ring_holds_every_warmup_forward_plus_one():
    p, layers = 4, 2
    for v in (2, 3, 4):
        spec = ScheduleSpec(kind=K.INTERLEAVED, pp=p, rank=0, microbatches=16, vpp=v)
        warmup = 2 * (p - 1) + (v - 1) * p  # megatron's interleaved warm-up on rank 0, m v >= it
        assert _minimum(spec, P.BACKWARD, layers) == layers * (warmup + 1)
        per_chunk = ring_depths(expand(build_steps(spec), [layers] * v, _rules(P.BACKWARD)), per_chunk=True)
        assert max(d.peak for d in per_chunk.values()) == layers * 2 * p  # a pool per chunk: chunk 0's share


def test_interleaved_minimum_stops_growing_with_microbatches():
    by_m = {
        m: _minimum(ScheduleSpec(kind=K.INTERLEAVED, pp=4, microbatches=m, vpp=2), P.BACKWARD, 1) for m in (4, 8, 16)
    }
    # every virtual microbatch in flight (m v = 8) until the warm-up (10) + 1 caps it
    assert by_m == {4: 8, 8: 11, 16: 11}
    assert not grows_with(by_m)
    assert grows_with({4: 4, 8: 8})


def test_closed_form_names_what_the_minimum_grows_with():
    spec = ScheduleSpec(kind=K.ONE_F_ONE_B, pp=4, microbatches=8)
    assert closed_form(spec, P.BACKWARD, 2) == (8, "L x min(m, p - r)")
    assert closed_form(spec, P.FORWARD, 2) == (1, "1")
    assert closed_form(ScheduleSpec(kind=K.COMBINED, pp=2, microbatches=4, vpp=2), P.WGRAD, 1) is None
    with pytest.raises(ValueError):
        closed_form(spec, P.REFUSED, 2)


def test_shared_ring_and_per_chunk_rings():
    spec = ScheduleSpec(kind=K.INTERLEAVED, pp=4, rank=3, microbatches=8, vpp=2)
    ops = expand(build_steps(spec), [1, 1], _rules(P.BACKWARD))
    assert {c: d.peak for (_, c), d in ring_depths(ops, per_chunk=True).items()} == {0: 5, 1: 1}
    assert {c: d.peak for (_, c), d in ring_depths(ops).items()} == {ALL_CHUNKS: 5}
    spec = ScheduleSpec(kind=K.INTERLEAVED, pp=2, rank=0, microbatches=4, vpp=2)
    ops = expand(build_steps(spec), [1, 1], _rules(P.BACKWARD))
    chunks = {c: d.peak for (_, c), d in ring_depths(ops, per_chunk=True).items()}
    shared = ring_depths(ops)["dispatch", ALL_CHUNKS].peak
    assert max(chunks.values()) < shared <= sum(chunks.values())  # chunks hold slots at the same time


def test_proxy_dispatch_ring_holds_two_and_expert_ring_one():
    depths = ring_depths(proxy_ops(6))
    assert {b: d.peak for (b, _), d in depths.items()} == {"dispatch": 2, "expert": 1}
    assert proxy_minimum(6) == 2
    assert proxy_minimum(1) == 1
    assert proxy_minimum(6, ["expert"]) == 1


def test_control_pending_counts_releases_within_the_lag_at_the_activation_peak():
    spec = ScheduleSpec(kind=K.ONE_F_ONE_B, pp=4, rank=0, microbatches=8)
    rules = {"dispatch": ReleaseRule(buffer="dispatch", point=P.FORWARD, reason="")}
    ops = expand(build_steps(spec), [3], rules)
    # The activation peak is first reached after F3 (warm-up F0..F2, then F3 before B0).
    assert pending_at(ops, "dispatch", 1) == (3, 3)  # F3's three layers
    assert pending_at(ops, "dispatch", 2) == (6, 3)  # F2 and F3
    assert pending_at(ops, "dispatch", 3) == (9, 3)
    assert pending_at([], "dispatch", 2) == (0, 0)
