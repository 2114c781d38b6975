"""The NCCL all-to-all adapter: ``MoEAlltoAllTokenDispatcher`` layers.

Per ``MoELayer`` instance it overrides:

- ``token_dispatch``: the tokens all-to-all writes into a ``dispatch_output`` slot;
- ``dispatch_postprocess``: releases the slot when the local-expert sort copied it;
- ``routed_experts_compute``: otherwise releases it after the experts, its last forward reader;
- ``experts.forward`` (``SequentialMLP``): FC2 outputs concatenated into an ``expert_fc2_output``
  slot (a ``TEGroupedMLP``'s FC2 output is the TE adapter's);
- ``combine_preprocess`` / ``token_combine`` / ``combine_postprocess``: release the FC2 slot after
  the first stage whose output no longer aliases it (its last forward reader).

Every release is by fact: a hooked stage that receives a live slot runs inside ``pool.track_saved()``
(a stage that receives a copy pays one pointer comparison and nothing else), and a release waits for
the saved references those stages made to the slot (a bf16 expert GEMM's input with one local expert,
``probs * hidden`` under ``moe_apply_probs_on_input``, the unpermute's ``index_add_`` source under
deterministic algorithms, a user's module hook), so it lands after the backward that reads them; nothing
is decided from the configuration. Whenever the FC2 ring is in use, ``routed_experts_compute`` (the
experts, their module hooks and ``combine_preprocess``: where the FC2 slot is made) runs in the region
on every call (:func:`track_fc2_stage`), with or without the dispatch ring.

At EP = 1 the upstream all-to-all returns its input, and at EP x ETP = 1 the FC2 output is made and read on
one stream: there is nothing for those rings to replace, so ``install()`` leaves them unclaimed (no ring
registered, no copy, no hook; :func:`bufreuse.config.unused_rings`) unless a validation knob asks for them
(tests exercising the rings on one GPU, ``bench layer``). The autograd
Functions doing the writes live in :mod:`bufreuse.integrations.alltoall.functions`.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bufreuse.config import static_bounds
from bufreuse.errors import BackendContractError, ConfigError
from bufreuse.integrations.core import (
    BOTH,
    DISPATCH,
    EXPERT,
    REUSE,
    RING,
    CheckContext,
    Held,
    Installation,
    Requirement,
    cfg_get,
    reads_live,
    tracked,
)

__all__ = ["ADAPTER", "AllToAllAdapter"]

_ALLTOALL = frozenset({"alltoall"})


def _graphs_ok(c: CheckContext) -> bool:
    impl = cfg_get(c.cfg, "cuda_graph_impl", "none")
    if impl in (None, "none"):
        return True
    pad = bool(cfg_get(c.cfg, "moe_pad_expert_input_to_capacity", False))
    return impl == "full_iteration" and pad and cfg_get(c.cfg, "moe_expert_capacity_factor", None) is not None


ROWS: tuple[Requirement, ...] = (
    Requirement(
        key="unfused_permute",
        buffers=BOTH,
        paths=_ALLTOALL,
        policies=RING,
        text="unfused permutation (moe_permute_fusion=False)",
        fix="set moe_permute_fusion=False",
        why="the slot is released after the sort/unpermute that copies it; only the unfused ops are "
        "verified not to save it for backward",
        test=lambda c: not cfg_get(c.cfg, "moe_permute_fusion", False),
    ),
    Requirement(
        key="expert_output_writer",
        buffers=frozenset({"expert"}),
        paths=_ALLTOALL,
        policies=REUSE,
        text="experts that write FC2 into the buffer: SequentialMLP, or TE's grouped MLP with GroupedLinear(out=)",
        fix="set moe_grouped_gemm=False, or install Transformer Engine with GroupedLinear.forward(out=) (>= 2.18)",
        why="the SequentialMLP hook concatenates into the slot; TEGroupedMLP's FC2 (TE GroupedLinear) writes into it "
        "through out=, which older TE lacks",
        test=lambda c: not cfg_get(c.cfg, "moe_grouped_gemm", False) or c.features.te_grouped_output,
    ),
    Requirement(
        key="no_shared_expert_overlap",
        buffers=frozenset({"dispatch"}),
        paths=_ALLTOALL,
        policies=REUSE,
        text="no shared-expert overlap inside the dispatcher",
        fix="set moe_shared_expert_overlap=False",
        why="megatron-core moved the overlapped shared-expert FC1 between token_dispatch (0.19) and "
        "dispatch_postprocess (0.16); the dispatch hook does not replay either",
        test=lambda c: not cfg_get(c.cfg, "moe_shared_expert_overlap", False),
    ),
    Requirement(
        key="no_cuda_graphs",
        buffers=BOTH,
        paths=_ALLTOALL,
        policies=REUSE,
        text="no per-layer CUDA graphs; a full-iteration graph only with drop-and-pad",
        fix="set cuda_graph_impl='none', or cuda_graph_impl='full_iteration' with "
        "moe_pad_expert_input_to_capacity=True and moe_expert_capacity_factor",
        why="the full-iteration path runs capture, replays and eager calls through the pool's phase API "
        "(bufreuse.integrations.graphs); per-layer graphs capture part of an iteration while slots are held, "
        "and a dropless dispatcher syncs token counts to the host, which capture forbids",
        test=_graphs_ok,
    ),
)


@dataclass(slots=True)
class _LayerState:
    dispatch: Held | None = None
    fc2: deque[Held] = field(default_factory=deque)
    wgrad: deque[Any] | None = None
    """Holds on dispatch slots TE's wgrad store still reads, oldest first (delayed wgrad; else None)."""


