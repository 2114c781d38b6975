"""``bufreuse plan``: the minimum slots of each ring for a Megatron config, what they hold, what they save.

:func:`plan_config` reads the schedule (PP, VPP, microbatch group, EP overlap), the MoE layers per model
chunk and the release rules from a flat Megatron mapping (``bufreuse.config.load_megatron_file`` +
field aliases), runs the rank's schedule (:mod:`~bufreuse.plan.schedule`, :mod:`~bufreuse.plan.ops`) and
returns per buffer the minimum (:mod:`~bufreuse.plan.depth`), the persistent bytes, the control's
pending-free estimate, and -- when the configured slots are fewer -- the cycle the GPU would be stuck in
(:mod:`~bufreuse.plan.hazards`). :func:`plan_schedule` is the same for an explicit schedule (the sweep's
proxy). Assumptions are listed in :data:`ASSUMPTIONS` and in every report.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from bufreuse import limits
from bufreuse.config import (
    AUTO,
    BUFFERS,
    BufReuseConfig,
    TorchAssumption,
    static_bounds,
    tokens_per_microbatch,
    unused_rings,
)
from bufreuse.errors import InputError
from bufreuse.plan.depth import ALL_CHUNKS, closed_form, pending_at, ring_depths
from bufreuse.plan.hazards import Cycle, find_hazards
from bufreuse.plan.ops import expand
from bufreuse.plan.rules import ReleasePoint, ReleaseRule, dispatch_path, release_rules
from bufreuse.plan.schedule import ScheduleKind, ScheduleSpec, build_steps, warmup_forwards

__all__ = [
    "ASSUMPTIONS",
    "BufferPlan",
    "PlanReport",
    "initial_slots",
    "moe_layers_per_chunk",
    "plan_config",
    "plan_schedule",
    "schedule_of",
]

ASSUMPTIONS = (
    "one ring per buffer on the rank, shared by the MoE layers of every model chunk, as install() and "
    "bufreuse-megatron register it (one pool per rank)",
    "the ring's slots are the static bound (check-config's rows x hidden x element size)",
    "control pending-free = releases in the last `lag_steps` schedule steps before the max-active point, the "
    "step with the most forward passes in flight (the GPU trails the host by that many steps; the control's "
    "blocks are bound-sized)",
    "layers are split evenly over pipeline stages and model chunks (no uneven first/last stage)",
)


@dataclass(kw_only=True, slots=True)
class BufferPlan:
    """The plan of one buffer's ring."""

    buffer: str
    ring: str
    rule: ReleaseRule
    configured: int | str
    """Configured slots, or ``"auto"``."""
    minimum: int | None
    """Minimum safe slots of the rank's ring, every chunk's layers together (None when refused)."""
    per_chunk: dict[int, int] = field(default_factory=dict)
    """Each model chunk's own peak (what a pool per chunk would need in each of its rings)."""
    formula: str | None = None
    """Closed form of the minimum (``"1"``: constant; names L, m, p - r otherwise), None if simulated only."""
    slot_bytes: int = 0
    rings: int = 1
    """Rings of this buffer on the rank: one, shared by every model chunk."""
    pending_count: int = 0
    """Bound-sized buffers the control keeps pending-free at the max-active point (model: ASSUMPTIONS). For an
    unused ring it is still the model's figure (every buffer record_stream'ed), which the rule's verdict
    (:attr:`verdict`) contradicts: nothing of it waits there."""
    pending_step: int = 0
    """Schedule step of that max-active point."""
    cycle: Cycle | None = None
    """Where the GPU would be stuck with the configured slots (None: runs)."""
    unused: str | None = None
    """Why ``install()`` registers no ring for this buffer (:func:`bufreuse.config.unused_rings`), else None."""

    @property
    def ok(self) -> bool:
        if self.unused:
            return True  # install() registers no ring: no slot count can be short
        if self.minimum is None:
            return False
        return self.configured == AUTO or int(self.configured) >= self.minimum

    @property
    def constant(self) -> bool:
        return self.formula == "1"

    @property
    def persistent_bytes(self) -> int:
        """Bytes the rank's ring of this buffer holds at the minimum (minimum x slot bytes); 0 when unused."""
        if self.unused:
            return 0
        return (self.minimum or 0) * self.slot_bytes * self.rings

    @property
    def pending_bytes(self) -> int:
        return self.pending_count * self.slot_bytes

    @property
    def verdict(self) -> str:
        """The stream rule's word on this ring: ``used``, or ``stands down: <why>`` (install() hooks nothing)."""
        return f"stands down: {self.unused}" if self.unused else "used"

    def to_dict(self) -> dict[str, Any]:
        return {
            "buffer": self.buffer,
            "ring": self.ring,
            "release": self.rule.to_dict(),
            "configured": self.configured,
            "minimum": self.minimum,
            "per_chunk": {str(k): v for k, v in self.per_chunk.items()},
            "formula": self.formula,
            "constant": self.constant,
            "ok": self.ok,
            "slot_bytes": self.slot_bytes,
            "rings": self.rings,
            "persistent_bytes": self.persistent_bytes,
            "control_pending_count": self.pending_count,
            "control_pending_bytes": self.pending_bytes,
            "control_pending_step": self.pending_step,
            "cycle": None if self.cycle is None else self.cycle.to_dict(),
            "unused": self.unused,
            "verdict": self.verdict,
        }


