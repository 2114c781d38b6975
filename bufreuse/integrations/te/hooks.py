"""The Transformer Engine adapter: the grouped MLP's FC2 output written into an ``expert_fc2_output`` slot.

Serves the expert buffer of layers whose experts are megatron-core's ``TEGroupedMLP``, by route:

- **op fuser** (``_with_fused_impl``; TE fuses it on SM100, not on Hopper): ``TEGroupedMLP.forward``
  (per instance) acquires a slot with the exact output shape and passes a detached alias as
  ``output_buffer=`` (megatron routes it to TE as ``op_kwargs[-1][OUTPUT_BUFFER_KEY]``). Taken on either
  path whenever megatron runs the fused grouped MLP.
- **module** (the non-fused ``TEGroupedMLP``, what Hopper runs, on HybridEP and all-to-all): FC2 is TE's
  ``GroupedLinear`` behind megatron's ``TEGroupedLinear.forward(x, m_splits)``, which calls
  ``super().forward(x, m_splits, is_first_microbatch=...)`` and passes no ``out=``. The hooked
  ``linear_fc2`` is switched to a subclass whose MRO puts one shim between megatron's class and the TE
  class whose ``forward`` takes ``out=`` (found by signature; see
  :func:`bufreuse.integrations.te.out_route.routing_class`): the shim acquires the slot and passes it
  as ``out=``. Under FP8/FP4 without router-side padding, FC2 writes the padded rows and
  ``Fp8Unpadding`` copies them out: the slot's last reader is then that copy inside the experts, and
  combine reads a fresh allocation (the ring replaces TE's padded FC2 output, not the combine input).

Releases are by fact: ``routed_experts_compute`` (where FC2 writes the slot) runs in ``pool.track_saved()``
on every call (:func:`~bufreuse.integrations.alltoall.hooks.track_fc2_stage`), later hooked stages when they
receive a slot, and ``Held.release`` waits for whatever they saved from it (see
:mod:`bufreuse.integrations.alltoall.hooks`). HybridEP: after ``token_combine``
(combine's forward is the last reader; under EP overlap it runs on the communication stream, where
the release is recorded).
All-to-all: after the first hooked combine stage whose output no longer aliases the slot (an experts'
output that is already a copy, FP8 unpadding, included). FC1's ``dgrad_out=`` is not used (docs/megatron.md).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from bufreuse.config import pads_inside_experts, static_bounds
from bufreuse.errors import BackendContractError, ConfigError
from bufreuse.integrations.core import (
    EXPERT,
    REUSE,
    Held,
    Installation,
    Requirement,
    acquire_with_hint,
    cfg_get,
    tracked,
)
from bufreuse.integrations.hybridep.hooks import is_hybridep_layer

__all__ = ["ADAPTER", "TEGroupedAdapter"]

_EXPERT_ONLY = frozenset({"expert"})
_HYBRIDEP = frozenset({"hybridep"})

ROWS: tuple[Requirement, ...] = (
    Requirement(
        key="grouped_gemm",
        buffers=_EXPERT_ONLY,
        paths=_HYBRIDEP,
        policies=REUSE,
        text="grouped expert GEMMs",
        fix="set moe_grouped_gemm=True",
        why="the FC2 output buffer is a grouped-linear output",
        test=lambda c: bool(cfg_get(c.cfg, "moe_grouped_gemm", False)),
    ),
    Requirement(
        key="te_grouped_output",
        buffers=_EXPERT_ONLY,
        paths=_HYBRIDEP,
        policies=REUSE,
        text="Transformer Engine grouped linear with a caller-provided output",
        fix="install Transformer Engine with GroupedLinear(out=) / ops OUTPUT_BUFFER_KEY (TE PR #3161, >= 2.18)",
        why="without it TE allocates the FC2 output itself",
        test=lambda c: c.features.te_grouped_output,
    ),
)


class TEGroupedAdapter:
    """Hooks the FC2 output of a ``TEGroupedMLP`` on either path: the op fuser where megatron fuses, else the module."""

    name = "te"
    path = "hybridep"
    buffers = _EXPERT_ONLY
    dispatcher = False
    label = "HybridEP"

    def supports(self, layer: Any) -> bool:
        return is_hybridep_layer(layer) or _alltoall_te_layer(layer)

    def requirements(self) -> tuple[Requirement, ...]:
        return ROWS

    def check(self, installation: Installation, layer: Any) -> list[str]:
        from megatron.core.transformer.moe import experts as experts_mod

        from bufreuse.integrations._compat_megatron import te_fused_impl
        from bufreuse.integrations.te.out_route import out_route_class, require_fused_output_buffer

        if not installation.hooks(self.name, layer, "expert"):
            return []
        experts, cfg = layer.experts, layer.config
        if te_fused_impl(experts):
            try:
                require_fused_output_buffer(experts, experts_mod)
            except ConfigError as e:
                return [str(e)]
            if not is_hybridep_layer(layer) and pads_inside_experts(cfg):
                return [
                    "the op-fuser grouped MLP pads FP8/FP4 rows inside the experts on the all-to-all path, so its FC2 "
                    "output is not the layer's: set moe_router_padding_for_quantization=True"
                ]
            return []
        fc2 = getattr(experts, "linear_fc2", None)
        if fc2 is None:  # HybridEP layers with SequentialMLP (or other) experts: no grouped FC2 to write into
            return [
                f"expert-output reuse on HybridEP needs TEGroupedMLP experts (found {type(experts).__name__}): "
                "set moe_grouped_gemm=True with transformer_impl='transformer_engine'"
            ]
        if out_route_class(type(fc2)) is None:
            return [
                f"expert-output reuse needs {type(fc2).__name__} to be a TE GroupedLinear "
                "whose forward takes out= (TE >= 2.18)"
            ]
        return []

    def hook(self, installation: Installation, layer: Any) -> None:
        import torch

        from bufreuse.integrations._compat_megatron import te_fused_impl

        if not installation.hooks(self.name, layer, "expert"):
            return
        cfg = installation.config_of(layer)  # the EP / expert-TP sizes the dispatcher really uses
        path = "hybridep" if is_hybridep_layer(layer) else "alltoall"
        bound = static_bounds(cfg, installation.knobs, path=path, tokens=installation.tokens)["expert"]
        fused = te_fused_impl(layer.experts)  # FP8 pad rows: in the bound (config)
        installation.register("expert", bound, getattr(layer.config, "params_dtype", torch.float32), cfg)
        if path == "hybridep":
            _hook_hybridep(installation, layer, fused)
        elif fused:
            _hook_fused_alltoall(installation, layer)
        else:
            _hook_module_alltoall(installation, layer)


def _alltoall_te_layer(layer: Any) -> bool:
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return isinstance(getattr(layer, "token_dispatcher", None), MoEAlltoAllTokenDispatcher) and isinstance(
        getattr(layer, "experts", None), TEGroupedMLP
    )


def _fused_forward_into_slot(inst: Installation, experts: Any, cols: int, queue: deque[Held]) -> Any:
    """A ``TEGroupedMLP.forward`` that hands the op fuser a slot as ``output_buffer=``."""
    import torch

    from bufreuse.integrations.te.out_route import output_alias

    pool, orig_forward = inst.pool, inst.original(experts, "forward")

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
                raise BackendContractError(
                    "Transformer Engine",
                    "grouped MLP forward",
                    "ignored the FC2 output buffer (returned other storage)",
                )
        except BaseException:
            pool.release(EXPERT, slot)
            raise
        queue.append(Held(pool=pool, name=EXPERT, tensor=slot))
        return output, bias

    return forward


def _cols(layer: Any) -> int:
    return int(getattr(layer.config, "moe_latent_size", None) or layer.config.hidden_size)


def _hook_hybridep(inst: Installation, layer: Any, fused: bool) -> None:
    """FC2 into a slot (op fuser: ``output_buffer=``; module: ``GroupedLinear(out=)``), released after combine.

    HybridEP's combine reads the FC2 output as it is (``skip_routed_expert_padding``: the dispatcher pads, the
    experts never unpad), so its forward is the slot's last reader; under EP overlap it runs on the
    communication stream, where the release is recorded.
    """
    from bufreuse.integrations.alltoall.hooks import track_fc2_stage

    experts, disp, pool = layer.experts, layer.token_dispatcher, inst.pool
    orig_combine = inst.original(disp, "token_combine")
    held: deque[Held] = deque()

    def token_combine(hidden_states: Any, async_finish: bool = True, allocate_on_comm_stream: bool = True) -> Any:
        out = orig_combine(hidden_states, async_finish, allocate_on_comm_stream)
        if held:
            held.popleft().release()  # combine's forward read it last, on the stream it ran on
        return out

    if fused:  # sm100: megatron's fused grouped MLP; Hopper runs the module
        inst.override(experts, "forward", _fused_forward_into_slot(inst, experts, _cols(layer), held))
    else:
        _route_fc2(inst, experts.linear_fc2, held)
    track_fc2_stage(inst, layer)
    inst.override(disp, "token_combine", tracked(pool, token_combine, pool.views_ring_storage))


def _hook_fused_alltoall(inst: Installation, layer: Any) -> None:
    from bufreuse.integrations.alltoall.hooks import hook_fc2_release, track_fc2_stage

    queue: deque[Held] = deque()
    inst.override(layer.experts, "forward", _fused_forward_into_slot(inst, layer.experts, _cols(layer), queue))
    track_fc2_stage(inst, layer)
    hook_fc2_release(inst, layer, queue)


def _hook_module_alltoall(inst: Installation, layer: Any) -> None:
    """``linear_fc2`` (TE ``GroupedLinear``) writes into a slot through ``out=``; see the module docstring.

    Per layer call the forward pays one shim frame (acquire, TE's forward with ``out=``, the storage
    check), ``routed_experts_compute``'s region (:func:`~bufreuse.integrations.alltoall.hooks.track_fc2_stage`)
    and the combine stages' release (:func:`~bufreuse.integrations.alltoall.hooks.hook_fc2_release`). An FC2
    output the experts copy (FP8 unpadding, a bias add) is released by the first hooked combine stage, whose
    output no longer views it.
    """
    from bufreuse.integrations.alltoall.hooks import hook_fc2_release, track_fc2_stage

    queue: deque[Held] = deque()
    _route_fc2(inst, layer.experts.linear_fc2, queue)
    track_fc2_stage(inst, layer)
    hook_fc2_release(inst, layer, queue)


def _route_fc2(inst: Installation, fc2: Any, queue: deque[Held]) -> None:
    """Switch ``fc2`` (TE ``GroupedLinear``) to write into an ``expert_fc2_output`` slot, queued on ``queue``."""
    from bufreuse.integrations.te.out_route import Fc2Route, out_route_class, route_into_ring

    te_forward = inst.original(out_route_class(type(fc2)), "forward")  # check() refused a class without one
    route_into_ring(inst, fc2, Fc2Route(inst.pool, EXPERT, int(fc2.out_features), queue, te_forward))


ADAPTER = TEGroupedAdapter()