class AllToAllAdapter:
    """Hooks the buffers of a ``MoEAlltoAllTokenDispatcher`` layer (the NCCL all-to-all path).

    The dispatch output always; the expert FC2 output of ``SequentialMLP`` experts (a
    ``TEGroupedMLP``'s belongs to the TE adapter, which claims it first).
    """

    name = "alltoall"
    path = "alltoall"
    buffers = BOTH
    dispatcher = True
    label = "all-to-all"

    def supports(self, layer: Any) -> bool:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        return isinstance(getattr(layer, "token_dispatcher", None), MoEAlltoAllTokenDispatcher)

    def requirements(self) -> tuple[Requirement, ...]:
        return ROWS

    def check(self, installation: Installation, layer: Any) -> list[str]:
        return []  # the hooks refuse what they cannot replay, with their own messages

    def hook(self, installation: Installation, layer: Any) -> None:
        import torch

        knobs = installation.knobs
        dtype = getattr(layer.config, "params_dtype", torch.float32)
        mine = [b for b in ("dispatch", "expert") if installation.hooks(self.name, layer, b)]  # install() unclaims
        cfg = installation.config_of(layer)  # the EP / expert-TP sizes the dispatcher really uses
        bounds = static_bounds(cfg, knobs, path="alltoall", tokens=installation.tokens)
        for buf in mine:
            installation.register(buf, bounds[buf], dtype, cfg)
        state = _LayerState()
        if "dispatch" in mine:
            _hook_dispatch(installation, layer, state)
        if "expert" in mine:
            _hook_expert(installation, layer, state)