@dataclass(kw_only=True, slots=True)
class PlanReport:
    """Everything ``bufreuse plan`` prints."""

    spec: ScheduleSpec
    layers_per_chunk: list[int]
    buffers: list[BufferPlan]
    tokens: int | None = None
    path: str | None = None
    lag_steps: int = 2
    bound_sources: dict[str, str] = field(default_factory=dict)
    """Where each buffer's slot bound comes from (``BufferBound.source``: dropless worst case, capacity, ...)."""
    assumptions: tuple[str, ...] = ASSUMPTIONS

    @property
    def ok(self) -> bool:
        return all(b.ok for b in self.buffers)

    @property
    def storage_bytes(self) -> int:
        """Bytes the rank's used rings hold at the planned minimum (unused rings hold none)."""
        return sum(b.persistent_bytes for b in self.buffers)

    def storage_line(self) -> str | None:
        """``ring storage per rank: X MiB (...)``, naming each used ring's slots x slot size and its bound.

        None when the slot size is unknown (no tokens per microbatch). A bound sized for the dropless worst case
        (every token of every EP rank routed here) is named as such: that is what the slots cost, not the
        tokens a rank really receives.
        """
        used = [b for b in self.buffers if not b.unused and b.minimum is not None]
        if any(not b.slot_bytes for b in used) or (not used and not self.buffers):
            return None
        if not used:
            return (
                "ring storage per rank: 0 MiB (no ring is used: "
                + "; ".join(f"{b.ring}: {b.unused}" for b in self.buffers if b.unused)
                + ")"
            )
        parts = [
            f"{b.ring} {b.minimum} x {b.slot_bytes / 2**20:.1f} MiB ({self.bound_sources.get(b.buffer, 'bound')})"
            for b in used
        ]
        return f"ring storage per rank: {self.storage_bytes / 2**20:.1f} MiB (" + "; ".join(parts) + ")"

    def to_dict(self) -> dict[str, Any]:
        s = self.spec
        return {
            "ok": self.ok,
            "schedule": {
                "kind": s.kind.value,
                "pp": s.pp,
                "rank": s.rank,
                "microbatches": s.microbatches,
                "vpp": s.vpp,
                "microbatch_group": s.microbatch_group,
                "warmup_forwards": warmup_forwards(s),
            },
            "moe_layers_per_chunk": self.layers_per_chunk,
            "tokens_per_microbatch": self.tokens,
            "path": self.path,
            "lag_steps": self.lag_steps,
            "buffers": [b.to_dict() for b in self.buffers],
            "ring_storage_bytes": self.storage_bytes,
            "ring_storage": self.storage_line(),
            "assumptions": list(self.assumptions),
        }


def _get(cfg: Mapping[str, Any], name: str, default: Any = None) -> Any:
    value = cfg.get(name, default)
    return default if value is None else value


