"""Where each ring buffer is acquired and where its release is allowed: the one table.

The integration asks :func:`release_rule` (or :func:`release_rules`) where it releases; the planner
reads the same rows to count slots in flight. Each row names the config fields it depends on, read
from megatron-core 0.19.2 (``megatron/core/transformer/moe/``):

Dispatch output (written by the dispatch on the communication stream, read by the experts):

- ``fine_grained_activation_offloading`` with ``'fused_group_mlp'`` in ``offload_modules``: **refused** -- the
  offload force-releases the expert input storage, which is the persistent slot.
- ``moe_apply_probs_on_input``: the experts compute ``permuted_probs * hidden`` first
  (``TEGroupedMLP``/``SequentialMLP.forward``); the multiply saves ``hidden`` -- the slot -- for the probs
  gradient, whatever the GEMM precision: release after the **backward** of the layer's experts.
- ``fp8`` / ``fp4`` unset and the experts read the slot itself (HybridEP always; NCCL all-to-all with one
  local expert and no expert TP, since otherwise ``dispatch_postprocess`` sorts the tokens into a copy):
  the bf16 expert GEMM saves its input. Release after its **backward**, or after **wgrad** with
  ``delay_wgrad_compute`` (``mlp.backward_dw()`` computes the FC1 weight gradient from that input later).
- otherwise **forward**: after the experts' forward read (FP8/FP4 save the quantized copy; the NCCL path's
  copy is what is saved).

Expert FC2 output (written by the experts on the compute stream, read by combine):

- HybridEP: **forward** -- combine's forward is the final reader; its backward dispatches the gradient.
- NCCL all-to-all with ``deterministic_mode``: **backward** -- ``unpermute`` takes its ``index_add_`` path
  under deterministic algorithms, which the pool's autograd guard saw save the FC2 output (H200).
- otherwise **forward**.

Activation recompute of the MoE layer (``recompute_granularity='full'``, or ``'selective'`` with ``'moe'``
in ``recompute_modules``): the forward runs under a checkpoint and saves nothing, so its acquisition is
released at forward; the recomputed forward in backward acquires a second slot, released by the rule above
(``ReleaseRule.recompute``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ReleasePoint", "ReleaseRule", "dispatch_path", "moe_recompute", "release_rule", "release_rules"]


class ReleasePoint(enum.Enum):
    """Where the final reader of a buffer is, in the layer's passes."""

    FORWARD = "forward"
    """After the forward read (nothing saves it)."""
    BACKWARD = "backward"
    """After the backward of the consumer that saved it."""
    WGRAD = "wgrad"
    """After the delayed weight-gradient pass (``backward_dw``) of that consumer."""
    REFUSED = "refused"
    """No safe release point exists: the buffer cannot be a ring."""


