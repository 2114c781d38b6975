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
import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from bufreuse.config import BufReuseConfig, dispatch_path, expert_tp, unused_rings
from bufreuse.errors import ConfigError
from bufreuse.integrations.core import (
    KNOBS,
    ConfigView,
    Installation,
    PathAdapter,
    active_installations,
    cfg_get,
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

__all__ = ["GroupSizes", "Installation", "RingStandDownWarning", "ep_backend", "group_sizes", "install", "installed"]

_MARK = "_bufreuse_hooked"
_log = logging.getLogger("bufreuse.integrations")
_WARNED: set[tuple[str, str]] = set()
"""(ring, reason) pairs already warned about in this process (install runs once per model chunk)."""


class RingStandDownWarning(UserWarning):
    """An enabled ring stands down: ``install()`` hooks nothing for it (it would replace nothing there)."""


@dataclasses.dataclass(frozen=True, slots=True)
class GroupSizes:
    """The EP and expert-TP sizes a MoE layer's rings are decided on, where they came from, and the config's.

    megatron-core's token dispatcher takes its groups from the layer's ``pg_collection`` (``ep``,
    ``expt_tp``), which a caller may build apart from the config's parallel fields; the groups decide
    whether the all-to-all returns its input (EP = 1) and whether the combine reduces expert-TP shards.
    """

    ep: int
    etp: int
    source: str
    """``dispatcher``, ``config``, or which size came from which where the dispatcher exposes only one."""
    config_ep: int
    config_etp: int

    def disagreement(self) -> str | None:
        """The mismatch with the config's fields in words, naming both; None when they agree."""
        if (self.ep, self.etp) == (self.config_ep, self.config_etp):
            return None
        return (
            f"the MoE token dispatcher's groups are EP {self.ep} x expert TP {self.etp} ({self.source}) but the "
            f"config says expert_model_parallel_size={self.config_ep}, expert TP {self.config_etp} "
            "(expert_tensor_parallel_size, else tensor_model_parallel_size); deciding the rings, bounds and "
            "release rules on the dispatcher's (a custom pg_collection)"
        )

    def fields(self, cfg: Any) -> Any:
        """``cfg`` with its EP / expert-TP fields set to these sizes (``cfg`` itself when they agree)."""
        if self.disagreement() is None:
            return cfg
        return ConfigView(cfg, expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp)


def ep_backend(layer: Any) -> str | None:
    """The backend of ``layer``'s EP group (``gloo``, ``nccl``, ...), as its token dispatcher's all-to-all runs on it.

    megatron-core's ``TransformerConfig`` has no backend field, so without this the stream rule assumed NCCL. A
    group with one backend per device type (``cpu:gloo,cuda:nccl``) gives the one of the device the layer's
    parameters are on. None when the dispatcher has no EP group or torch.distributed cannot say.
    """
    group = getattr(getattr(layer, "token_dispatcher", None), "ep_group", None)
    if group is None:
        return None
    import torch.distributed as dist

    try:
        name = str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return None
    if ":" in name:
        pairs = dict(p.split(":", 1) for p in name.split(",") if ":" in p)
        device = next((p.device.type for p in layer.parameters()), "cuda")
        name = pairs.get(device) or pairs.get("cuda") or next(iter(pairs.values()), name)
    return name.strip() or None


def _group_size(dispatcher: Any, attr: str) -> int | None:
    """A positive integer group size the dispatcher holds as ``attr``, else None (absent on this version)."""
    value = getattr(dispatcher, attr, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def group_sizes(layer: Any) -> GroupSizes:
    """EP and expert-TP sizes of ``layer`` by fact: its token dispatcher's, each from the config where absent.

    megatron-core 0.19.2 (and 0.16.1) ``MoETokenDispatcher.__init__`` sets ``ep_size`` from
    ``pg_collection.ep`` and ``tp_size`` from ``pg_collection.expt_tp`` (the expert-TP group), the
    sizes its all-to-all and combine run on. A dispatcher without them (another megatron-core) falls
    back to ``expert_model_parallel_size`` and :func:`bufreuse.config.expert_tp`. Read once, at install.
    """
    cfg = layer.config
    config_ep, config_etp = int(cfg_get(cfg, "expert_model_parallel_size", 1) or 1), expert_tp(cfg)
    dispatcher = getattr(layer, "token_dispatcher", None)
    ep, etp = _group_size(dispatcher, "ep_size"), _group_size(dispatcher, "tp_size")
    if ep is not None and etp is not None:
        source = "dispatcher"
    elif ep is None and etp is None:
        source = "config"
    else:
        source = "EP: dispatcher, expert TP: config" if ep is not None else "EP: config, expert TP: dispatcher"
    return GroupSizes(
        ep=config_ep if ep is None else ep,
        etp=config_etp if etp is None else etp,
        source=source,
        config_ep=config_ep,
        config_etp=config_etp,
    )


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

    Each layer is decided on the EP and expert-TP sizes its token dispatcher really uses
    (:func:`group_sizes`; a custom ``pg_collection`` may differ from the config's fields, which are the
    fallback) and on its EP group's backend (:func:`ep_backend`: gloo is judged as gloo, not as NCCL):
    which rings replace nothing (:func:`bufreuse.config.unused_rings`), the static bounds, the
    refusals and the release rules; a disagreement with the config is logged once as a warning. An enabled
    ring that stands down is warned about once per process (:class:`RingStandDownWarning`, with the reason;
    ``Installation.unused`` has it too).

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
    _decide_group_sizes(inst, layers)
    ring_slots = {b: knobs.slots(b) for b, pol in knobs.enabled().items() if pol == "ring"}
    for layer, _ in plans:  # buffers that replace nothing on this layer: no ring, no hooks, nothing to plan
        cfg = inst.config_of(layer)
        for buffer, why in unused_rings(cfg, knobs, dispatch_path(cfg)).items():
            inst.unclaim(layer, buffer, why)
            ring_slots.pop(buffer, None)
    _warn_stood_down(inst)
    if layers and ring_slots:
        _refuse_scheduled_release(layers[0].config)
        chunk_layers = [sum(isinstance(m, MoELayer) for m in root.modules()) for root in modules]
        fields = effective_config(inst.config_of(layers[0]))
        check_depths(inst, fields, chunk_layers, knobs_slots=ring_slots, knob_names=KNOBS)
    inst.activate()
    inst.on_uninstall(functools.partial(_forget_plan, inst))
    try:
        for layer, chosen in plans:
            path = next(a.path for a in chosen if a.dispatcher)
            problems = install_refusals(inst.config_of(layer), knobs, path)
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


def _decide_group_sizes(inst: Installation, layers: list[Any]) -> None:
    """Decide each layer on its dispatcher's EP / expert-TP sizes (:func:`group_sizes`) and its EP group's backend
    (:func:`ep_backend`); warn once per size mismatch.

    A layer whose sizes agree with its config and whose EP group is NCCL (what the rule assumes of a
    ``TransformerConfig``) keeps ``layer.config``; otherwise it gets a view of it with the sizes and
    ``distributed_backend`` replaced (``Installation.config_of``), which the unused-ring rule, the refusals,
    the static bounds and the release rules then read.
    """
    warned: set[str] = set()
    for layer in layers:
        sizes = group_sizes(layer)
        why = sizes.disagreement()
        backend = ep_backend(layer)
        cfg = sizes.fields(layer.config)
        if backend is not None and backend != "nccl":
            cfg = ConfigView(cfg, distributed_backend=backend)
        if cfg is not layer.config:
            inst.use_config(layer, cfg)
        if why is not None and why not in warned:
            warned.add(why)
            _log.warning("bufreuse: %s", why)


def _warn_stood_down(inst: Installation) -> None:
    """Warn (once per process per ring and reason) that an enabled ring stands down: the knob asked for it."""
    for ring, why in inst.unused.items():
        if (ring, why) in _WARNED:
            continue
        _WARNED.add((ring, why))
        keep = "" if why.startswith(("EP = 1", "EP x ETP = 1")) else "; moe_bufreuse_keep_unused_rings keeps it"
        warnings.warn(
            f"bufreuse: ring '{ring}' enabled but stands down (install() hooks nothing for it): {why}{keep}",
            RingStandDownWarning,
            stacklevel=3,
        )


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
