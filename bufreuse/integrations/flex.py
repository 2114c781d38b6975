"""The HybridEP flex-dispatcher path: dispatch output and expert FC2 output from pool buffers.

:func:`hook_hybridep_layer` is what :func:`bufreuse.integrations.megatron.install` calls for a
``MoELayer`` whose ``MoEFlexTokenDispatcher`` runs the ``_HybridEPManager`` (megatron-core 0.19.x).
Everything it replaces is recorded on the :class:`~bufreuse.integrations.megatron.Installation`
and put back by ``uninstall()``; nothing happens at import.

- dispatch output: ``_HybridEPManager.dispatch`` (per instance) acquires a ``dispatch_output``
  buffer of the static bound the manager computed in ``setup_metadata`` (``num_permuted_tokens``:
  the rank-capacity budget rounded up to the quantization alignment, or capacity x EP x local
  experts with pad-to-capacity) and arms it; megatron's ``HybridEPDispatch`` then calls the
  process-wide buffer, which an :class:`~bufreuse.integrations.hybridep.OutputTokenInjector` wraps
  while any hook is alive, so DeepEP receives the slot as ``output_token=``. Released after
  ``routed_experts_compute`` (the experts are its final reader; FP8/FP4 expert GEMMs save a
  quantized copy, so nothing reads it in backward). bf16 experts would save the slot itself:
  refused at install for the ring policy (the allocator policies only drop the pool's reference,
  so what autograd saved stays alive). Shared-expert overlap is fine here: the flex dispatcher's
  overlapped shared expert never reads the dispatch output.
- expert FC2 output: ``TEGroupedMLP.forward`` (per instance) acquires an ``expert_fc2_output``
  buffer with the exact output shape and passes a detached alias as ``output_buffer=`` (megatron
  routes it to TE as ``op_kwargs[-1][OUTPUT_BUFFER_KEY]``). Released after ``token_combine``,
  HybridEP combine's forward being the last reader (its backward is a dispatch of the gradient);
  under EP overlap combine runs on the communication stream, so the release is recorded there.

Only fakes run this here: no DeepEP with HybridEP installs from PyPI and TE's torch part needs
a CUDA build (tests/test_integrations_flex.py; docs/megatron.md says which hardware ran what).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from bufreuse.config import BufReuseConfig, static_bounds
from bufreuse.errors import ConfigError
from bufreuse.integrations.alltoall import Held, acquire_with_hint
from bufreuse.integrations.hybridep import OutputTokenInjector, require_output_token
from bufreuse.integrations.te import output_alias, require_fused_output_buffer

__all__ = ["hook_hybridep_layer", "is_hybridep_layer"]

DISPATCH, EXPERT = "dispatch_output", "expert_fc2_output"
_armed: list[torch.Tensor] = []
"""The slot the next forward HybridEP dispatch writes into (at most one, set around the call)."""
_users = 0
"""Hooked HybridEP layers alive; the fused_a2a injection stays while any is."""
_fused_a2a_undo: list[Any] = []


@dataclass(slots=True)
class _Held:
    dispatch: deque[Held] = field(default_factory=deque)
    fc2: deque[Held] = field(default_factory=deque)


def is_hybridep_layer(layer: Any) -> bool:
    """Whether ``layer`` dispatches through megatron-core's flex dispatcher with the HybridEP manager."""
    from megatron.core.transformer.moe import token_dispatcher as td

    disp = getattr(layer, "token_dispatcher", None)
    manager_cls = getattr(td, "_HybridEPManager", None)
    return (
        isinstance(disp, td.MoEFlexTokenDispatcher)
        and manager_cls is not None
        and isinstance(getattr(disp, "_comm_manager", None), manager_cls)
    )


def hook_hybridep_layer(inst: Any, layer: Any, tokens: int) -> None:
    """Check, register and hook one HybridEP ``MoELayer`` (``inst`` is the megatron ``Installation``).

    Raises :class:`ConfigError` listing every unmet requirement before anything is replaced.
    """
    from megatron.core.transformer.moe import experts as experts_mod
    from megatron.core.transformer.moe import fused_a2a

    knobs: BufReuseConfig = inst.knobs
    cfg, enabled = layer.config, knobs.enabled()
    bounds = static_bounds(cfg, knobs, path="hybridep", tokens=tokens)
    problems = [f"no static HybridEP output bound for '{b.buffer}': {b.source}" for b in bounds.values() if not b.rows]
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
    if "expert" in enabled:
        try:
            require_fused_output_buffer(layer.experts, experts_mod)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("cannot hook the HybridEP MoE layer: " + "; ".join(problems))

    dtype = getattr(cfg, "params_dtype", torch.float32)
    for buf, bound in bounds.items():
        inst.pool.register(
            DISPATCH if buf == "dispatch" else EXPERT,
            policy=enabled[buf],
            num_slots=knobs.slots(buf),
            max_shape=(bound.rows, bound.hidden),
            dtype=dtype,
        )
    held = _Held()
    if "dispatch" in enabled:
        _inject(inst, fused_a2a)
        _hook_dispatch(inst, layer, held)
    if "expert" in enabled:
        _hook_expert(inst, layer, held)