def schedule_of(fields: Mapping[str, Any], *, microbatches: int, pp_rank: int = 0) -> ScheduleSpec:
    """The rank's schedule from Megatron fields (PP, VPP, microbatch group, EP overlap)."""
    pp = int(_get(fields, "pipeline_model_parallel_size", 1))
    vpp = _get(fields, "virtual_pipeline_model_parallel_size", None)
    per_vstage = _get(fields, "num_layers_per_virtual_pipeline_stage", None)
    if vpp is None and per_vstage:
        vpp = int(_get(fields, "num_layers", 0)) // max(1, pp * int(per_vstage))
    vpp = int(vpp or 1)
    limits.check("max_pipeline_stages", pp, what="pipeline_model_parallel_size")
    limits.check("max_pipeline_stages", vpp, what="virtual pipeline stages")
    limits.check(
        "max_schedule_steps", microbatches * vpp, what=f"schedule steps ({microbatches:,} microbatches x {vpp})"
    )
    if bool(_get(fields, "overlap_moe_expert_parallel_comm", False)):
        kind = ScheduleKind.COMBINED
    elif pp == 1:
        kind = ScheduleKind.NONE
    else:
        kind = ScheduleKind.INTERLEAVED if vpp > 1 else ScheduleKind.ONE_F_ONE_B
    group = _get(fields, "microbatch_group_size_per_vp_stage", None)
    return ScheduleSpec(
        kind=kind, pp=pp, rank=pp_rank, microbatches=microbatches, vpp=vpp, group=None if group is None else int(group)
    )


def moe_layers_per_chunk(fields: Mapping[str, Any], spec: ScheduleSpec) -> list[int]:
    """MoE layers in each of the rank's model chunks (``num_layers`` split evenly, ``moe_layer_freq``)."""
    layers = _get(fields, "num_layers", None)
    if not layers:
        raise InputError("the config has no num_layers; pass --moe-layers-per-chunk")
    per = int(layers) // (spec.pp * spec.vpp)
    if per * spec.pp * spec.vpp != int(layers):
        raise InputError(
            f"num_layers={layers} does not split evenly over {spec.pp} stages x {spec.vpp} chunks; "
            "pass --moe-layers-per-chunk"
        )
    freq = _get(fields, "moe_layer_freq", 1)
    if isinstance(freq, str):
        try:
            freq = ast.literal_eval(freq)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise InputError(
                f"moe_layer_freq={freq!r} is not an integer or a list; pass --moe-layers-per-chunk"
            ) from None
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        pattern = [1 if i % freq == 0 else 0 for i in range(int(layers))]
    elif isinstance(freq, list) and len(freq) == int(layers):
        pattern = [int(bool(x)) for x in freq]
    else:
        raise InputError(f"moe_layer_freq={freq!r} does not describe {layers} layers; pass --moe-layers-per-chunk")
    out = []
    for c in range(spec.vpp):
        start = (c * spec.pp + spec.rank) * per
        out.append(sum(pattern[start : start + per]))
    return out