@dataclass(frozen=True, slots=True)
class ReleaseRule:
    """Where one buffer's acquisition is released, and why (the config fields that decide it)."""

    buffer: str
    """``dispatch`` or ``expert``."""
    point: ReleasePoint
    """Release point of the acquisition whose forward may save it (the recomputed one under recompute)."""
    reason: str
    """Why, naming the config field(s)."""
    fields: tuple[str, ...] = ()
    """Config fields this row depends on."""
    recompute: bool = False
    """The MoE layer is recomputed: a first acquisition in forward (released there) and a second in backward."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "buffer": self.buffer,
            "point": self.point.value,
            "reason": self.reason,
            "fields": list(self.fields),
            "recompute": self.recompute,
        }


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


def dispatch_path(cfg: Any) -> str | None:
    """``hybridep`` (flex + HybridEP backend), ``alltoall`` (NCCL all-to-all) or None (unsupported)."""
    kind = _get(cfg, "moe_token_dispatcher_type", "allgather")
    if kind == "alltoall":
        return "alltoall"
    if kind == "flex" and _get(cfg, "moe_flex_dispatcher_backend", None) == "hybridep":
        return "hybridep"
    return None


def moe_recompute(cfg: Any) -> bool:
    """Whether megatron recomputes the MoE layer in backward (``MoELayer.moe_layer_recompute`` or full)."""
    gran = _get(cfg, "recompute_granularity", None)
    mods = _get(cfg, "recompute_modules", None) or []
    if isinstance(mods, str):
        mods = [mods]
    return gran == "full" or (gran == "selective" and "moe" in mods) or bool(_get(cfg, "moe_layer_recompute", False))


def _dispatch(cfg: Any, path: str | None) -> tuple[ReleasePoint, str, tuple[str, ...]]:
    mods = _get(cfg, "offload_modules", None) or []
    if _get(cfg, "fine_grained_activation_offloading", False) and "fused_group_mlp" in mods:
        return (
            ReleasePoint.REFUSED,
            "fine_grained_activation_offloading with 'fused_group_mlp' force-releases the expert input storage "
            "(the persistent slot)",
            ("fine_grained_activation_offloading", "offload_modules"),
        )
    if _get(cfg, "moe_apply_probs_on_input", False):
        return (
            ReleasePoint.BACKWARD,
            "moe_apply_probs_on_input: the experts' probs * hidden multiply saves the slot for the probs gradient",
            ("moe_apply_probs_on_input",),
        )
    quantized = bool(_get(cfg, "fp8", None) or _get(cfg, "fp4", None))
    if quantized:
        return ReleasePoint.FORWARD, "fp8/fp4 expert GEMMs save the quantized copy, not the slot", ("fp8", "fp4")
    experts = int(_get(cfg, "num_moe_experts", 1) or 1)
    ep = int(_get(cfg, "expert_model_parallel_size", 1) or 1)
    etp = int(_get(cfg, "expert_tensor_parallel_size", None) or 1)
    if path == "alltoall" and (max(1, experts // ep) > 1 or etp > 1):
        return (
            ReleasePoint.FORWARD,
            "NCCL all-to-all with several local experts or expert TP: dispatch_postprocess reads the slot into a "
            "sorted copy, and the copy is what the experts save",
            ("num_moe_experts", "expert_model_parallel_size", "expert_tensor_parallel_size"),
        )
    if _get(cfg, "delay_wgrad_compute", False):
        return (
            ReleasePoint.WGRAD,
            "bf16 expert GEMMs (fp8/fp4 unset) save the slot; delay_wgrad_compute reads it again in backward_dw",
            ("fp8", "fp4", "delay_wgrad_compute"),
        )
    return (
        ReleasePoint.BACKWARD,
        "bf16 expert GEMMs (fp8/fp4 unset) save the slot as their input for backward",
        ("fp8", "fp4"),
    )


def _expert(cfg: Any, path: str | None) -> tuple[ReleasePoint, str, tuple[str, ...]]:
    if path == "alltoall" and _get(cfg, "deterministic_mode", False):
        return (
            ReleasePoint.BACKWARD,
            "deterministic_mode: combine_postprocess's unpermute (index_add_ path) saves the FC2 output",
            ("deterministic_mode",),
        )
    if path == "hybridep":
        return ReleasePoint.FORWARD, "HybridEP combine's forward is the final reader of the FC2 output", ()
    return ReleasePoint.FORWARD, "combine copies the FC2 output in forward; nothing saves it", ("deterministic_mode",)


def release_rule(cfg: Any, buffer: str, *, path: str | None = None) -> ReleaseRule:
    """Where ``buffer`` (``dispatch`` or ``expert``) is released under ``cfg``.

    Args:
        cfg: a ``TransformerConfig`` or a flat mapping of its field names.
        buffer: ``dispatch`` (dispatch output) or ``expert`` (expert FC2 output).
        path: ``hybridep`` or ``alltoall``; default: from ``moe_token_dispatcher_type``.

    Raises:
        ValueError: for another buffer name.
    """
    if buffer not in ("dispatch", "expert"):
        raise ValueError(f"unknown buffer {buffer!r}; choose dispatch or expert")
    path = dispatch_path(cfg) if path is None else path
    point, reason, fields = (_dispatch if buffer == "dispatch" else _expert)(cfg, path)
    recompute = moe_recompute(cfg) and point is not ReleasePoint.REFUSED
    if recompute:
        reason += "; MoE recompute: the checkpointed forward saves nothing, the recomputed one acquires again"
        fields = (*fields, "recompute_granularity", "recompute_modules")
    return ReleaseRule(buffer=buffer, point=point, reason=reason, fields=fields, recompute=recompute)


def release_rules(cfg: Any, *, path: str | None = None) -> dict[str, ReleaseRule]:
    """:func:`release_rule` for both buffers: ``{"dispatch": ..., "expert": ...}``."""
    return {b: release_rule(cfg, b, path=path) for b in ("dispatch", "expert")}
