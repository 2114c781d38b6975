"""The happens-before graph: a ring too shallow for the schedule closes a cycle over the two streams."""

from __future__ import annotations

import pytest

from bufreuse.plan.depth import ring_depths
from bufreuse.plan.hazards import find_hazards
from bufreuse.plan.ops import COMM, COMPUTE, expand
from bufreuse.plan.rules import ReleasePoint, ReleaseRule
from bufreuse.plan.schedule import ScheduleKind, ScheduleSpec, build_steps

K, P = ScheduleKind, ReleasePoint


def _ops(spec, point, layers=1, expert=P.FORWARD):
    rules = {
        "dispatch": ReleaseRule(buffer="dispatch", point=point, reason=""),
        "expert": ReleaseRule(buffer="expert", point=expert, reason=""),
    }
    return expand(build_steps(spec), [layers] * spec.vpp, rules)


def test_1f1b_deadlocks_one_slot_below_the_minimum_and_runs_at_it():
    ops = _ops(ScheduleSpec(kind=K.ONE_F_ONE_B, pp=3, rank=0, microbatches=4), P.BACKWARD)
    assert find_hazards(ops, {"dispatch": 3, "expert": 1}).ok
    report = find_hazards(ops, {"dispatch": 2, "expert": 1})
    assert not report.ok
    cycle = report.cycles[0]
    assert (cycle.ring, cycle.slot) == ("dispatch_output", 0)
    assert cycle.waiter.name == "dispatch.fwd" and cycle.waiter.microbatch == 2
    assert cycle.holder.name == "experts.bwd" and cycle.holder.microbatch == 0
    assert cycle.streams == [COMM, COMPUTE]
    text = cycle.describe()
    assert "ring 'dispatch_output'" in text and "slot 0" in text and "comm and compute" in text


@pytest.mark.parametrize(
    "spec,point,layers",
    [
        (ScheduleSpec(kind=K.NONE, microbatches=3), P.BACKWARD, 3),
        (ScheduleSpec(kind=K.INTERLEAVED, pp=2, rank=0, microbatches=4, vpp=2), P.BACKWARD, 2),
        (ScheduleSpec(kind=K.COMBINED, microbatches=4), P.WGRAD, 2),
        (ScheduleSpec(kind=K.COMBINED, pp=2, rank=0, microbatches=4, vpp=2), P.BACKWARD, 1),
    ],
)
def test_cycle_appears_exactly_below_the_planned_minimum(spec, point, layers):
    ops = _ops(spec, point, layers)
    need = max(d.peak for (b, _), d in ring_depths(ops).items() if b == "dispatch")
    assert find_hazards(ops, {"dispatch": need, "expert": 1}).ok
    assert not find_hazards(ops, {"dispatch": need - 1, "expert": 1}).ok


def test_expert_ring_cycle_runs_from_compute_to_comm():
    ops = _ops(ScheduleSpec(kind=K.ONE_F_ONE_B, pp=2, rank=0, microbatches=3), P.FORWARD, expert=P.BACKWARD)
    report = find_hazards(ops, {"dispatch": 1, "expert": 1})
    assert [c.ring for c in report.cycles] == ["expert_fc2_output"]
    assert report.cycles[0].waiter.stream == COMPUTE and report.cycles[0].holder.stream == COMM
    assert find_hazards(ops, {"dispatch": 1, "expert": 2}).ok


def test_stream_ordered_policy_never_cycles():
    ops = _ops(ScheduleSpec(kind=K.ONE_F_ONE_B, pp=4, rank=0, microbatches=8), P.BACKWARD, 2)
    report = find_hazards(
        ops, {"dispatch": 0, "expert": 0}, policies={"dispatch": "stream-ordered", "expert": "stream-ordered"}
    )
    assert report.ok and report.edges > len(ops)


def test_every_cycle_is_listed_when_asked():
    ops = _ops(ScheduleSpec(kind=K.ONE_F_ONE_B, pp=4, rank=0, microbatches=8), P.BACKWARD)
    assert len(find_hazards(ops, {"dispatch": 2, "expert": 1}, first_only=False).cycles) > 1
    d = find_hazards(ops, {"dispatch": 2, "expert": 1}).to_dict()
    assert d["ok"] is False and d["cycles"][0]["streams"] == ["comm", "compute"]


def test_deadlock_demo_schedule_is_predicted_at_slot_zero():
    from script_module import load_script

    demo = load_script("plan_deadlock_demo")
    ops = demo.planned_ops()
    assert max(d.peak for d in ring_depths(ops).values()) == 3
    cycle = find_hazards(ops, {"dispatch": 2}).cycles[0]
    assert (cycle.ring, cycle.slot, cycle.waiter.microbatch) == ("dispatch_output", 0, 2)
    assert find_hazards(ops, {"dispatch": 3}).ok