def _hook_dispatch(inst: Installation, layer: Any, state: _LayerState) -> None:
    """Write the dispatch all-to-all into a slot; release it after its last forward reader, by fact."""
    import torch
    from megatron.core.tensor_parallel import all_to_all

    from bufreuse.integrations._compat_megatron import dtoh_and_synchronize
    from bufreuse.integrations.alltoall.functions import RingAllToAll

    disp, pool = layer.token_dispatcher, inst.pool
    orig_post = inst.original(disp, "dispatch_postprocess")
    orig_compute = inst.original(layer, "routed_experts_compute")
    state.wgrad = hook_delayed_wgrad(inst, layer)
    if getattr(disp, "shared_experts", None) is not None:
        raise ConfigError("dispatch-output reuse does not support moe_shared_expert_overlap; set it to False")
    nccl = bool(getattr(disp, "use_nccl_stream", False))
    probs_kwargs = {"use_nccl_stream": nccl} if hasattr(disp, "use_nccl_stream") else {}
    box: list[Held] = []

    def token_dispatch(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        disp.tokens_per_expert = dtoh_and_synchronize(disp, "before_ep_alltoall", disp.tokens_per_expert)
        out = RingAllToAll.apply(
            tokens, pool, DISPATCH, disp.ep_group, disp.output_splits, disp.input_splits, nccl, box
        )
        state.dispatch = box.pop()
        global_probs = all_to_all(disp.ep_group, probs, disp.output_splits, disp.input_splits, **probs_kwargs)
        return out, global_probs

    def dispatch_postprocess(hidden: torch.Tensor, probs: torch.Tensor) -> Any:
        result = orig_post(hidden, probs)
        held = state.dispatch
        if held is not None and not held.read_by(result[0]):
            state.dispatch = None
            held.release()  # the sort copied it: its last forward reader (waits for any saved reference)
        return result

    def routed_experts_compute(hidden: torch.Tensor, probs: torch.Tensor) -> Any:
        result = orig_compute(hidden, probs)
        held, state.dispatch = state.dispatch, None
        hold = None
        if held is not None:
            # The experts read it directly. Whatever they saved from it (a bf16 GEMM's input,
            # probs * hidden under moe_apply_probs_on_input, TE's original input) was counted;
            # an FP8 GEMM saves its quantized copy and the release happens now. With delayed
            # wgrad, what FC1 saved goes on into TE's wgrad store: hold the slot until backward_dw.
            if state.wgrad is not None and pool.saved_references(DISPATCH, held.tensor):
                hold = pool.hold(DISPATCH, held.tensor)
            held.release()
        if state.wgrad is not None and torch.is_grad_enabled():
            # one entry per forward that will have a backward_dw (TE stores one per backward), a hold or
            # None, so the FIFO stays aligned when a microbatch released early (a copy, or no tokens)
            state.wgrad.append(hold)
        return result

    reads = reads_live(lambda: state.dispatch)
    inst.override(disp, "token_dispatch", token_dispatch)
    inst.override(disp, "dispatch_postprocess", tracked(pool, dispatch_postprocess, reads))
    if inst.hooks_buffer(layer, "expert"):
        reads = None  # the stage also makes the FC2 slot: in the region on every call (track_fc2_stage)
    inst.override(layer, "routed_experts_compute", tracked(pool, routed_experts_compute, reads))


def _fc1_delays_wgrad(experts: Any) -> bool:
    """Whether the experts' FC1 keeps its inputs in TE's wgrad store for ``backward_dw`` (by the module, once)."""
    fc1 = getattr(experts, "linear_fc1", None)
    if fc1 is None:
        return False
    if getattr(experts, "_with_fused_impl", False):
        return bool(getattr(fc1, "delay_wgrad_compute", False))
    need = getattr(fc1, "need_backward_dw", None)
    return bool(need()) if callable(need) else False


def hook_delayed_wgrad(inst: Installation, layer: Any) -> deque[Any] | None:
    """With delayed wgrad, finish the oldest dispatch-slot hold after each ``experts.backward_dw()``.

    TE's FC1 puts its saved input (the dispatch slot, bf16 without a sort copy) into its wgrad store
    when its backward runs, after autograd freed the saved reference that release-by-fact waits for;
    ``backward_dw()`` reads it later (in combined 1F1B after the next microbatch's dispatch, on
    ``_delayed_wgrad_stream`` under ``overlap_dispatch_backward_with_experts_wgrad``). The dispatch
    hook queues one entry per grad-enabled forward (a hold where the experts saved the slot, else None);
    this override takes them in order (TE's store is a FIFO queue, one entry per backward) and finishes a
    hold on the stream ``backward_dw`` ran on. None when FC1 computes its wgrad in
    backward (nothing to hold).
    """
    from bufreuse.plan.rules import delayed_wgrad

    experts = layer.experts
    if not delayed_wgrad(layer.config) or not _fc1_delays_wgrad(experts):
        return None
    holds: deque[Any] = deque()
    orig = inst.original(experts, "backward_dw")

    def backward_dw(*args: Any, **kwargs: Any) -> Any:
        result = orig(*args, **kwargs)
        if holds:
            hold = holds.popleft()  # this microbatch's entry (None: nothing was held for it)
            if hold is not None:
                hold.done()  # FC1's wgrad read the slot on the current stream: released after it
        return result

    inst.override(experts, "backward_dw", functools.wraps(experts.backward_dw)(backward_dw))
    return holds


def passthrough_combine_stages(disp: Any) -> frozenset[str]:
    """Combine stages that return a view of their input, so cannot save it (megatron-core 0.19.2 / 0.16.1 code).

    At EP x TP = 1 ``token_combine``'s all-to-all returns its input (without overlapped shared
    experts), and ``combine_preprocess``'s unsort is a no-op or, in pad-to-capacity mode, a
    ``view().transpose()`` of a size-1 dimension whose ``contiguous()`` is the same storage.
    """
    ep, tp = int(getattr(disp, "ep_size", 1) or 1), int(getattr(disp, "tp_size", 1) or 1)
    if ep * tp != 1:
        return frozenset()
    out = set()
    if getattr(disp, "shared_experts", None) is None:
        out.add("token_combine")
    if int(getattr(disp, "num_local_experts", 1) or 1) == 1 or bool(getattr(disp, "drop_and_pad", False)):
        out.add("combine_preprocess")
    return frozenset(out)


def hook_fc2_release(inst: Installation, layer: Any, queue: deque[Held]) -> None:
    """Release the front FC2 slot of ``queue`` after the first combine stage whose output no longer views it.

    That stage is its last forward reader; the release still waits for anything a stage saved
    from it (the unpermute's ``index_add_`` under deterministic algorithms saves its source). A
    stage runs in a saved-tensor region only when it receives one of this layer's queued FC2 slots
    (debug mode: any ring storage, so strict mode sees a released slot being saved); with no FC2 slot
    queued (the stages after the release) production pays one emptiness test. A stage that can only return
    a view of its input (:func:`passthrough_combine_stages`) is not hooked at all (in debug mode it
    is, and raises if it saved the slot after all). Shared by the ``SequentialMLP`` hook here and
    the TE adapter's grouped-MLP hooks.
    """
    disp, pool = layer.token_dispatcher, inst.pool
    run = pool.track_saved().run
    skip = passthrough_combine_stages(disp)
    debug = pool.debug
    views = pool.views_ring_storage

    def _after(stage: Callable[..., Any]) -> Callable[..., Any]:
        def combine_stage(*args: Any, **kwargs: Any) -> Any:
            if not queue and not debug:
                return stage(*args, **kwargs)
            first = args[0] if args else next(iter(kwargs.values()), None)
            if debug:
                track = views(first)  # any ring's storage: strict mode also sees a released slot being saved
            else:
                try:
                    ptr = first.data_ptr()
                except (AttributeError, RuntimeError, TypeError):
                    ptr = -1
                # a queued slot of this layer (any of them: robust to a front entry a raising forward left)
                track = (
                    any(held.lo <= ptr < held.hi for held in queue)
                    if len(queue) > 1
                    else queue[0].lo <= ptr < queue[0].hi
                )
            out = run(stage, args, kwargs) if track else stage(*args, **kwargs)
            if queue:
                front = queue[0]
                try:
                    ptr = out.data_ptr()
                except (AttributeError, RuntimeError, TypeError):
                    ptr = -1
                if not front.lo <= ptr < front.hi:
                    queue.popleft().release()
            return out

        return functools.wraps(stage)(combine_stage)

    for name in ("combine_preprocess", "token_combine", "combine_postprocess"):
        if name in skip:
            if debug:
                inst.override(disp, name, _checked_passthrough(inst, name, inst.original(disp, name), queue))
            continue
        inst.override(disp, name, _after(inst.original(disp, name)))


def _checked_passthrough(inst: Installation, name: str, stage: Callable[..., Any], queue: deque[Held]) -> Any:
    """Debug mode: a stage production leaves unhooked, tracked, raising if it saved the front slot."""
    pool = inst.pool

    @functools.wraps(stage)
    def checked(*args: Any, **kwargs: Any) -> Any:
        front = queue[0] if queue else None
        before = pool.saved_references(front.name, front.tensor) if front is not None else 0
        out = stage(*args, **kwargs)
        if front is not None and pool.saved_references(front.name, front.tensor) > before:
            raise BackendContractError(
                "megatron-core",
                name,
                "saved the expert FC2 slot for backward, where production mode expects a view of its input",
                hint="production mode does not track this stage and would release the slot early; report this "
                "with the megatron-core version",
            )
        return out

    return tracked(pool, checked)


def track_fc2_stage(inst: Installation, layer: Any) -> None:
    """With the FC2 ring in use: ``layer.routed_experts_compute`` runs in the saved-tensor region on every call.

    That stage makes the FC2 slot (the experts' forward) and hands it on (``combine_preprocess``); whatever
    saves it in between (megatron's own code, a forward hook on the experts) is counted, so the release at
    the combine waits for it (release by fact; the later combine stages are tracked when they receive a
    slot, :func:`hook_fc2_release`). Where this layer's dispatch hook (all-to-all: :func:`_hook_dispatch`;
    HybridEP: ``hybridep.hooks``) wraps the stage it does so on every call instead, so nothing is wrapped twice.
    """
    if inst.hooks("alltoall", layer, "dispatch") or inst.hooks("hybridep", layer, "dispatch"):
        return
    inst.override(layer, "routed_experts_compute", tracked(inst.pool, inst.original(layer, "routed_experts_compute")))


def _hook_expert(inst: Installation, layer: Any, state: _LayerState) -> None:
    import torch
    from megatron.core.transformer.moe.experts import SequentialMLP

    from bufreuse.integrations._compat_megatron import pad_for_quantization
    from bufreuse.integrations.alltoall.functions import CatIntoRing

    experts, pool = layer.experts, inst.pool
    if not isinstance(experts, SequentialMLP):
        raise ConfigError(
            f"expert-output reuse on the NCCL path hooks SequentialMLP or TEGroupedMLP on Transformer Engine; found "
            f"{type(experts).__name__} (set moe_grouped_gemm=False, or use TE's grouped MLP with GroupedLinear(out=))"
        )
    cfg = experts.config
    quantized = bool(cfg.fp8 or cfg.fp4)
    box: list[Held] = []
    calls = [inst.original(e, "__call__") for e in experts.local_experts]  # e(x): the module's hooks run

    def forward(hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor, **kw: Any) -> Any:
        if kw:
            raise ConfigError(f"SequentialMLP hook got unsupported expert kwargs {sorted(kw)}")
        if cfg.moe_apply_probs_on_input:
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
        parts = []
        for expert, tokens, p in zip(calls, torch.split(hidden, counts), torch.split(probs, counts), strict=True):
            if quantized:
                padded, p = pad_for_quantization(experts, tokens, p)
                out, _ = expert(padded, p)
                out = out[: tokens.shape[0]]
            else:
                out, _ = expert(tokens, p)
            parts.append(out)
        output = CatIntoRing.apply(pool, EXPERT, box, *parts)
        state.fc2.append(box.pop())
        return output, None

    inst.override(experts, "forward", forward)
    track_fc2_stage(inst, layer)
    hook_fc2_release(inst, layer, state.fc2)


ADAPTER = AllToAllAdapter()
