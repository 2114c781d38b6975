"""Plug a :class:`~bufreuse.pool.BufferPool` into megatron-core's MoE layers (explicit, reversible).

``install(model, pool, knobs, tokens=...)`` (or ``with installed(...)``) walks the model's
``MoELayer`` instances and asks the registered adapters
(:data:`bufreuse.integrations.registry.ADAPTERS`) which of them hook each layer: the NCCL
all-to-all adapter, the HybridEP adapter (dispatch output) and the Transformer Engine adapter
(expert FC2 output of HybridEP and all-to-all ``TEGroupedMLP`` layers). Each registers its buffers on
the pool and overrides instance attributes (and switches a hooked TE FC2 module's class to its routing
subclass, :func:`bufreuse.integrations.te.out_route.routing_class`), recorded on the returned
:class:`~bufreuse.integrations.core.Installation`.

Three class-level patches are shared by every live installation (one per model chunk with
virtual pipelining) and stay while any is alive: ``ScheduleNode._forward`` (``free_input=True``
would ``resize_(0)`` a slot) and ``ChunkOffloadHandler.bulk_offload``
(``forced_released_tensors``) skip ring storage through the pools' pure probe, and the
full-iteration CUDA-graph wrapper runs its capture inside the pools' capture phase and orders
replays and eager calls (:mod:`bufreuse.integrations.graphs`). ``uninstall()`` restores
everything; nothing is patched at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from bufreuse.config import BufReuseConfig, dispatch_path, unused_rings
from bufreuse.errors import ConfigError
from bufreuse.integrations.core import (
    KNOBS,
    Installation,
    PathAdapter,
    active_installations,
    effective_config,
    install_refusals,
    shared_patch,
    shared_patches_applied,
)
from bufreuse.integrations.planned import check_depths, forget
from bufreuse.integrations.registry import ADAPTERS

if TYPE_CHECKING:
    import torch

    from bufreuse.pool import BufferPool

__all__ = ["Installation", "install", "installed"]

_MARK = "_bufreuse_hooked"


def install(
    model: torch.nn.Module | list,
    pool: BufferPool,
    knobs: BufReuseConfig,
    *,
    tokens: int,
    num_microbatches: int | None = None,
    pp_rank: int = 0,
    ring_identity_dispatch: bool = False,
    ring_single_rank_expert: bool = False,
) -> Installation:
    """Register the enabled buffers on ``pool`` and hook every supported ``MoELayer`` in ``model``.

    Each hooked ring's release rule (:mod:`bufreuse.plan.rules`, the planner's table) is kept in
    ``Installation.expected_release`` and logged once at debug level; the refusals that are release
    rules come from the same table. A fixed slot count is checked against the planner's minimum for the
    schedule the layers are installed into (:func:`bufreuse.integrations.planned.check_depths`: pipeline
    kind, PP/VPP rank, ``num_microbatches``, MoE layers per chunk, release rules) before anything is
    hooked.

    Run :func:`bufreuse.integrations.requirements.validate` first: it names every unmet setting at
    once, where ``install`` refuses at the first layer it cannot hook.

    Args:
        model: a module, or the list of model chunks Megatron-LM builds (virtual pipelining).
        pool: the pool the rings are registered on (one pool may serve several chunks).
        knobs: which buffers are enabled, their policies and slot counts.
        tokens: tokens per rank per microbatch entering a MoE layer (sizes the static bounds).
        num_microbatches: microbatches per step on this rank; with ``pp_rank``, the schedule the
            planner sizes a ``num_slots='auto'`` ring's first depth from (None: the pool's default).
        pp_rank: this rank's pipeline stage.
        ring_identity_dispatch: at EP = 1 the all-to-all dispatch returns its input and no dispatch
            ring is used (``Installation.unused`` says so); True copies it into the ring anyway, to
            exercise the dispatch ring's hooks on one GPU (tests); the knob
            ``moe_bufreuse_ring_identity_dispatch`` does the same. Costs one copy per layer call.
        ring_single_rank_expert: at EP x ETP = 1 on the all-to-all path the FC2 output is made and read
            on one stream and no expert ring is used; True rings it anyway, to exercise and measure the
            expert ring's hooks on one GPU (tests, ``bench layer``); the knob
            ``moe_bufreuse_ring_single_rank_expert`` does the same. Adds no copy.

    Returns:
        The installation; ``uninstall()`` it (or use it as a context manager) to restore the model.

    Raises:
        ConfigError: ``tokens`` < 1; MoE layers already hooked; a layer on a dispatcher no adapter
            supports; a fixed slot count below the planned minimum (naming the minimum, the knob and the
            cycle); a layer with settings its adapter does not replay (all of a layer's problems in one
            message). Nothing stays replaced when it raises.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if not tokens or tokens < 1:
        raise ConfigError(f"install needs tokens per microbatch >= 1 to size the buffers, got {tokens!r}")
    if ring_identity_dispatch or ring_single_rank_expert:  # the validation aids, as unused_rings reads them
        knobs = dataclasses.replace(
            knobs,
            moe_bufreuse_ring_identity_dispatch=ring_identity_dispatch or knobs.moe_bufreuse_ring_identity_dispatch,
            moe_bufreuse_ring_single_rank_expert=ring_single_rank_expert or knobs.moe_bufreuse_ring_single_rank_expert,
        )
    inst = Installation(
        pool=pool,
        knobs=knobs,
        tokens=tokens,
        num_microbatches=num_microbatches,
        pp_rank=pp_rank,
    )
    modules = model if isinstance(model, list) else [model]
    layers = [m for root in modules for m in root.modules() if isinstance(m, MoELayer)]
    if any(_MARK in vars(m) for m in layers):
        raise ConfigError("bufreuse hooks are already installed on these MoE layers; uninstall() them first")
    plans = [(layer, _adapters_for(layer, inst)) for layer in layers]
    bad = [type(layer.token_dispatcher).__name__ for layer, chosen in plans if not any(a.dispatcher for a in chosen)]
    if bad:
        raise ConfigError(
            f"bufreuse hooks support MoEAlltoAllTokenDispatcher and the flex dispatcher's HybridEP backend; "
            f"found {sorted(set(bad))} (set moe_token_dispatcher_type='alltoall', or 'flex' with "
            "moe_flex_dispatcher_backend='hybridep')"
        )
    ring_slots = {b: knobs.slots(b) for b, pol in knobs.enabled().items() if pol == "ring"}
    for layer, _ in plans:  # buffers that replace nothing on this layer: no ring, no hooks, nothing to plan
        for buffer, why in unused_rings(layer.config, knobs, dispatch_path(layer.config)).items():
            inst.unclaim(layer, buffer, why)
            ring_slots.pop(buffer, None)
    if layers and ring_slots:
        _refuse_scheduled_release(layers[0].config)
        chunk_layers = [sum(isinstance(m, MoELayer) for m in root.modules()) for root in modules]
        fields = effective_config(layers[0].config)
        check_depths(inst, fields, chunk_layers, knobs_slots=ring_slots, knob_names=KNOBS)
    inst.activate()
    inst.on_uninstall(functools.partial(_forget_plan, inst))
    try:
        for layer, chosen in plans:
            path = next(a.path for a in chosen if a.dispatcher)
            problems = install_refusals(layer.config, knobs, path)
            problems += [p for a in chosen for p in a.check(inst, layer)]
            if problems:
                label = next(a.label for a in chosen if a.dispatcher)
                raise ConfigError(f"cannot hook the {label} MoE layer: " + "; ".join(problems))
            for a in chosen:
                a.hook(inst, layer)
            inst.expect(layer, path)
            inst.override(layer, _MARK, True)
            inst.layers += inst.hooks_any(layer)
        if inst.layers and not shared_patches_applied():  # no ring used on any layer: nothing to keep alive
            _patch_release_paths()
    except BaseException:
        inst.uninstall()
        raise
    inst.log_rules()
    return inst


