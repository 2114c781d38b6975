"""The planner: slot depth of each ring from the schedule, before the run (torch-free).

``schedule`` (Megatron's pipeline orders on one rank), ``rules`` (where each buffer is released: the one
table the integration reads too), ``ops`` (the schedule as stream operations), ``depth`` (minimum safe
slots), ``hazards`` (happens-before graph over streams and its cycles) and ``report`` (what
``bufreuse plan`` prints). Imports nothing above ``bufreuse.config`` and ``bufreuse.errors``. See docs/plan.md.
"""

from __future__ import annotations

from bufreuse.plan.depth import RingDepth, closed_form, pending_at, ring_depths
from bufreuse.plan.hazards import Cycle, HazardReport, find_hazards
from bufreuse.plan.ops import COMM, COMPUTE, Op, expand
from bufreuse.plan.report import (
    ASSUMPTIONS,
    BufferPlan,
    PlanReport,
    initial_slots,
    moe_layers_per_chunk,
    plan_config,
    plan_schedule,
    schedule_of,
)
from bufreuse.plan.rules import ReleasePoint, ReleaseRule, dispatch_path, moe_recompute, release_rule, release_rules
from bufreuse.plan.schedule import (
    Pass,
    ScheduleKind,
    ScheduleSpec,
    Step,
    build_steps,
    interleaved_table,
    warmup_forwards,
)
from bufreuse.plan.slots import resolve_slot_spec

__all__ = [
    "ASSUMPTIONS",
    "COMM",
    "COMPUTE",
    "BufferPlan",
    "Cycle",
    "HazardReport",
    "Op",
    "Pass",
    "PlanReport",
    "ReleasePoint",
    "ReleaseRule",
    "RingDepth",
    "ScheduleKind",
    "ScheduleSpec",
    "Step",
    "build_steps",
    "closed_form",
    "dispatch_path",
    "expand",
    "find_hazards",
    "initial_slots",
    "interleaved_table",
    "moe_layers_per_chunk",
    "moe_recompute",
    "pending_at",
    "plan_config",
    "plan_schedule",
    "release_rule",
    "release_rules",
    "resolve_slot_spec",
    "ring_depths",
    "schedule_of",
    "warmup_forwards",
]
