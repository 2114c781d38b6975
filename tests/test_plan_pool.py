"""The planner's minimum is the smallest slot count real pool rings run the schedule with (CPU tensors).

The ring's state machine (held slots, EarlyReuseError) runs on the host, so CPU tensors exercise exactly
what decides the depth; tests/test_plan_gpu.py runs the same table on CUDA with two streams.
"""

from __future__ import annotations

import pytest
from plan_drive import CASES, drive

from bufreuse.plan.depth import ring_depths
from bufreuse.plan.hazards import find_hazards
from bufreuse.pool import EarlyReuseError


def _minimums(ops):
    out: dict[str, int] = {}
    for (buf, _), d in ring_depths(ops).items():
        out[buf] = max(out.get(buf, 0), d.peak)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_planned_minimum_runs_and_one_fewer_raises(case):
    ops = case.ops()
    need = _minimums(ops)
    assert drive(ops, need) == need  # the rings' peak held equals the plan
    for buf, n in need.items():
        if n == 1:
            continue
        short = {**need, buf: n - 1}
        with pytest.raises(EarlyReuseError) as info:
            drive(ops, short)
        assert info.value.ring == {"dispatch": "dispatch_output", "expert": "expert_fc2_output"}[buf]
        assert info.value.min_depth == n
        assert find_hazards(ops, short).ok is not case.cycle_below  # a cycle: a GPU-waiting ring would hang


def test_planned_minimum_runs_in_debug_mode_too():
    for case in CASES:
        ops = case.ops()
        need = _minimums(ops)
        assert drive(ops, need, debug=True) == need