@contextlib.contextmanager
def installed(
    model: torch.nn.Module | list,
    pool: BufferPool,
    knobs: BufReuseConfig,
    *,
    tokens: int,
    num_microbatches: int | None = None,
    pp_rank: int = 0,
    ring_identity_dispatch: bool = False,
    ring_single_rank_expert: bool = False,
) -> Iterator[Installation]:
    """``install`` for the duration of a ``with`` block (same arguments and errors)."""
    inst = install(
        model,
        pool,
        knobs,
        tokens=tokens,
        num_microbatches=num_microbatches,
        pp_rank=pp_rank,
        ring_identity_dispatch=ring_identity_dispatch,
        ring_single_rank_expert=ring_single_rank_expert,
    )
    try:
        yield inst
    finally:
        inst.uninstall()


def _refuse_scheduled_release(cfg: Any) -> None:
    """Refuse rings under EP overlap where megatron's combined-1F1B scheduled tensor release exists.

    That release (Megatron-LM dev, not in a PyPI release yet) binds producer streams to tensor objects and
    empties consumed storage with ``resize_(0)`` outside ``ScheduleNode.free_input``, which is the only
    place the ring's skip is patched; a ring slot's storage is the whole ring.
    """
    from bufreuse.integrations._compat_megatron import scheduled_tensor_release

    module = scheduled_tensor_release() if getattr(cfg, "overlap_moe_expert_parallel_comm", False) else None
    if module is not None:
        raise ConfigError(
            f"this megatron-core has the combined-1F1B scheduled tensor release ({module}), which frees consumed "
            "storage outside ScheduleNode.free_input, where bufreuse keeps ring storage alive; ring buffers under "
            "overlap_moe_expert_parallel_comm are refused there -> use the stream-ordered policy "
            "(moe_bufreuse_dispatch_policy / moe_bufreuse_expert_policy) or a megatron-core release without it"
        )


