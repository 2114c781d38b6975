"""Plug a :class:`~bufreuse.pool.BufferPool` into megatron-core's MoE layers (explicit, reversible).

``install(model, pool, knobs, tokens=...)`` (or ``with installed(...)``) registers the two buffers
and overrides, per ``MoELayer`` instance with the NCCL all-to-all dispatcher:

- ``token_dispatcher.token_dispatch``: the tokens all-to-all writes into a ``dispatch_output`` slot;
- ``token_dispatcher.dispatch_postprocess``: notes whether the experts read the slot directly;
- ``routed_experts_compute``: releases the dispatch slot after its final forward reader, or defers
  the release to backward when the expert GEMM saved it (bf16 input, one local expert, no TP);
- ``experts.forward`` (``SequentialMLP``): FC2 outputs concatenated into an ``expert_fc2_output`` slot;
- ``token_dispatcher.combine_preprocess`` / ``token_combine`` / ``combine_postprocess``: release the
  FC2 slot after the first stage whose output no longer aliases it (its final reader); when that is
  the unpermute, which may save it for backward (``index_add_`` under deterministic algorithms,
  found by the pool's autograd guard on the H200), the release waits for that backward.

Two class-level patches make megatron's own release paths skip ring storage through the pool's
pure probe: ``ScheduleNode._forward`` (``free_input=True`` would ``resize_(0)`` a slot) and
``ChunkOffloadHandler.bulk_offload`` (``forced_released_tensors``); they stay while any
installation is alive (one per model chunk with virtual pipelining), and so does a third: the
full-iteration CUDA-graph wrapper (``FullCudaGraphWrapper.__call__``) runs its capture inside the
pools' capture phase and orders replays and eager calls (:mod:`bufreuse.integrations.graphs`).
``uninstall()`` restores everything. Nothing is patched at import time. HybridEP layers are refused here: their adapter
(:mod:`bufreuse.integrations.hybridep`) needs a DeepEP with ``output_token``, which no release has.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from bufreuse.config import BufReuseConfig, static_bounds
from bufreuse.errors import ConfigError
from bufreuse.integrations.alltoall import CatIntoRing, Held, RingAllToAll, aliases
from bufreuse.integrations.graphs import patch_full_iteration
from bufreuse.pool import BufferPool

__all__ = ["Installation", "install", "installed"]

DISPATCH, EXPERT = "dispatch_output", "expert_fc2_output"
_MARK = "_bufreuse_hooked"
_active: list[Installation] = []
"""Installations alive now; the class-level release-path patches stay while any is."""
_release_undo: list[Callable[[], None]] = []


@dataclass(slots=True)
class _LayerState:
    dispatch: Held | None = None
    dispatch_direct: bool = False
    fc2: Held | None = None


@dataclass(slots=True)
class Installation:
    """What ``install`` replaced; ``uninstall()`` puts it back (idempotent)."""

    pool: BufferPool
    knobs: BufReuseConfig
    layers: int = 0
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()
        if self in _active:
            _active.remove(self)
            if not _active:
                while _release_undo:
                    _release_undo.pop()()

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def install(model: torch.nn.Module | list, pool: BufferPool, knobs: BufReuseConfig, *, tokens: int) -> Installation:
    """Register the enabled buffers on ``pool`` and hook every all-to-all ``MoELayer`` in ``model``.

    ``tokens``: tokens per rank per microbatch entering a MoE layer (sizes the static bound).
    Raises :class:`ConfigError` for MoE layers on another dispatcher, already hooked, or with settings
    the hooks do not replay (shared-expert overlap, non-SequentialMLP experts). Run ``validate`` first.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not tokens or tokens < 1:
        raise ConfigError(f"install needs tokens per microbatch >= 1 to size the buffers, got {tokens!r}")
    inst = Installation(pool=pool, knobs=knobs)
    modules = model if isinstance(model, list) else [model]
    layers = [m for root in modules for m in root.modules() if isinstance(m, MoELayer)]
    if any(_MARK in vars(m) for m in layers):
        raise ConfigError("bufreuse hooks are already installed on these MoE layers; uninstall() them first")
    from bufreuse.integrations import flex  # the HybridEP flex-dispatcher path

    bad = [
        type(m.token_dispatcher).__name__
        for m in layers
        if not isinstance(m.token_dispatcher, MoEAlltoAllTokenDispatcher) and not flex.is_hybridep_layer(m)
    ]
    if bad:
        raise ConfigError(
            f"bufreuse hooks support MoEAlltoAllTokenDispatcher and the flex dispatcher's HybridEP backend; "
            f"found {sorted(set(bad))} (set moe_token_dispatcher_type='alltoall', or 'flex' with "
            "moe_flex_dispatcher_backend='hybridep')"
        )
    enabled = knobs.enabled()
    _active.append(inst)
    try:
        for layer in layers:
            if flex.is_hybridep_layer(layer):
                flex.hook_hybridep_layer(inst, layer, tokens)
                _override(inst, layer, _MARK, True)
                inst.layers += 1
                continue
            _register(pool, knobs, layer.config, tokens)
            state = _LayerState()
            if "dispatch" in enabled:
                _hook_dispatch(inst, layer, state)
            if "expert" in enabled:
                _hook_expert(inst, layer, state)
            _override(inst, layer, _MARK, True)
            inst.layers += 1
        if enabled and not _release_undo:
            _patch_release_paths()
    except BaseException:
        inst.uninstall()
        raise
    return inst


