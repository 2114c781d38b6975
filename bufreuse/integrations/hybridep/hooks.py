"""The HybridEP adapter: the flex dispatcher's ``_HybridEPManager`` writes the dispatch output into a slot.

``_HybridEPManager.dispatch`` (per instance) acquires a ``dispatch_output`` buffer of the static
bound the manager computed in ``setup_metadata`` (``num_permuted_tokens``: the rank-capacity budget
rounded up to the quantization alignment, or capacity x EP x local experts with pad-to-capacity)
and arms it; megatron's ``HybridEPDispatch`` then calls the process-wide buffer, which an
:class:`~bufreuse.integrations.hybridep.output_token.OutputTokenInjector` wraps while any hook is alive, so
DeepEP receives the slot as ``output_token=`` (upstream DeepEP lacks it; ``scripts/deepep_output_token.py``
adds it). Released by fact after ``routed_experts_compute``, which runs in the pool's saved-tensor region
on every call: FP8/FP4 expert GEMMs save a quantized copy, so the experts' forward is its final reader,
and whatever does save the slot (a hook) holds it until that reference is gone. bf16 experts save it for
backward on every microbatch: refused at install for the ring policy (the allocator policies only drop
the pool's reference). Shared-expert overlap is fine here: the flex dispatcher's overlapped shared
expert never reads the dispatch output. The expert FC2 output of these layers is the TE adapter's
(:mod:`bufreuse.integrations.te.hooks`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from bufreuse.config import static_bounds
from bufreuse.errors import BackendContractError, ConfigError
from bufreuse.integrations.core import (
    BOTH,
    DISPATCH,
    REUSE,
    RING,
    CheckContext,
    Held,
    Installation,
    Requirement,
    acquire_with_hint,
    cfg_get,
    tracked,
)

__all__ = ["ADAPTER", "HybridEPAdapter", "is_hybridep_layer"]

_HYBRIDEP = frozenset({"hybridep"})


def _static_bound(c: CheckContext) -> bool:
    pad = bool(cfg_get(c.cfg, "moe_pad_expert_input_to_capacity", False))
    return cfg_get(c.cfg, "moe_expert_rank_capacity_factor", None) is not None or (
        pad and cfg_get(c.cfg, "moe_expert_capacity_factor", None) is not None
    )


ROWS: tuple[Requirement, ...] = (
    Requirement(
        key="static_bound",
        buffers=BOTH,
        paths=_HYBRIDEP,
        policies=REUSE,
        text="a static HybridEP output bound",
        fix="set moe_expert_rank_capacity_factor (0.19+), or moe_pad_expert_input_to_capacity=True "
        "with moe_expert_capacity_factor",
        why="the caller hands HybridEP its output before the kernel runs (ring slots are even sized once); "
        "its dynamic output size has no bound otherwise",
        test=_static_bound,
    ),
    Requirement(
        key="ep_overlap",
        buffers=BOTH,
        paths=_HYBRIDEP,
        policies=RING,
        text="EP communication overlap (combined-1F1B)",
        fix="set overlap_moe_expert_parallel_comm=True (needs expert_model_parallel_size > 1)",
        why="HybridEP exposes no consumer-depth bound; only the combined-1F1B schedule bounds slots in flight",
        test=lambda c: bool(cfg_get(c.cfg, "overlap_moe_expert_parallel_comm", False)),
    ),
    Requirement(
        key="quantized_experts",
        buffers=frozenset({"dispatch"}),
        paths=_HYBRIDEP,
        policies=RING,
        text="FP8 or FP4 expert GEMMs",
        fix="set fp8 (e.g. 'e4m3') or fp4 (needs Transformer Engine)",
        why="bf16 expert GEMMs save the dispatch slot for backward; the quantized copy is what FP8/FP4 saves",
        test=lambda c: bool(cfg_get(c.cfg, "fp8", None) or cfg_get(c.cfg, "fp4", None)),
    ),
    Requirement(
        key="deepep_output_token",
        buffers=frozenset({"dispatch"}),
        paths=_HYBRIDEP,
        policies=REUSE,
        text="DeepEP HybridEPBuffer.dispatch_with_permute(..., output_token=...)",
        fix="install a DeepEP hybrid-ep build whose dispatch_with_permute accepts output_token",
        why="HybridEP allocates its output itself unless the caller can hand it a buffer",
        test=lambda c: c.features.deepep_output_token,
    ),
)

_armed: list[Any] = []
"""The slot the next forward HybridEP dispatch writes into (at most one, set around the call)."""
_users = 0
"""Hooked HybridEP dispatches alive; the fused_a2a injection stays while any is."""
_fused_a2a_undo: list[Any] = []


def is_hybridep_layer(layer: Any) -> bool:
    """Whether ``layer`` dispatches through megatron-core's flex dispatcher with the HybridEP manager."""
    from megatron.core.transformer.moe import token_dispatcher as td

    from bufreuse.integrations._compat_megatron import comm_manager, hybridep_manager_cls

    disp = getattr(layer, "token_dispatcher", None)
    manager_cls = hybridep_manager_cls()
    return (
        isinstance(disp, td.MoEFlexTokenDispatcher)
        and manager_cls is not None
        and isinstance(comm_manager(disp), manager_cls)
    )