def _forget_plan(inst: Installation) -> None:
    """At uninstall: drop the pool's planned minimums once no other live installation uses the pool."""
    if not any(i.pool is inst.pool for i in active_installations() if i is not inst):
        forget(inst.pool)


def _adapters_for(layer: Any, inst: Installation) -> list[PathAdapter]:
    """The adapters hooking ``layer``: each supporting one takes the buffers no earlier one took (claimed)."""
    chosen: list[PathAdapter] = []
    taken: set[str] = set()
    for a in ADAPTERS:
        mine = a.buffers - taken
        if mine and a.supports(layer):
            chosen.append(a)
            taken |= mine
            for buffer in mine:
                inst.claim(layer, buffer, a.name)
    return chosen


def _is_ring_storage(tensor: Any) -> bool:
    """The pools' pure probe, over every live installation."""
    import torch

    return isinstance(tensor, torch.Tensor) and any(i.pool.is_ring_storage(tensor) for i in active_installations())


def _active_pools() -> list[BufferPool]:
    """The pools of every live installation (what the full-iteration graph wrapper drives)."""
    return [i.pool for i in active_installations()]


def _patch_release_paths() -> None:
    """Make ScheduleNode.free_input and the offload forced release skip ring storage; wrap full-iteration graphs."""
    from bufreuse.integrations._compat_megatron import patch_bulk_offload, patch_schedule_node_free_input
    from bufreuse.integrations.graphs import patch_full_iteration

    for patch in (patch_schedule_node_free_input, patch_bulk_offload):
        undo = patch(_is_ring_storage)
        if undo is not None:
            shared_patch(undo)
    graph_undo: list[Any] = []
    patch_full_iteration(graph_undo, _active_pools)
    for undo in graph_undo:
        shared_patch(undo)
