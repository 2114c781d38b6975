"""Where each ring buffer is acquired and where its release is allowed: the one table.

The planner reads these rows to count slots in flight; the integration reads the same rows at
``install()`` (``Installation.expected_release``), takes its ring-policy refusals from
:data:`REFUSALS` (``ReleaseRule.refusals``), and checks the release it observes against them
(``Installation.release_check``). The integration itself releases *by fact* (a release waits for the
autograd-saved references the hooked stages made), so in debug mode, which counts every stage, a rule
it contradicts does not corrupt a run: it means the planner's depth is wrong, and
``tests/test_schedule_harness.py`` fails. Each row names the
config fields it depends on, read from megatron-core 0.19.2 (``megatron/core/transformer/moe/``):

Both buffers, **refused**: per-layer CUDA graphs (``cuda_graph_impl`` ``local``/``transformer_engine``; a
graph captured outside the pool's capture phase bakes in a slot address the eager ring hands out again);
``moe_paged_stash`` and TE CPU offloading (``cpu_offloading``), which push their own saved-tensor hooks:
hooks do not nest, so inside ``track_saved`` one of the two is blind to the other.

Dispatch output (written by the dispatch on the communication stream, read by the experts):

- HybridEP with ``moe_apply_probs_on_input``: **refused** -- the multiply saves the slot, and the HybridEP
  adapter releases at the experts' forward.

- ``fine_grained_activation_offloading`` with ``'fused_group_mlp'`` or ``'expert_fc1'`` in
  ``offload_modules``: **refused** -- the first force-releases the expert input storage (the persistent
  slot), the second copies it to host under TE's own saved-tensor hooks (a read no tracking sees).
- NCCL all-to-all where ``dispatch_postprocess`` copies the slot: expert TP (the all-gather), or several
  local experts sorted by ``sort_chunks_by_idxs`` -- except in pad-to-capacity mode at EP x expert TP = 1,
  where the sort is a ``view().transpose().contiguous()`` of a size-1 dimension, i.e. the slot itself:
  **forward** (the copy is what the experts read and save).
- ``moe_apply_probs_on_input``: the experts compute ``permuted_probs * hidden`` first
  (``TEGroupedMLP``/``SequentialMLP.forward``); the multiply saves ``hidden`` -- the slot -- for the probs
  gradient, whatever the GEMM precision: release after the **backward** of the layer's experts.
- ``fp8`` / ``fp4`` set: **forward** (the expert GEMMs save the quantized copy).
- otherwise the bf16 expert GEMM saves its input, the slot: release after its **backward**, or after
  **wgrad** with delayed weight gradients (``delay_wgrad_compute`` or
  ``overlap_dispatch_backward_with_experts_wgrad``: ``backward_dw()`` computes the FC1 weight gradient
  from that input later, read from TE's wgrad store): the integration holds the slot from the forward
  release until ``experts.backward_dw()`` is enqueued. Refused only under CUDA graphs
  (``no_graphed_delayed_wgrad``): a captured ``backward_dw`` cannot finish an eager hold.

Expert FC2 output (written by the experts on the compute stream, read by combine):

- HybridEP: **forward** -- combine's forward is the final reader; its backward dispatches the gradient.
- NCCL all-to-all under deterministic algorithms (``deterministic_mode``; the integration also reads
  ``torch.are_deterministic_algorithms_enabled()``, which is what megatron's ``unpermute`` tests) when the
  unpermute reads the slot itself: **backward** -- its ``index_add_`` path saves its source (seen by the
  pool's autograd guard on the H200). The unpermute reads a copy instead (**forward**) with EP > 1 (the
  combine all-to-all), expert TP (the reduce-scatter), several local experts outside the pad-to-capacity
  view case (the unsort). FP8/FP4 ``TEGroupedMLP`` experts that pad inside make it data-dependent:
  ``Fp8Unpadding`` copies unless every expert's token count is already aligned, when it returns the FC2
  output itself (seen on the H200 with one expert: 512 tokens, all four releases deferred); planned as
  backward (``ReleaseRule.data_dependent``).
- otherwise **forward**.

Activation recompute of the MoE layer (``recompute_granularity='full'``, or ``'selective'`` with ``'moe'``
in ``recompute_modules``): the forward runs under a checkpoint and saves nothing, so its acquisition is
released at forward; the recomputed forward in backward acquires a second slot, released by the rule above
(``ReleaseRule.recompute``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bufreuse.config import expert_tp, pads_inside_experts

__all__ = [
    "REFUSALS",
    "Refusal",
    "ReleasePoint",
    "ReleaseRule",
    "delayed_wgrad",
    "dispatch_path",
    "moe_recompute",
    "release_rule",
    "release_rules",
]


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
    refusals: tuple[str, ...] = ()
    """Keys of the :data:`REFUSALS` rows that apply: the integration refuses this buffer's ring policy."""
    data_dependent: bool = False
    """``point`` is the latest release the data can cause: some acquisitions release earlier (at the
    forward), depending on token counts. The planner counts ``point`` (safe); a check accepts either."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "buffer": self.buffer,
            "point": self.point.value,
            "reason": self.reason,
            "fields": list(self.fields),
            "recompute": self.recompute,
            "refusals": list(self.refusals),
            "data_dependent": self.data_dependent,
        }


_DATA_DEPENDENT_BACKWARD: Any = object()
"""Internal marker from ``_expert``/``_dispatch``: backward at the latest, forward for some data."""


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


def _offloads(cfg: Any, module: str) -> bool:
    mods = _get(cfg, "offload_modules", None) or []
    return bool(_get(cfg, "fine_grained_activation_offloading", False)) and module in mods


def delayed_wgrad(cfg: Any) -> bool:
    """Whether the expert weight gradients are computed after backward (``backward_dw``)."""
    return bool(
        _get(cfg, "delay_wgrad_compute", False) or _get(cfg, "overlap_dispatch_backward_with_experts_wgrad", False)
    )


def _per_layer_graphs(cfg: Any) -> bool:
    """Whether megatron graphs layers one by one (``cuda_graph_impl`` local/TE, or 0.16's boolean fields)."""
    impl = _get(cfg, "cuda_graph_impl", None)
    return impl in ("local", "transformer_engine") or bool(
        _get(cfg, "enable_cuda_graph", False) or _get(cfg, "external_cuda_graph", False)
    )


@dataclass(frozen=True, slots=True)
class Refusal:
    """A setting under which the integration refuses a buffer's ring (a row of ``check-config`` too).

    ``point_refused``: the buffer has no release point at all (the rule is ``REFUSED``); otherwise the
    rule keeps its point for the planner and only the integration, which cannot release there, refuses.
    """

    key: str
    buffer: str
    """``dispatch``, ``expert`` or ``both``."""
    applies: Callable[[Any], bool]
    """True when the config has the refused setting."""
    text: str
    """What must hold, in words (the requirement row's text)."""
    fix: str
    why: str
    fields: tuple[str, ...]
    point_refused: bool


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        key="no_fused_group_mlp_offload",
        buffer="dispatch",
        applies=lambda cfg: _offloads(cfg, "fused_group_mlp"),
        text="no fine-grained fused_group_mlp activation offload",
        fix="remove 'fused_group_mlp' from offload_modules or set fine_grained_activation_offloading=False",
        why="that path force-releases the expert input storage, which is the persistent dispatch slot",
        fields=("fine_grained_activation_offloading", "offload_modules"),
        point_refused=True,
    ),
    Refusal(
        key="no_expert_input_offload",
        buffer="dispatch",
        applies=lambda cfg: _offloads(cfg, "expert_fc1"),
        text="no fine-grained expert_fc1 activation offload",
        fix="remove 'expert_fc1' from offload_modules or set fine_grained_activation_offloading=False",
        why="TEGroupedMLP copies the FC1 input (the dispatch slot) to host on a side stream under its own "
        "saved-tensor hooks and sets save_original_input: a read the ring's saved-reference tracking cannot see",
        fields=("fine_grained_activation_offloading", "offload_modules"),
        point_refused=True,
    ),
    Refusal(
        key="no_hybridep_probs_on_input",
        buffer="dispatch",
        applies=lambda cfg: dispatch_path(cfg) == "hybridep" and bool(_get(cfg, "moe_apply_probs_on_input", False)),
        text="probabilities applied after the experts on HybridEP (no moe_apply_probs_on_input)",
        fix="set moe_apply_probs_on_input=False, or keep the dispatch output off the ring on HybridEP",
        why="the experts' permuted_probs * hidden multiply saves the dispatch slot for the probs gradient, and the "
        "HybridEP adapter releases the slot after the experts' forward: the next acquisition would overwrite what "
        "backward reads (silently wrong gradients)",
        fields=("moe_apply_probs_on_input", "moe_token_dispatcher_type", "moe_flex_dispatcher_backend"),
        point_refused=True,
    ),
    Refusal(
        key="no_per_layer_cuda_graphs",
        buffer="both",
        applies=_per_layer_graphs,
        text="no per-layer CUDA graphs (cuda_graph_impl 'none' or 'full_iteration')",
        fix="set cuda_graph_impl='none' or 'full_iteration' (not 'local' / 'transformer_engine')",
        why="a per-layer graph captures the dispatch or the experts outside the pool's capture phase: it bakes "
        "in the address of a slot the eager ring hands out again, and replays write it while another "
        "microbatch holds it",
        fields=("cuda_graph_impl", "enable_cuda_graph", "external_cuda_graph"),
        point_refused=True,
    ),
    Refusal(
        key="no_paged_stash",
        buffer="both",
        applies=lambda cfg: bool(_get(cfg, "moe_paged_stash", False)),
        text="no MoE paged stash (moe_paged_stash=False)",
        fix="set moe_paged_stash=False",
        why="the paged stash pushes its own saved_tensors_hooks around the experts; saved-tensor hooks do not "
        "nest, so inside the ring's track_saved region one of the two is blind to the other (a stashed slot "
        "alias the ring never counts, or activations the stash never sees)",
        fields=("moe_paged_stash",),
        point_refused=True,
    ),
    Refusal(
        key="no_te_cpu_offload",
        buffer="both",
        applies=lambda cfg: bool(_get(cfg, "cpu_offloading", False)),
        text="no Transformer Engine CPU offloading (cpu_offloading=False)",
        fix="set cpu_offloading=False",
        why="TE's CPU offload context pushes its own saved_tensors_hooks; inside the ring's track_saved region "
        "one of the two is blind to the other (an offloaded copy of a slot read after the ring reused it, or "
        "activations left on the GPU)",
        fields=("cpu_offloading", "cpu_offloading_activations", "cpu_offloading_weights"),
        point_refused=True,
    ),
    Refusal(
        key="no_graphed_delayed_wgrad",
        buffer="dispatch",
        applies=lambda cfg: _graphed_delayed_wgrad(cfg),
        text="no CUDA graphs together with delayed expert wgrad where FC1 reads the dispatch slot",
        fix="set cuda_graph_impl='none', or delay_wgrad_compute=False and "
        "overlap_dispatch_backward_with_experts_wgrad=False, or fp8/fp4 expert GEMMs",
        why="with delayed wgrad the slot is held until backward_dw() is enqueued; a captured or replayed "
        "backward_dw cannot finish that hold in order with the pool's graph phases (not validated)",
        fields=("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad", "cuda_graph_impl"),
        point_refused=False,
    ),
)
"""The ring-policy refusals that are release rules; ``install()`` and the requirement matrix read them."""


