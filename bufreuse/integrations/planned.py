"""The planner asked at ``install()``: a fixed slot count below the schedule's minimum is refused up front.

Without this a too-small ring starts and dies in its first forward with ``EarlyReuseError``, whose "needs
at least held + 1" only clears the acquisition that failed (raised to that, the run dies again one layer
later). :func:`check_depths` runs :func:`bufreuse.plan.plan_schedule` for the schedule the layers are
installed into -- the rank's pipeline kind, PP/VPP rank, microbatches, MoE layers per model chunk and the
release rules of this process's config -- and raises :class:`ConfigError` naming the minimum, the knob
and the cycle the GPU would be stuck in. The planned minimum is remembered per pool so that a later
``EarlyReuseError`` (an ``auto`` ring's cap, a data-dependent release) can quote it
(:func:`planned_minimum`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any

from bufreuse.errors import ConfigError, InputError

if TYPE_CHECKING:
    from bufreuse.pool import BufferPool

__all__ = ["check_depths", "planned_minimum"]

_PLANNED: weakref.WeakKeyDictionary[Any, dict[str, tuple[int, str]]] = weakref.WeakKeyDictionary()
"""Pool -> ring name -> (planned minimum, the schedule in words), while an installation lives."""


def planned_minimum(pool: BufferPool, ring: str) -> tuple[int, str] | None:
    """The planner's minimum for ``ring`` on ``pool`` and the schedule it was planned for, if known."""
    try:
        return _PLANNED.get(pool, {}).get(ring)
    except TypeError:  # a pool that cannot be weakly referenced
        return None


def check_depths(
    inst: Any,
    fields: Any,
    chunk_layers: list[int] | None,
    *,
    knobs_slots: dict[str, int | str],
    knob_names: dict[str, str],
) -> dict[str, tuple[int, str]]:
    """Plan the ring buffers in ``knobs_slots`` for the schedule ``cfg`` describes; refuse a fixed count
    below the minimum.

    Args:
        inst: the installation (its ``num_microbatches``, ``pp_rank``, ``pool``).
        fields: the layers' config as a mapping, as the release rules read it in this process
            (``core.effective_config``).
        chunk_layers: MoE layers in each model chunk when the install covers every chunk of the rank,
            else None (then the config's ``num_layers`` / ``moe_layer_freq`` split decides).
        knobs_slots: buffer (``dispatch``/``expert``) -> configured slots (int or ``"auto"``), ring policy.
        knob_names: ring name -> the knob that sets its slot count (``core.KNOBS``).

    Returns:
        Ring name -> (planned minimum, schedule in words) for the buffers the planner could plan.

    Raises:
        ConfigError: a fixed slot count below the planned minimum (every such ring in one message).
    """
    from bufreuse.config import BUFFERS
    from bufreuse.plan import ReleasePoint, moe_layers_per_chunk, plan_schedule, release_rules, schedule_of
    from bufreuse.plan.rules import dispatch_path

    if not knobs_slots:
        return {}
    m = inst.num_microbatches or 1  # unknown: plan one microbatch, a lower bound of every longer schedule
    try:
        spec = schedule_of(fields, microbatches=int(m), pp_rank=inst.pp_rank)
        if chunk_layers is not None and len(chunk_layers) == spec.vpp:
            layers = chunk_layers
        else:
            layers = moe_layers_per_chunk(fields, spec)
        rules = release_rules(fields, path=dispatch_path(fields))
        plans = plan_schedule(spec, layers, rules, configured=knobs_slots)
    except (InputError, ValueError, KeyError):
        return {}  # a schedule the planner cannot read: the ring's own EarlyReuseError stays the guard
    where = (
        f"schedule {spec.kind.value}, PP rank {spec.rank} of {spec.pp}, VPP {spec.vpp}, "
        f"{m if inst.num_microbatches else 'at least 1'} microbatch(es), MoE layers per chunk {layers}"
    )
    planned: dict[str, tuple[int, str]] = {}
    problems = []
    for plan in plans:
        if plan.minimum is None or plan.rule.point is ReleasePoint.REFUSED:
            continue
        ring = BUFFERS[plan.buffer]
        planned[ring] = (plan.minimum, where)
        if plan.ok:
            continue
        knob = knob_names.get(ring, "the slot count")
        text = (
            f"ring '{ring}': {knob}={plan.configured} is below the planner's minimum {plan.minimum} for this "
            f"schedule ({where}; released at {plan.rule.point.value}: {plan.rule.reason}) -> set {knob} to at "
            f"least {plan.minimum} (or 'auto')"
        )
        if plan.cycle is not None:
            text += f"; with {plan.configured} slot(s) the first iteration would stop here: {plan.cycle.describe()}"
        problems.append(text)
    if problems:
        raise ConfigError("; ".join(problems))
    with contextlib.suppress(TypeError):  # a pool that cannot be weakly referenced: nothing to quote later
        _PLANNED.setdefault(inst.pool, {}).update(planned)
    return planned


def forget(pool: BufferPool) -> None:
    """Drop what was planned for ``pool`` (its last installation is gone)."""
    with contextlib.suppress(TypeError):
        _PLANNED.pop(pool, None)
