"""The order of forward and backward passes on one pipeline rank, for Megatron's schedules.

A schedule is a list of :class:`Step`: a step runs one forward pass, one backward pass, or (combined
1F1B) one forward overlapped with one backward, each of one (microbatch, model chunk). The orders
follow megatron-core's ``megatron/core/pipeline_parallel/schedules.py``:

- ``none``: ``forward_backward_no_pipelining`` -- F0 B0 F1 B1 ...
- ``1f1b``: ``forward_backward_pipelining_without_interleaving`` -- ``min(p - r - 1, m)`` warm-up forwards,
  then steady pairs (forward of ``w + i`` then backward of ``i``), then the cool-down backwards.
- ``interleaved``: ``forward_backward_pipelining_with_interleaving`` -- virtual microbatch ``k`` maps to
  ``(microbatch, chunk)`` through ``get_schedule_table(m, v, g)`` (groups of ``g =
  microbatch_group_size_per_vp_stage`` microbatches visit every chunk in turn); the backward of virtual
  id ``k`` runs chunk ``v - 1 - chunk(k)`` (``get_model_chunk_id(k, forward=False)``); the warm-up count is
  ``get_pp_rank_microbatches``: ``2 (p - r - 1) + (v - 1) g`` (+1 with EP overlap), capped at ``m v``.
- ``combined``: ``overlap_moe_expert_parallel_comm``. With PP = 1, ``combined_1f1b_schedule_for_no_pipelining``:
  F0, then (F(i+1) with B(i)), then B(m-1). With PP > 1 (megatron requires VPP then), the interleaved order
  with one extra warm-up forward, every steady step an overlapped pair
  (``combined_1f1b_schedule_for_interleaved_pipelining``).

Pure Python, no torch: ``bufreuse plan`` runs on a laptop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from bufreuse.errors import InputError

__all__ = [
    "Pass",
    "ScheduleKind",
    "ScheduleSpec",
    "Step",
    "build_steps",
    "interleaved_table",
    "warmup_forwards",
]


class ScheduleKind(enum.Enum):
    """Which Megatron pipeline schedule runs on the rank."""

    NONE = "none"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    COMBINED = "combined"


@dataclass(frozen=True, slots=True)
class Pass:
    """One forward or backward pass of one microbatch through one model chunk."""

    microbatch: int
    chunk: int


@dataclass(frozen=True, slots=True)
class Step:
    """What the rank runs at one point of the schedule; both set = a combined-1F1B overlapped pair."""

    forward: Pass | None = None
    backward: Pass | None = None


@dataclass(kw_only=True, slots=True)
class ScheduleSpec:
    """The schedule of one pipeline rank."""

    kind: ScheduleKind
    """The schedule family."""
    pp: int = 1
    """Pipeline stages ``p``."""
    rank: int = 0
    """This rank's pipeline stage ``r`` (0 = first)."""
    microbatches: int = 1
    """Microbatches per iteration ``m``."""
    vpp: int = 1
    """Model chunks per rank ``v`` (virtual pipeline size; 1 without interleaving)."""
    group: int | None = None
    """``microbatch_group_size_per_vp_stage`` (Megatron's default: ``p``)."""

    def __post_init__(self) -> None:
        bad = []
        for name in ("pp", "microbatches", "vpp"):
            if getattr(self, name) < 1:
                bad.append(f"{name}={getattr(self, name)} (must be >= 1)")
        if not 0 <= self.rank < max(self.pp, 1):
            bad.append(f"rank={self.rank} (must be in 0..{self.pp - 1})")
        if self.group is not None and self.group < 1:
            bad.append(f"group={self.group} (must be >= 1)")
        if self.kind is ScheduleKind.INTERLEAVED and self.vpp < 2:
            bad.append("interleaved needs vpp >= 2 (virtual_pipeline_model_parallel_size)")
        if self.kind in (ScheduleKind.NONE, ScheduleKind.ONE_F_ONE_B) and self.vpp != 1:
            bad.append(f"{self.kind.value} runs one model chunk (vpp=1), got vpp={self.vpp}")
        if self.kind is ScheduleKind.NONE and self.pp != 1:
            bad.append("schedule 'none' is the PP = 1 schedule")
        if self.kind is ScheduleKind.COMBINED and self.pp > 1 and self.vpp < 2:
            bad.append(
                "combined-1F1B with pipeline_model_parallel_size > 1 needs virtual_pipeline_model_parallel_size "
                "(megatron-core asserts it)"
            )
        if bad:
            raise InputError("invalid schedule: " + "; ".join(bad))

    @property
    def microbatch_group(self) -> int:
        return self.group if self.group is not None else self.pp


def warmup_forwards(spec: ScheduleSpec) -> int:
    """Forward passes before the first backward on this rank (megatron's ``num_warmup_microbatches``)."""
    kind, p, r, m, v = spec.kind, spec.pp, spec.rank, spec.microbatches, spec.vpp
    if kind is ScheduleKind.NONE:
        return 0
    if kind is ScheduleKind.ONE_F_ONE_B:
        return min(p - r - 1, m)
    if kind is ScheduleKind.COMBINED and p == 1:
        return 1  # F0 runs alone before the first overlapped pair
    w = 2 * (p - r - 1) + (v - 1) * spec.microbatch_group
    if kind is ScheduleKind.COMBINED:
        w += 1
    return min(w, m * v)


def interleaved_table(microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """``(microbatch, chunk)`` per virtual microbatch id, as megatron's ``get_schedule_table``."""
    table: list[tuple[int, int]] = []
    for start in range(0, microbatches, group):
        end = microbatches if start + group >= microbatches else start + group
        table.extend((mb, c) for c in range(chunks) for mb in range(start, end))
    return table


def build_steps(spec: ScheduleSpec) -> list[Step]:
    """The rank's steps in program order for one iteration (training: every forward has its backward)."""
    m = spec.microbatches
    if spec.kind is ScheduleKind.NONE:
        return [s for i in range(m) for s in (Step(forward=Pass(i, 0)), Step(backward=Pass(i, 0)))]
    if spec.kind is ScheduleKind.COMBINED and spec.pp == 1:
        steps = [Step(forward=Pass(0, 0))]
        steps += [Step(forward=Pass(i + 1, 0), backward=Pass(i, 0)) for i in range(m - 1)]
        return [*steps, Step(backward=Pass(m - 1, 0))]
    if spec.kind is ScheduleKind.ONE_F_ONE_B:
        fwd = [Pass(i, 0) for i in range(m)]
        bwd = fwd
    else:
        v = spec.vpp
        table = interleaved_table(m, v, spec.microbatch_group)
        fwd = [Pass(mb, c) for mb, c in table]
        bwd = [Pass(mb, v - 1 - c) for mb, c in table]
    w = warmup_forwards(spec)
    total = len(fwd)
    steps = [Step(forward=fwd[k]) for k in range(w)]
    overlapped = spec.kind is ScheduleKind.COMBINED
    for k in range(total - w):
        if overlapped:
            steps.append(Step(forward=fwd[k + w], backward=bwd[k]))
        else:
            steps += [Step(forward=fwd[k + w]), Step(backward=bwd[k])]
    steps += [Step(backward=bwd[k]) for k in range(total - w, total)]
    return steps