def _override(inst: Any, obj: Any, attr: str, fn: Any) -> None:
    from bufreuse.integrations.megatron import _override as override

    override(inst, obj, attr, fn)


def _take() -> torch.Tensor | None:
    return _armed.pop() if _armed else None


def _inject(inst: Any, fused_a2a: Any) -> None:
    """Wrap fused_a2a's process-wide HybridEP buffer (now, or when megatron creates it) while hooks live."""
    global _users
    if _users == 0:
        orig_init = fused_a2a.init_hybrid_ep_buffer

        def init_hybrid_ep_buffer(*args: Any, **kwargs: Any) -> None:
            orig_init(*args, **kwargs)
            _wrap(fused_a2a)

        fused_a2a.init_hybrid_ep_buffer = init_hybrid_ep_buffer
        _wrap(fused_a2a)

        def restore() -> None:
            fused_a2a.init_hybrid_ep_buffer = orig_init
            buf = getattr(fused_a2a, "_hybrid_ep_buffer", None)
            if isinstance(buf, OutputTokenInjector):
                fused_a2a._hybrid_ep_buffer = buf.inner
            _armed.clear()

        _fused_a2a_undo.append(restore)
    _users += 1

    def release_user() -> None:
        global _users
        _users -= 1
        if _users == 0:
            while _fused_a2a_undo:
                _fused_a2a_undo.pop()()

    inst._undo.append(release_user)


def _wrap(fused_a2a: Any) -> None:
    buf = getattr(fused_a2a, "_hybrid_ep_buffer", None)
    if buf is not None and not isinstance(buf, OutputTokenInjector):
        fused_a2a._hybrid_ep_buffer = OutputTokenInjector(buf, _take)


def _hook_dispatch(inst: Any, layer: Any, held: _Held) -> None:
    mgr, pool = layer.token_dispatcher._comm_manager, inst.pool
    orig_dispatch, orig_compute = mgr.dispatch, layer.routed_experts_compute

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
                raise RuntimeError(
                    "HybridEP dispatch bypassed fused_a2a's process-wide buffer; the ring slot was not used"
                )
        except BaseException:
            _armed.clear()
            pool.release(DISPATCH, slot)
            raise
        held.dispatch.append(Held(pool=pool, name=DISPATCH, tensor=slot))
        return out

    def routed_experts_compute(hidden_states: torch.Tensor, probs: torch.Tensor) -> Any:
        result = orig_compute(hidden_states, probs)
        if held.dispatch:
            held.dispatch.popleft().release()  # the experts were its final reader
        return result

    _override(inst, mgr, "dispatch", dispatch)
    _override(inst, layer, "routed_experts_compute", routed_experts_compute)


def _hook_expert(inst: Any, layer: Any, held: _Held) -> None:
    experts, disp, pool = layer.experts, layer.token_dispatcher, inst.pool
    orig_forward, orig_combine = experts.forward, disp.token_combine
    cols = int(getattr(layer.config, "moe_latent_size", None) or layer.config.hidden_size)

    def forward(
        hidden: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        probs: torch.Tensor,
        output_buffer: torch.Tensor | None = None,
        grad_input_buffer: torch.Tensor | None = None,
    ) -> Any:
        if output_buffer is not None:
            raise ConfigError("the dispatcher already supplies an expert output buffer; disable expert-output reuse")
        shape = (hidden.shape[0], cols)
        slot = acquire_with_hint(pool, EXPERT, shape, hidden.dtype)
        try:
            output, bias = orig_forward(
                hidden,
                tokens_per_expert,
                probs,
                output_buffer=output_alias(slot, shape),
                grad_input_buffer=grad_input_buffer,
            )
            if output.data_ptr() != slot.data_ptr():
                raise RuntimeError("Transformer Engine ignored the FC2 output buffer (returned other storage)")
        except BaseException:
            pool.release(EXPERT, slot)
            raise
        held.fc2.append(Held(pool=pool, name=EXPERT, tensor=slot))
        return output, bias

    def token_combine(hidden_states: torch.Tensor, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        out = orig_combine(hidden_states, async_finish, allocate_on_comm_stream)
        if held.fc2:
            held.fc2.popleft().release()  # combine's forward read it last, on the stream it ran on
        return out

    _override(inst, experts, "forward", forward)
    _override(inst, disp, "token_combine", token_combine)