class HybridEPAdapter:
    """Hooks the dispatch output of a flex-dispatcher layer on the HybridEP backend."""

    name = "hybridep"
    path = "hybridep"
    buffers = frozenset({"dispatch"})
    dispatcher = True
    label = "HybridEP"

    def supports(self, layer: Any) -> bool:
        return is_hybridep_layer(layer)

    def requirements(self) -> tuple[Requirement, ...]:
        return ROWS

    def check(self, installation: Installation, layer: Any) -> list[str]:
        """The static bound of every enabled buffer (the path's), then what the dispatch hook needs."""
        from megatron.core.transformer.moe import fused_a2a

        from bufreuse.integrations.hybridep.output_token import require_output_token

        knobs, cfg = installation.knobs, layer.config
        bounds = static_bounds(installation.config_of(layer), knobs, path="hybridep", tokens=installation.tokens)
        problems = [
            f"no static HybridEP output bound for '{b.buffer}': {b.source}" for b in bounds.values() if not b.rows
        ]
        enabled = knobs.enabled()
        if "dispatch" in enabled:
            try:
                require_output_token(getattr(fused_a2a, "HybridEPBuffer", None))
            except ConfigError as e:
                problems.append(str(e))
            quantized = getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None)
            if enabled["dispatch"] == "ring" and not quantized:
                problems.append(
                    "dispatch-output reuse on HybridEP with a ring needs FP8/FP4 expert GEMMs (bf16 GEMMs save the "
                    "dispatch slot for backward): set fp8 or fp4, or moe_hybridep_reuse_dispatch_output_buffers=False"
                )
        return problems

    def hook(self, installation: Installation, layer: Any) -> None:
        import torch
        from megatron.core.transformer.moe import fused_a2a

        if not installation.hooks(self.name, layer, "dispatch"):
            return  # the one gate track_fc2_stage also reads: the experts stage is wrapped here iff this hooks
        cfg = installation.config_of(layer)  # the EP / expert-TP sizes the dispatcher really uses
        bounds = static_bounds(cfg, installation.knobs, path="hybridep", tokens=installation.tokens)
        installation.register("dispatch", bounds["dispatch"], getattr(layer.config, "params_dtype", torch.float32), cfg)
        _inject(installation, fused_a2a)
        _hook_dispatch(installation, layer)


def _take() -> Any:
    return _armed.pop() if _armed else None


def _inject(inst: Installation, fused_a2a: Any) -> None:
    """Wrap fused_a2a's process-wide HybridEP buffer (now, or when megatron creates it) while hooks live."""
    from bufreuse.integrations._compat_megatron import patch_hybrid_ep_buffer
    from bufreuse.integrations.hybridep.output_token import OutputTokenInjector

    global _users
    if _users == 0:
        restore = patch_hybrid_ep_buffer(
            fused_a2a,
            wrap=lambda buf: OutputTokenInjector(buf, _take),
            unwrap=lambda obj: obj.inner if isinstance(obj, OutputTokenInjector) else None,
        )

        def undo() -> None:
            restore()
            _armed.clear()

        _fused_a2a_undo.append(undo)
    _users += 1

    def release_user() -> None:
        global _users
        _users -= 1
        if _users == 0:
            while _fused_a2a_undo:
                _fused_a2a_undo.pop()()

    inst.on_uninstall(release_user)


def _hook_dispatch(inst: Installation, layer: Any) -> None:
    import torch

    from bufreuse.integrations._compat_megatron import comm_manager

    mgr, pool = comm_manager(layer.token_dispatcher), inst.pool
    orig_dispatch, orig_compute = inst.original(mgr, "dispatch"), inst.original(layer, "routed_experts_compute")
    held: deque[Held] = deque()

    def dispatch(hidden_states: torch.Tensor, async_finish: bool = True, allocate_on_comm_stream: bool = True) -> Any:
        rows = mgr.num_permuted_tokens
        if rows is None or isinstance(rows, torch.Tensor):
            raise ConfigError(
                "HybridEP dispatch has no static output bound this step; set moe_expert_rank_capacity_factor "
                "or moe_pad_expert_input_to_capacity"
            )
        slot = acquire_with_hint(pool, DISPATCH, (int(rows), hidden_states.shape[-1]), hidden_states.dtype)
        _armed.append(slot)
        try:
            out = orig_dispatch(hidden_states, async_finish, allocate_on_comm_stream)
            if _armed:
                raise BackendContractError(
                    "HybridEP",
                    "dispatch",
                    "bypassed fused_a2a's process-wide buffer",
                    hint="the ring slot was not used",
                )
        except BaseException:
            _armed.clear()
            pool.release(DISPATCH, slot)
            raise
        held.append(Held(pool=pool, name=DISPATCH, tensor=slot))
        return out

    def routed_experts_compute(hidden_states: torch.Tensor, probs: torch.Tensor) -> Any:
        result = compute(hidden_states, probs)
        if held:
            held.popleft().release()  # the experts' forward read it last; what they saved of it is counted
        return result

    compute = tracked(pool, orig_compute)  # every call: release by fact (the FC2 stage's region too)
    inst.override(mgr, "dispatch", dispatch)
    inst.override(layer, "routed_experts_compute", routed_experts_compute)


ADAPTER = HybridEPAdapter()