@contextlib.contextmanager
def installed(
    model: torch.nn.Module | list, pool: BufferPool, knobs: BufReuseConfig, *, tokens: int
) -> Iterator[Installation]:
    """``install`` for the duration of a ``with`` block."""
    inst = install(model, pool, knobs, tokens=tokens)
    try:
        yield inst
    finally:
        inst.uninstall()


def _register(pool: BufferPool, knobs: BufReuseConfig, cfg: Any, tokens: int) -> None:
    dtype = getattr(cfg, "params_dtype", torch.float32)
    for buf, bound in static_bounds(cfg, knobs, path="alltoall", tokens=tokens).items():
        name = DISPATCH if buf == "dispatch" else EXPERT
        pool.register(
            name,
            policy=knobs.enabled()[buf],
            num_slots=knobs.slots(buf),
            max_shape=(bound.rows, bound.hidden),
            dtype=dtype,
        )


def _override(inst: Installation, obj: Any, attr: str, fn: Callable[..., Any]) -> None:
    """Shadow ``obj.attr`` with an instance attribute; undo deletes it (the class method shows again)."""
    had = attr in vars(obj)
    old = vars(obj).get(attr)
    setattr(obj, attr, fn)

    def undo() -> None:
        if had:
            setattr(obj, attr, old)
        else:
            delattr(obj, attr)

    inst._undo.append(undo)


