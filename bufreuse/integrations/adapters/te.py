"""The Transformer Engine adapter: the grouped MLP's FC2 output written into an ``expert_fc2_output`` slot.

Serves the expert buffer of HybridEP layers (their experts are megatron-core's ``TEGroupedMLP``):
``TEGroupedMLP.forward`` (per instance) acquires a slot with the exact output shape and passes a
detached alias as ``output_buffer=`` (megatron routes it to TE as
``op_kwargs[-1][OUTPUT_BUFFER_KEY]``). Released after ``token_combine``, HybridEP combine's
forward being the last reader (its backward is a dispatch of the gradient); under EP overlap
combine runs on the communication stream, so the release is recorded there. The TE-side helpers
(aliasing, op kwargs, the feature checks) are :mod:`bufreuse.integrations.te`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from bufreuse.config import static_bounds
from bufreuse.errors import BackendContractError, ConfigError
from bufreuse.integrations.adapters.hybridep import is_hybridep_layer
from bufreuse.integrations.core import EXPERT, REUSE, Held, Installation, Requirement, acquire_with_hint, cfg_get

__all__ = ["ADAPTER", "TEGroupedAdapter"]

_EXPERT_ONLY = frozenset({"expert"})
_HYBRIDEP = frozenset({"hybridep"})

ROWS: tuple[Requirement, ...] = (
    Requirement(
        key="te_op_fuser",
        buffers=_EXPERT_ONLY,
        paths=_HYBRIDEP,
        policies=REUSE,
        text="the Transformer Engine op fuser for the grouped MLP",
        fix="set use_transformer_engine_op_fuser=True (megatron-core 0.19+)",
        why="only the op-fuser grouped MLP takes a caller-provided FC2 output (op_kwargs OUTPUT_BUFFER_KEY)",
        test=lambda c: bool(cfg_get(c.cfg, "use_transformer_engine_op_fuser", False)),
        needs_fields=("use_transformer_engine_op_fuser",),
    ),
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
    """Hooks the expert FC2 output of a HybridEP layer's ``TEGroupedMLP`` (TE op fuser)."""

    name = "te"
    path = "hybridep"
    buffers = _EXPERT_ONLY
    dispatcher = False
    label = "HybridEP"

    def supports(self, layer: Any) -> bool:
        return is_hybridep_layer(layer)

    def requirements(self) -> tuple[Requirement, ...]:
        return ROWS

    def check(self, installation: Installation, layer: Any) -> list[str]:
        from megatron.core.transformer.moe import experts as experts_mod

        from bufreuse.integrations.te import require_fused_output_buffer

        if "expert" not in installation.knobs.enabled():
            return []
        try:
            require_fused_output_buffer(layer.experts, experts_mod)
        except ConfigError as e:
            return [str(e)]
        return []

    def hook(self, installation: Installation, layer: Any) -> None:
        import torch

        if "expert" not in installation.knobs.enabled():
            return
        bounds = static_bounds(layer.config, installation.knobs, path="hybridep", tokens=installation.tokens)
        installation.register("expert", bounds["expert"], getattr(layer.config, "params_dtype", torch.float32))
        _hook_expert(installation, layer)


def _hook_expert(inst: Installation, layer: Any) -> None:
    import torch

    from bufreuse.integrations.te import output_alias

    experts, disp, pool = layer.experts, layer.token_dispatcher, inst.pool
    orig_forward, orig_combine = experts.forward, disp.token_combine
    cols = int(getattr(layer.config, "moe_latent_size", None) or layer.config.hidden_size)
    held: deque[Held] = deque()

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
        held.append(Held(pool=pool, name=EXPERT, tensor=slot))
        return output, bias

    def token_combine(hidden_states: torch.Tensor, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        out = orig_combine(hidden_states, async_finish, allocate_on_comm_stream)
        if held:
            held.popleft().release()  # combine's forward read it last, on the stream it ran on
        return out

    inst.override(experts, "forward", forward)
    inst.override(disp, "token_combine", token_combine)


ADAPTER = TEGroupedAdapter()