def _graphed_delayed_wgrad(cfg: Any) -> bool:
    """Delayed wgrad whose dispatch release point is ``wgrad``, under any CUDA-graph implementation."""
    impl = _get(cfg, "cuda_graph_impl", None)
    if impl in (None, "none") or not delayed_wgrad(cfg):
        return False
    return _dispatch(cfg, dispatch_path(cfg))[0] is ReleasePoint.WGRAD


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


def _parallel(cfg: Any) -> tuple[int, int, int]:
    """(local experts, EP, expert TP); expert TP defaults to TP as megatron's ``TransformerConfig`` does."""
    experts = int(_get(cfg, "num_moe_experts", 1) or 1)
    ep = int(_get(cfg, "expert_model_parallel_size", 1) or 1)
    return max(1, experts // ep), ep, expert_tp(cfg)


def _local_sort_copies(cfg: Any) -> bool:
    """Whether the all-to-all dispatcher's local-expert (un)sort copies (else it is the slot itself)."""
    local, ep, etp = _parallel(cfg)
    pad_view = bool(_get(cfg, "moe_pad_expert_input_to_capacity", False)) and ep * etp == 1
    return local > 1 and not pad_view


_PARALLEL_FIELDS = (
    "num_moe_experts",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "moe_pad_expert_input_to_capacity",
)


def _refused(cfg: Any, buffer: str) -> tuple[ReleasePoint, str, tuple[str, ...]] | None:
    for r in REFUSALS:
        if r.buffer in (buffer, "both") and r.point_refused and r.applies(cfg):
            return ReleasePoint.REFUSED, f"{r.key} ({r.fix}): {r.why}", r.fields
    return None


def _dispatch(cfg: Any, path: str | None) -> tuple[ReleasePoint, str, tuple[str, ...]]:
    refused = _refused(cfg, "dispatch")
    if refused is not None:
        return refused
    if path == "alltoall" and (_parallel(cfg)[2] > 1 or _local_sort_copies(cfg)):
        return (
            ReleasePoint.FORWARD,
            "NCCL all-to-all with expert TP or several local experts (outside pad-to-capacity at EP x expert TP "
            "= 1): dispatch_postprocess reads the slot into a gathered/sorted copy, and the copy is what the "
            "experts read and save",
            _PARALLEL_FIELDS,
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
    if delayed_wgrad(cfg):
        return (
            ReleasePoint.WGRAD,
            "bf16 expert GEMMs (fp8/fp4 unset) save the slot; delay_wgrad_compute "
            "(or overlap_dispatch_backward_with_experts_wgrad) reads it again in backward_dw (held until then)",
            ("fp8", "fp4", "delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad"),
        )
    return (
        ReleasePoint.BACKWARD,
        "bf16 expert GEMMs (fp8/fp4 unset) save the slot as their input for backward",
        ("fp8", "fp4"),
    )


def _expert(cfg: Any, path: str | None) -> tuple[ReleasePoint, str, tuple[str, ...]]:
    refused = _refused(cfg, "expert")
    if refused is not None:
        return refused
    if path == "hybridep":
        return ReleasePoint.FORWARD, "HybridEP combine's forward is the final reader of the FC2 output", ()
    if path == "alltoall" and _get(cfg, "deterministic_mode", False):
        _, ep, etp = _parallel(cfg)
        if ep > 1 or etp > 1 or _local_sort_copies(cfg):
            return (
                ReleasePoint.FORWARD,
                "deterministic_mode, but the unpermute reads a copy of the FC2 output (the combine all-to-all at "
                "EP > 1, the expert-TP reduce-scatter, or the local-expert unsort)",
                ("deterministic_mode", *_PARALLEL_FIELDS),
            )
        if pads_inside_experts(cfg):
            return (
                _DATA_DEPENDENT_BACKWARD,
                "deterministic_mode with FP8/FP4 TE experts that pad inside: Fp8Unpadding copies the FC2 output "
                "when an expert's token count is not a multiple of the alignment (then forward), and returns it "
                "unchanged when every count is aligned (the unpermute's index_add_ then saves it: backward); "
                "planned as backward",
                ("deterministic_mode", *_PARALLEL_FIELDS, "fp8", "fp4", "moe_router_padding_for_quantization"),
            )
        return (
            ReleasePoint.BACKWARD,
            "deterministic_mode: combine_postprocess's unpermute (index_add_ path) saves the FC2 output",
            ("deterministic_mode",),
        )
    return ReleasePoint.FORWARD, "combine copies the FC2 output in forward; nothing saves it", ("deterministic_mode",)


_SAVED = (ReleasePoint.BACKWARD, ReleasePoint.WGRAD)


def _may_receive_nothing(cfg: Any, path: str | None) -> bool:
    """Whether a rank's all-to-all dispatch output can be empty: EP > 1 without pad-to-capacity (dropless or
    capacity-bounded routing can send a rank no token; padded, every rank receives capacity rows per expert)."""
    _, ep, _ = _parallel(cfg)
    return path == "alltoall" and ep > 1 and not bool(_get(cfg, "moe_pad_expert_input_to_capacity", False))


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
    data_dependent = point is _DATA_DEPENDENT_BACKWARD
    if data_dependent:
        point = ReleasePoint.BACKWARD
    elif buffer == "dispatch" and point in _SAVED and _may_receive_nothing(cfg, path):
        # exact all the same: the pool counts the empty acquisitions (RingStats.empty_acquisitions), which
        # release_check leaves out
        reason += (
            "; without pad-to-capacity at EP > 1 a rank that receives no tokens gets an empty slot, which nothing "
            "saves: released at the forward (an empty acquisition)"
        )
        fields = (*fields, "expert_model_parallel_size", "moe_pad_expert_input_to_capacity")
    recompute = moe_recompute(cfg) and point is not ReleasePoint.REFUSED
    if recompute:
        reason += "; MoE recompute: the checkpointed forward saves nothing, the recomputed one acquires again"
        fields = (*fields, "recompute_granularity", "recompute_modules")
    refusals = tuple(r.key for r in REFUSALS if r.buffer in (buffer, "both") and r.applies(cfg))
    return ReleaseRule(
        buffer=buffer,
        point=point,
        reason=reason,
        fields=fields,
        recompute=recompute,
        refusals=refusals,
        data_dependent=data_dependent,
    )


def release_rules(cfg: Any, *, path: str | None = None) -> dict[str, ReleaseRule]:
    """:func:`release_rule` for both buffers: ``{"dispatch": ..., "expert": ...}``."""
    return {b: release_rule(cfg, b, path=path) for b in ("dispatch", "expert")}