def _hook_dispatch(inst: Installation, layer: Any, state: _LayerState) -> None:
    disp, pool = layer.token_dispatcher, inst.pool
    orig_post, orig_compute = disp.dispatch_postprocess, layer.routed_experts_compute
    from megatron.core.tensor_parallel import all_to_all

    if getattr(disp, "shared_experts", None) is not None:
        raise ConfigError("dispatch-output reuse does not support moe_shared_expert_overlap; set it to False")

    def token_dispatch(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        disp.tokens_per_expert = disp._maybe_dtoh_and_synchronize("before_ep_alltoall", disp.tokens_per_expert)
        nccl = bool(getattr(disp, "use_nccl_stream", False))
        box: list[Held] = []
        out = RingAllToAll.apply(
            tokens, pool, DISPATCH, disp.ep_group, disp.output_splits, disp.input_splits, nccl, box
        )
        state.dispatch = box[0]
        kwargs = {"use_nccl_stream": nccl} if hasattr(disp, "use_nccl_stream") else {}
        global_probs = all_to_all(disp.ep_group, probs, disp.output_splits, disp.input_splits, **kwargs)
        return out, global_probs

    def dispatch_postprocess(hidden: torch.Tensor, probs: torch.Tensor) -> Any:
        result = orig_post(hidden, probs)
        held = state.dispatch
        state.dispatch_direct = held is not None and aliases(result[0], held.tensor)
        if held is not None and not state.dispatch_direct:
            held.release()
            state.dispatch = None
        return result

    def routed_experts_compute(hidden: torch.Tensor, probs: torch.Tensor) -> Any:
        result = orig_compute(hidden, probs)
        held, state.dispatch = state.dispatch, None
        if held is not None and not held.released:
            saved = torch.is_grad_enabled() and held.tensor.requires_grad
            quantized = bool(getattr(layer.config, "fp8", None) or getattr(layer.config, "fp4", None))
            if saved and not quantized:
                held.release_in_backward = True
            else:
                held.release()
        return result

    _override(inst, disp, "token_dispatch", token_dispatch)
    _override(inst, disp, "dispatch_postprocess", dispatch_postprocess)
    _override(inst, layer, "routed_experts_compute", routed_experts_compute)


def _hook_expert(inst: Installation, layer: Any, state: _LayerState) -> None:
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts, disp, pool = layer.experts, layer.token_dispatcher, inst.pool
    if not isinstance(experts, SequentialMLP):
        raise ConfigError(
            f"expert-output reuse on the NCCL path hooks SequentialMLP; found {type(experts).__name__} "
            "(set moe_grouped_gemm=False, or use the TE adapter on a TE build)"
        )

    def forward(hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor, **kw: Any) -> Any:
        if kw:
            raise ConfigError(f"SequentialMLP hook got unsupported expert kwargs {sorted(kw)}")
        cfg = experts.config
        if cfg.moe_apply_probs_on_input:
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
        parts = []
        for expert, tokens, p in zip(
            experts.local_experts, torch.split(hidden, counts), torch.split(probs, counts), strict=True
        ):
            if cfg.fp8 or cfg.fp4:
                padded, p = experts._pad_tensor_for_quantization(tokens, p)
                out, _ = expert(padded, p)
                out = out[: tokens.shape[0]]
            else:
                out, _ = expert(tokens, p)
            parts.append(out)
        box: list[Held] = []
        output = CatIntoRing.apply(pool, EXPERT, box, *parts)
        state.fc2 = box[0]
        return output, None

    def _after(stage: Callable[..., Any], may_save: bool) -> Callable[..., Any]:
        @functools.wraps(stage)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = stage(*args, **kwargs)
            held = state.fc2
            if held is not None and not aliases(out, held.tensor):
                state.fc2 = None
                if may_save and torch.is_grad_enabled() and held.tensor.requires_grad:
                    held.release_in_backward = True
                else:
                    held.release()
            return out

        return wrapper

    _override(inst, experts, "forward", forward)
    # The sort/copy in combine_preprocess and the all-to-all save nothing; the unpermute in
    # combine_postprocess may (index_add_ under deterministic algorithms saves its source).
    for name, may_save in (("combine_preprocess", False), ("token_combine", False), ("combine_postprocess", True)):
        _override(inst, disp, name, _after(getattr(disp, name), may_save))


def _is_ring_storage(tensor: torch.Tensor) -> bool:
    """The pools' pure probe, over every live installation."""
    return isinstance(tensor, torch.Tensor) and any(i.pool.is_ring_storage(tensor) for i in _active)


def _patch_release_paths() -> None:
    """Make ScheduleNode.free_input and the offload forced release skip ring storage (pure probe)."""
    probe = _is_ring_storage
    try:
        from megatron.core.pipeline_parallel import utils as pp_utils
    except ImportError:
        pp_utils = None
    if pp_utils is not None and hasattr(pp_utils, "ScheduleNode"):
        _patch_class(pp_utils.ScheduleNode, "_forward", _skip_ring_free_input(pp_utils, probe))
    try:
        from megatron.core.pipeline_parallel import fine_grained_activation_offload as off
    except ImportError:
        off = None
    handler = getattr(off, "ChunkOffloadHandler", None) if off is not None else None
    if handler is not None and hasattr(handler, "bulk_offload"):
        _patch_class(handler, "bulk_offload", _skip_ring_forced_release(probe))
    patch_full_iteration(_release_undo, _active_pools)


def _active_pools() -> list[BufferPool]:
    """The pools of every live installation (what the full-iteration graph wrapper drives)."""
    return [i.pool for i in _active]


def _patch_class(cls: type, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    old = cls.__dict__[attr]
    setattr(cls, attr, make(old))
    _release_undo.append(lambda: setattr(cls, attr, old))


def _skip_ring_free_input(pp_utils: Any, probe: Callable[[torch.Tensor], bool]) -> Callable[..., Any]:
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def _forward(self: Any, *inputs: Any) -> Any:
            if not self.free_input or not any(probe(t) for t in inputs):
                return orig(self, *inputs)
            self.free_input = False
            try:
                out = orig(self, *inputs)
            finally:
                self.free_input = True
            symm = getattr(pp_utils, "is_symm_backed", None)
            for t in inputs:
                if t is None or probe(t):
                    continue
                t.record_stream(self.stream)
                if not (getattr(self, "ncclep_zero_copy", False) and symm is not None and symm(t)):
                    t.untyped_storage().resize_(0)
            return out

        return _forward

    return make


def _skip_ring_forced_release(probe: Callable[[torch.Tensor], bool]) -> Callable[..., Any]:
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def bulk_offload(self: Any, *args: Any, **kwargs: Any) -> Any:
            if "forced_released_tensors" in kwargs:
                kwargs["forced_released_tensors"] = [t for t in kwargs["forced_released_tensors"] if not probe(t)]
            elif args:
                args = (*args[:-1], [t for t in args[-1] if not probe(t)])
            return orig(self, *args, **kwargs)

        return bulk_offload

    return make