def plan_schedule(
    spec: ScheduleSpec,
    layers_per_chunk: list[int],
    rules: Mapping[str, ReleaseRule],
    *,
    configured: Mapping[str, int | str],
    slot_bytes: Mapping[str, int] | None = None,
    lag_steps: int = 2,
) -> list[BufferPlan]:
    """Plan the ring of each buffer in ``configured`` under ``spec`` (the library core of ``bufreuse plan``).

    Args:
        spec: the rank's schedule.
        layers_per_chunk: MoE layers in each model chunk.
        rules: release rule per buffer (``release_rules``).
        configured: slots per buffer on a ring (int or ``"auto"``).
        slot_bytes: bytes of one slot per buffer (0 when unknown).
        lag_steps: the control model's GPU lag behind the host, in schedule steps.

    Raises:
        InputError: when ``layers_per_chunk`` does not give one entry per model chunk, or ``lag_steps < 1``.
    """
    if len(layers_per_chunk) != spec.vpp:
        raise InputError(f"need MoE layers for each of the {spec.vpp} model chunk(s), got {layers_per_chunk}")
    if lag_steps < 1:
        raise InputError(f"lag_steps={lag_steps} (must be >= 1)")
    slot_bytes = slot_bytes or {}
    live = {b: rules[b] for b in configured if rules[b].point is not ReleasePoint.REFUSED}
    ops = expand(build_steps(spec), layers_per_chunk, live)
    depths = ring_depths(ops)
    chunk_depths = ring_depths(ops, per_chunk=True)
    plans = []
    for buf, conf in configured.items():
        rule = rules[buf]
        plan = BufferPlan(buffer=buf, ring=BUFFERS[buf], rule=rule, configured=conf, minimum=None)
        plan.slot_bytes = int(slot_bytes.get(buf, 0))
        if rule.point is not ReleasePoint.REFUSED:
            plan.per_chunk = {c: d.peak for (b, c), d in sorted(chunk_depths.items()) if b == buf}
            shared = depths.get((buf, ALL_CHUNKS))
            plan.minimum = shared.peak if shared is not None else 0
            plan.pending_count, plan.pending_step = pending_at(ops, buf, lag_steps)
            cf = closed_form(spec, rule.point, max(layers_per_chunk), recompute=rule.recompute)
            if cf is not None and len(set(layers_per_chunk)) == 1 and cf[0] == plan.minimum:
                plan.formula = cf[1]
            if conf != AUTO and plan.minimum and int(conf) < plan.minimum:
                peak = {b: max((d.peak for (bb, _), d in depths.items() if bb == b), default=1) for b in configured}
                slots = {b: (peak[b] if c == AUTO else int(c)) for b, c in configured.items()}  # auto settles there
                hz = find_hazards(ops, slots)
                plan.cycle = next((c for c in hz.cycles if c.ring == BUFFERS[buf]), None)
        plans.append(plan)
    return plans


def batch_microbatches(microbatches: Any, *, global_batch: Any, micro_batch: Any, data_parallel: Any) -> int | None:
    """Microbatches per iteration: given, or global / (micro x DP); refuses what megatron would refuse.

    Raises:
        InputError: the global batch is not a multiple of micro x DP (megatron asserts it; flooring it
            would plan another schedule), or a given count disagrees with global / (micro x DP).
    """
    derived = None
    if global_batch and micro_batch and data_parallel:
        per_step = int(micro_batch) * int(data_parallel)
        if int(global_batch) % per_step:
            raise InputError(
                f"global batch {global_batch} is not a multiple of micro batch {micro_batch} x data-parallel "
                f"{data_parallel} = {per_step}"
            )
        derived = int(global_batch) // per_step
    if microbatches is not None and derived is not None and int(microbatches) != derived:
        raise InputError(
            f"num_microbatches={microbatches} conflicts with global batch {global_batch} / (micro batch {micro_batch}"
            f" x data-parallel {data_parallel}) = {derived}; give one or the other"
        )
    return int(microbatches) if microbatches is not None else derived


