"""The schedule model: Megatron's orders on one rank, checked against megatron-core's own functions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bufreuse.errors import InputError
from bufreuse.plan.schedule import (
    Pass,
    ScheduleKind,
    ScheduleSpec,
    Step,
    build_steps,
    interleaved_table,
    warmup_forwards,
)

K = ScheduleKind


def _spec(kind, **kw):
    return ScheduleSpec(kind=kind, **kw)


def test_no_pipelining_runs_forward_then_backward_per_microbatch():
    steps = build_steps(_spec(K.NONE, microbatches=2))
    assert steps == [
        Step(forward=Pass(0, 0)),
        Step(backward=Pass(0, 0)),
        Step(forward=Pass(1, 0)),
        Step(backward=Pass(1, 0)),
    ]


def test_1f1b_warms_up_p_minus_r_minus_1_forwards():
    steps = build_steps(_spec(K.ONE_F_ONE_B, pp=4, rank=1, microbatches=5))
    kinds = ["F" if s.forward else "B" for s in steps]
    assert kinds == ["F", "F", "F", "B", "F", "B", "F", "B", "B", "B"]
    assert [s.backward.microbatch for s in steps if s.backward] == [0, 1, 2, 3, 4]


def test_1f1b_warmup_is_capped_at_the_microbatches():
    assert warmup_forwards(_spec(K.ONE_F_ONE_B, pp=8, rank=0, microbatches=3)) == 3


def test_every_forward_has_its_backward_in_every_schedule():
    for spec in (
        _spec(K.NONE, microbatches=5),
        _spec(K.ONE_F_ONE_B, pp=4, rank=0, microbatches=7),
        _spec(K.INTERLEAVED, pp=4, rank=2, microbatches=8, vpp=3),
        _spec(K.COMBINED, microbatches=4),
        _spec(K.COMBINED, pp=2, rank=1, microbatches=6, vpp=2),
    ):
        steps = build_steps(spec)
        fwd = [s.forward for s in steps if s.forward]
        bwd = [s.backward for s in steps if s.backward]
        assert sorted(fwd, key=lambda p: (p.chunk, p.microbatch)) == sorted(bwd, key=lambda p: (p.chunk, p.microbatch))
        assert len(fwd) == spec.microbatches * spec.vpp
        done: set[Pass] = set()
        for s in steps:  # a backward never precedes its forward
            if s.forward:
                done.add(s.forward)
            if s.backward:
                assert s.backward in done


def test_interleaved_backward_runs_the_mirrored_chunk():
    steps = build_steps(_spec(K.INTERLEAVED, pp=2, rank=1, microbatches=4, vpp=2))
    first_b = next(s.backward for s in steps if s.backward)
    assert first_b == Pass(0, 1)  # get_model_chunk_id(0, forward=False) = v - 1 - 0


def test_combined_pp1_pairs_forward_i_plus_1_with_backward_i():
    steps = build_steps(_spec(K.COMBINED, microbatches=3))
    assert steps[0] == Step(forward=Pass(0, 0))
    assert steps[1] == Step(forward=Pass(1, 0), backward=Pass(0, 0))
    assert steps[-1] == Step(backward=Pass(2, 0))


def test_combined_needs_vpp_with_pipelining():
    with pytest.raises(InputError, match="virtual_pipeline_model_parallel_size"):
        _spec(K.COMBINED, pp=2, microbatches=4)


def test_bad_rank_is_rejected():
    with pytest.raises(InputError, match="rank=4"):
        _spec(K.ONE_F_ONE_B, pp=4, rank=4, microbatches=4)


@pytest.fixture(scope="module")
def megatron_schedules():
    return pytest.importorskip("megatron.core.pipeline_parallel.schedules")


@pytest.mark.parametrize("m,v,g", [(5, 2, 3), (8, 2, 4), (8, 3, 4), (7, 4, 2), (16, 2, 4)])
def test_interleaved_table_matches_megatron_get_schedule_table(megatron_schedules, m, v, g):
    assert interleaved_table(m, v, g) == list(megatron_schedules.get_schedule_table(m, v, g))


@pytest.mark.parametrize("overlap", [False, True])
def test_warmup_matches_megatron_get_pp_rank_microbatches(megatron_schedules, overlap):
    for p, v, m in ((4, 2, 8), (4, 3, 8), (8, 2, 16), (2, 4, 4), (4, 2, 3)):
        for r in range(p):
            comm = SimpleNamespace(
                pp_group=SimpleNamespace(size=lambda p=p: p, rank=lambda r=r: r), virtual_pipeline_model_parallel_size=v
            )
            _, _, want, _ = megatron_schedules.get_pp_rank_microbatches(
                m, v, p, overlap_moe_expert_parallel_comm=overlap, p2p_communicator=comm
            )
            kind = K.COMBINED if overlap else K.INTERLEAVED
            assert warmup_forwards(_spec(kind, pp=p, rank=r, microbatches=m, vpp=v)) == want, (p, v, m, r)


def test_1f1b_warmup_matches_megatron_get_pp_rank_microbatches(megatron_schedules):
    for p, m in ((4, 8), (8, 3), (2, 2)):
        for r in range(p):
            comm = SimpleNamespace(
                pp_group=SimpleNamespace(size=lambda p=p: p, rank=lambda r=r: r),
                virtual_pipeline_model_parallel_size=None,
            )
            _, _, want, _ = megatron_schedules.get_pp_rank_microbatches(m, 1, p, p2p_communicator=comm)
            assert warmup_forwards(_spec(K.ONE_F_ONE_B, pp=p, rank=r, microbatches=m)) == want
