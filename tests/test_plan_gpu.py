"""GPU checks of the planner (H200: ``bash scripts/gpu-tests.sh tests/test_plan_gpu.py``).

(a) the pool-vs-planner table of tests/test_plan_pool.py on CUDA, two streams, producers writing slots;
(b) scripts/plan_deadlock_demo.py: below the planned depth a GPU-waiting ring hangs and the pool's watchdog
    names the ring and slot the planner predicted; at the planned depth it completes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plan_drive import CASES, drive

from bufreuse.plan.depth import ring_depths
from bufreuse.pool import EarlyReuseError

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_planned_minimum_runs_on_cuda_and_one_fewer_raises(case):
    ops = case.ops()
    need: dict[str, int] = {}
    for (buf, _), d in ring_depths(ops).items():
        need[buf] = max(need.get(buf, 0), d.peak)
    assert drive(ops, need, "cuda") == need
    for buf, n in need.items():
        if n > 1:
            with pytest.raises(EarlyReuseError) as info:
                drive(ops, {**need, buf: n - 1}, "cuda")
            assert info.value.min_depth == n


def _demo(slots: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plan_deadlock_demo.py"), "--slots", str(slots), "--watchdog-s", "2"],
        capture_output=True, text=True, timeout=180, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gpu_waiting_ring_hangs_below_the_plan_and_the_watchdog_names_the_slot():
    out = _demo(2)
    assert out["planner_minimum"] == 3
    cycle = out["planner_cycle"]
    assert cycle["ring"] == "dispatch_output" and cycle["streams"] == ["comm", "compute"]
    assert out["completed"] is False
    assert out["watchdog_reports"], "the watchdog reported nothing"
    report = out["watchdog_reports"][0]
    assert "ring 'dispatch_output'" in report and f"slot {cycle['slot']}," in report
    assert "ring 'dispatch_output'" in out["pool_error"] and "needs at least 3 slots" in out["pool_error"]


def test_gpu_waiting_ring_completes_at_the_planned_depth():
    out = _demo(3)
    assert out["planner_cycle"] is None and out["pool_error"] is None
    assert out["completed"] is True and out["watchdog_reports"] == []