def plan_config(
    fields: Mapping[str, Any],
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    num_microbatches: int | None = None,
    global_batch_size: int | None = None,
    data_parallel_size: int | None = None,
    pp_rank: int = 0,
    layers_per_chunk: int | None = None,
    lag_steps: int = 2,
    assume_enabled: bool = False,
    torch_version: TorchAssumption | None = None,
) -> PlanReport:
    """Plan the enabled ring buffers of a Megatron config (flat TransformerConfig/argument names).

    Options override the file. Microbatches: ``num_microbatches``, else ``global_batch_size / (micro_batch_size
    x data_parallel_size)``. ``pp_rank`` defaults to 0, the rank with the longest warm-up (deepest rings).
    ``torch_version``: what the EP >= 2 stream rule judges by (default: the installed torch; see
    :func:`bufreuse.config.unused_rings`).

    Raises:
        InputError: bad knob values, no MoE layers, an unknown microbatch count, or a schedule megatron refuses.
    """
    try:
        knobs = BufReuseConfig.from_mapping(fields)
    except InputError as e:
        raise InputError(f"bad bufreuse knobs: {e}") from None
    if assume_enabled:
        knobs = replace(
            knobs,
            moe_hybridep_reuse_dispatch_output_buffers=True,
            moe_hybridep_num_expert_output_buffers=knobs.moe_hybridep_num_expert_output_buffers or 4,
        )
    seq = seq_length if seq_length is not None else _get(fields, "seq_length", None)
    mbs = micro_batch_size if micro_batch_size is not None else _get(fields, "micro_batch_size", None)
    m = num_microbatches if num_microbatches is not None else _get(fields, "num_microbatches", None)
    gbs = global_batch_size if global_batch_size is not None else _get(fields, "global_batch_size", None)
    dp = data_parallel_size if data_parallel_size is not None else _get(fields, "data_parallel_size", None)
    m = batch_microbatches(m, global_batch=gbs, micro_batch=mbs, data_parallel=dp)
    if m is None:
        raise InputError(
            "the number of microbatches is unknown: pass --num-microbatches, or --global-batch-size with "
            "--micro-batch-size and --data-parallel-size"
        )
    if int(m) < 1:
        raise InputError(f"num_microbatches={m} (must be >= 1)")
    spec = schedule_of(fields, microbatches=int(m), pp_rank=pp_rank)
    layers = [int(layers_per_chunk)] * spec.vpp if layers_per_chunk is not None else moe_layers_per_chunk(fields, spec)
    path = dispatch_path(fields)
    tokens = tokens_per_microbatch(fields, seq_length=seq, micro_batch_size=mbs)
    bounds = static_bounds(fields, knobs, path=path or "alltoall", tokens=tokens, torch_version=torch_version)
    configured = {b: knobs.slots(b) for b, pol in knobs.enabled().items() if pol == "ring"}
    rules = release_rules(fields, path=path)
    # The same rule as install(): a ring that replaces nothing is not registered, so the used rings are
    # planned (and their cycles found) without it, as install() checks them; the unused one is planned
    # alone for the record, with no memory and no cycle. Its control pending-free stays the model's figure
    # (which assumes every buffer is record_stream'ed), shown beside the rule's verdict that nothing of it waits.
    unused = unused_rings(fields, knobs, path or "alltoall", torch_version=torch_version)
    by_buffer: dict[str, BufferPlan] = {}
    slot_bytes = {b: bd.slot_bytes for b, bd in bounds.items()}
    for is_unused in (False, True):
        group = {b: c for b, c in configured.items() if (b in unused) is is_unused}
        if group:
            for plan in plan_schedule(
                spec, layers, rules, configured=group, slot_bytes=slot_bytes, lag_steps=lag_steps
            ):
                by_buffer[plan.buffer] = plan
    plans = [by_buffer[b] for b in configured]
    for plan in plans:
        if plan.buffer in unused:
            plan.unused = unused[plan.buffer]
            plan.cycle = None
    return PlanReport(
        spec=spec,
        layers_per_chunk=layers,
        buffers=plans,
        tokens=tokens,
        path=path,
        lag_steps=lag_steps,
        bound_sources={b: bd.source.split("; not used")[0] for b, bd in bounds.items()},
    )


def initial_slots(fields: Mapping[str, Any], buffer: str, *, num_microbatches: int, pp_rank: int = 0) -> int | None:
    """The planned minimum of ``buffer`` for an ``auto`` ring's first depth; None when it cannot be planned.

    For the integration at ``install()`` time (``register(num_slots="auto", initial_slots=...)``): returns
    None for a refused buffer, a config the planner cannot read (no ``num_layers``, uneven layers), or a
    schedule megatron refuses -- then the ring starts small and grows during warm-up.
    """
    try:
        spec = schedule_of(fields, microbatches=num_microbatches, pp_rank=pp_rank)
        layers = moe_layers_per_chunk(fields, spec)
    except InputError:
        return None
    rule = release_rules(fields)[buffer]
    if rule.point is ReleasePoint.REFUSED:
        return None
    plan = plan_schedule(spec, layers, {buffer: rule}, configured={buffer: AUTO})[0]
    return plan.minimum or 1
