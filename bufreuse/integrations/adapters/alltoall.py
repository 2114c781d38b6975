"""The NCCL all-to-all adapter: ``MoEAlltoAllTokenDispatcher`` layers, both buffers.

Per ``MoELayer`` instance it overrides:

- ``token_dispatch``: the tokens all-to-all writes into a ``dispatch_output`` slot;
- ``dispatch_postprocess``: notes whether the experts read the slot directly;
- ``routed_experts_compute``: releases the dispatch slot after its final forward reader, or defers
  the release to backward when the expert GEMM saved it (bf16 input, one local expert, no TP);
- ``experts.forward`` (``SequentialMLP``): FC2 outputs concatenated into an ``expert_fc2_output`` slot;
- ``combine_preprocess`` / ``token_combine`` / ``combine_postprocess``: release the FC2 slot after
  the first stage whose output no longer aliases it (its final reader); when that is the unpermute,
  which may save it for backward (``index_add_`` under deterministic algorithms), the release waits
  for that backward.

The autograd Functions doing the writes live in :mod:`bufreuse.integrations.alltoall`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bufreuse.config import static_bounds
from bufreuse.errors import ConfigError
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
    aliases,
    cfg_get,
)

__all__ = ["ADAPTER", "AllToAllAdapter"]

_ALLTOALL = frozenset({"alltoall"})


def _no_moe_recompute(c: CheckContext) -> bool:
    gran = cfg_get(c.cfg, "recompute_granularity", None)
    mods = cfg_get(c.cfg, "recompute_modules", None) or []
    return (
        gran != "full"
        and not (gran == "selective" and "moe" in mods)
        and not cfg_get(c.cfg, "moe_layer_recompute", False)
    )


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
        key="sequential_mlp",
        buffers=frozenset({"expert"}),
        paths=_ALLTOALL,
        policies=REUSE,
        text="local SequentialMLP experts (moe_grouped_gemm=False)",
        fix="set moe_grouped_gemm=False (the grouped MLP takes the buffer only through the TE adapter)",
        why="on the NCCL path the FC2 output is written into the buffer by the SequentialMLP hook",
        test=lambda c: not cfg_get(c.cfg, "moe_grouped_gemm", False),
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
        key="no_moe_recompute",
        buffers=BOTH,
        paths=_ALLTOALL,
        policies=RING,
        text="no MoE-layer activation recompute",
        fix="drop 'moe' from recompute_modules, set moe_layer_recompute=False and recompute_granularity!='full'",
        why="recompute re-runs dispatch during backward and needs extra slots; not validated",
        test=_no_moe_recompute,
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
    dispatch_direct: bool = False
    fc2: Held | None = None


class AllToAllAdapter:
    """Hooks both buffers of a ``MoEAlltoAllTokenDispatcher`` layer (the NCCL all-to-all path)."""

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
        for buf, bound in static_bounds(layer.config, knobs, path="alltoall", tokens=installation.tokens).items():
            installation.register(buf, bound, dtype)
        state = _LayerState()
        enabled = knobs.enabled()
        if "dispatch" in enabled:
            _hook_dispatch(installation, layer, state)
        if "expert" in enabled:
            _hook_expert(installation, layer, state)


def _hook_dispatch(inst: Installation, layer: Any, state: _LayerState) -> None:
    import torch
    from megatron.core.tensor_parallel import all_to_all

    from bufreuse.integrations._compat_megatron import dtoh_and_synchronize
    from bufreuse.integrations.alltoall import RingAllToAll

    disp, pool = layer.token_dispatcher, inst.pool
    orig_post, orig_compute = disp.dispatch_postprocess, layer.routed_experts_compute
    if getattr(disp, "shared_experts", None) is not None:
        raise ConfigError("dispatch-output reuse does not support moe_shared_expert_overlap; set it to False")

    def token_dispatch(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        disp.tokens_per_expert = dtoh_and_synchronize(disp, "before_ep_alltoall", disp.tokens_per_expert)
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

    inst.override(disp, "token_dispatch", token_dispatch)
    inst.override(disp, "dispatch_postprocess", dispatch_postprocess)
    inst.override(layer, "routed_experts_compute", routed_experts_compute)


def _hook_expert(inst: Installation, layer: Any, state: _LayerState) -> None:
    import torch
    from megatron.core.transformer.moe.experts import SequentialMLP

    from bufreuse.integrations._compat_megatron import pad_for_quantization
    from bufreuse.integrations.alltoall import CatIntoRing

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
                padded, p = pad_for_quantization(experts, tokens, p)
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

    inst.override(experts, "forward", forward)
    # The sort/copy in combine_preprocess and the all-to-all save nothing; the unpermute in
    # combine_postprocess may (index_add_ under deterministic algorithms saves its source).
    for name, may_save in (("combine_preprocess", False), ("token_combine", False), ("combine_postprocess", True)):
        inst.override(disp, name, _after(getattr(disp, name), may_save))


ADAPTER = AllToAllAdapter()
