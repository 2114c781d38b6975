"""The requirement matrix: which megatron-core settings each buffer x path x policy needs.

One table (:data:`REQUIREMENTS`), no scattered ifs: each row names the buffers, dispatch paths and
policies it applies to, a predicate over the ``TransformerConfig`` (any object with its field
names: a real config, or the flat dict ``bufreuse check-config`` reads), and the field to change.
``check`` evaluates every applicable row; ``validate`` raises ONE :class:`ConfigError` listing all
unmet rows. Fields missing from older megatron-core (0.16.x lacks
``moe_expert_rank_capacity_factor`` and ``use_transformer_engine_op_fuser``) read as unset, and a
row that needs one says it cannot be met on that version. Backend support is detected by
feature (signatures, importable keys), never by version string.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bufreuse.config import BufferBound, BufReuseConfig, static_bounds, tokens_per_microbatch
from bufreuse.errors import ConfigError
from bufreuse.integrations.features import Features, detect_features

__all__ = ["REQUIREMENTS", "CheckItem", "CheckReport", "Requirement", "check", "dispatch_path", "validate"]

ALL_POLICIES = frozenset({"ring", "stream-ordered", "record-stream"})
REUSE = frozenset({"ring", "stream-ordered"})
RING = frozenset({"ring"})
BOTH = frozenset({"dispatch", "expert"})
PATHS = frozenset({"hybridep", "alltoall"})


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _has(cfg: Any, name: str) -> bool:
    return name in cfg if isinstance(cfg, Mapping) else hasattr(cfg, name)


def dispatch_path(cfg: Any) -> str | None:
    """``hybridep`` (flex + hybridep backend), ``alltoall`` (NCCL all-to-all) or None (unsupported)."""
    kind = _get(cfg, "moe_token_dispatcher_type", "allgather")
    if kind == "alltoall":
        return "alltoall"
    if kind == "flex" and _get(cfg, "moe_flex_dispatcher_backend", None) == "hybridep":
        return "hybridep"
    return None


@dataclass(frozen=True, slots=True)
class _Ctx:
    cfg: Any
    knobs: BufReuseConfig
    path: str | None
    tokens: int | None
    features: Features


@dataclass(frozen=True, slots=True)
class Requirement:
    """One row of the matrix."""

    key: str
    buffers: frozenset[str]
    paths: frozenset[str]
    policies: frozenset[str]
    text: str
    """What must hold, in words."""
    fix: str
    """The field to change and how."""
    why: str
    test: Callable[[_Ctx], bool]
    needs_fields: tuple[str, ...] = ()
    """Fields this row can only be met through; absent on older megatron-core -> cannot be met."""


def _static_bound(c: _Ctx) -> bool:
    pad = bool(_get(c.cfg, "moe_pad_expert_input_to_capacity", False))
    return _get(c.cfg, "moe_expert_rank_capacity_factor", None) is not None or (
        pad and _get(c.cfg, "moe_expert_capacity_factor", None) is not None
    )


def _no_fused_group_mlp_offload(c: _Ctx) -> bool:
    mods = _get(c.cfg, "offload_modules", None) or []
    return not (_get(c.cfg, "fine_grained_activation_offloading", False) and "fused_group_mlp" in mods)


def _no_moe_recompute(c: _Ctx) -> bool:
    gran = _get(c.cfg, "recompute_granularity", None)
    mods = _get(c.cfg, "recompute_modules", None) or []
    return (
        gran != "full" and not (gran == "selective" and "moe" in mods) and not _get(c.cfg, "moe_layer_recompute", False)
    )


def _graphs_ok(c: _Ctx) -> bool:
    impl = _get(c.cfg, "cuda_graph_impl", "none")
    if impl in (None, "none"):
        return True
    pad = bool(_get(c.cfg, "moe_pad_expert_input_to_capacity", False))
    return impl == "full_iteration" and pad and _get(c.cfg, "moe_expert_capacity_factor", None) is not None


REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        key="dispatcher",
        buffers=BOTH,
        paths=PATHS | {None},
        policies=ALL_POLICIES,  # type: ignore[operator]
        text="a supported dispatcher: NCCL all-to-all, or flex with the HybridEP backend",
        fix="set moe_token_dispatcher_type='alltoall', or 'flex' with moe_flex_dispatcher_backend='hybridep'",
        why="the hooks exist for these two dispatch paths only",
        test=lambda c: c.path is not None,
    ),
    Requirement(
        key="static_bound",
        buffers=BOTH,
        paths=frozenset({"hybridep"}),
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
        paths=frozenset({"hybridep"}),
        policies=RING,
        text="EP communication overlap (combined-1F1B)",
        fix="set overlap_moe_expert_parallel_comm=True (needs expert_model_parallel_size > 1)",
        why="HybridEP exposes no consumer-depth bound; only the combined-1F1B schedule bounds slots in flight",
        test=lambda c: bool(_get(c.cfg, "overlap_moe_expert_parallel_comm", False)),
    ),
    Requirement(
        key="quantized_experts",
        buffers=frozenset({"dispatch"}),
        paths=frozenset({"hybridep"}),
        policies=RING,
        text="FP8 or FP4 expert GEMMs",
        fix="set fp8 (e.g. 'e4m3') or fp4 (needs Transformer Engine)",
        why="bf16 expert GEMMs save the dispatch slot for backward; the quantized copy is what FP8/FP4 saves",
        test=lambda c: bool(_get(c.cfg, "fp8", None) or _get(c.cfg, "fp4", None)),
    ),
    Requirement(
        key="deepep_output_token",
        buffers=frozenset({"dispatch"}),
        paths=frozenset({"hybridep"}),
        policies=REUSE,
        text="DeepEP HybridEPBuffer.dispatch_with_permute(..., output_token=...)",
        fix="install a DeepEP hybrid-ep build whose dispatch_with_permute accepts output_token",
        why="HybridEP allocates its output itself unless the caller can hand it a buffer",
        test=lambda c: c.features.deepep_output_token,
    ),
    Requirement(
        key="te_op_fuser",
        buffers=frozenset({"expert"}),
        paths=frozenset({"hybridep"}),
        policies=REUSE,
        text="the Transformer Engine op fuser for the grouped MLP",
        fix="set use_transformer_engine_op_fuser=True (megatron-core 0.19+)",
        why="only the op-fuser grouped MLP takes a caller-provided FC2 output (op_kwargs OUTPUT_BUFFER_KEY)",
        test=lambda c: bool(_get(c.cfg, "use_transformer_engine_op_fuser", False)),
        needs_fields=("use_transformer_engine_op_fuser",),
    ),
    Requirement(
        key="grouped_gemm",
        buffers=frozenset({"expert"}),
        paths=frozenset({"hybridep"}),
        policies=REUSE,
        text="grouped expert GEMMs",
        fix="set moe_grouped_gemm=True",
        why="the FC2 output buffer is a grouped-linear output",
        test=lambda c: bool(_get(c.cfg, "moe_grouped_gemm", False)),
    ),
    Requirement(
        key="te_grouped_output",
        buffers=frozenset({"expert"}),
        paths=frozenset({"hybridep"}),
        policies=REUSE,
        text="Transformer Engine grouped linear with a caller-provided output",
        fix="install Transformer Engine with GroupedLinear(out=) / ops OUTPUT_BUFFER_KEY (TE PR #3161, >= 2.18)",
        why="without it TE allocates the FC2 output itself",
        test=lambda c: c.features.te_grouped_output,
    ),
    Requirement(
        key="no_fused_group_mlp_offload",
        buffers=frozenset({"dispatch"}),
        paths=PATHS,
        policies=RING,
        text="no fine-grained fused_group_mlp activation offload",
        fix="remove 'fused_group_mlp' from offload_modules or set fine_grained_activation_offloading=False",
        why="that path force-releases the expert input storage, which is the persistent dispatch slot",
        test=_no_fused_group_mlp_offload,
    ),
    Requirement(
        key="tokens_known",
        buffers=BOTH,
        paths=PATHS,
        policies=RING,
        text="the tokens per microbatch (to size the slots)",
        fix="pass seq_length and micro_batch_size (--seq-length, --micro-batch-size)",
        why="slot size = static bound rows x hidden x element size, and the rows depend on the tokens",
        test=lambda c: c.tokens is not None,
    ),
    Requirement(
        key="unfused_permute",
        buffers=BOTH,
        paths=frozenset({"alltoall"}),
        policies=RING,
        text="unfused permutation (moe_permute_fusion=False)",
        fix="set moe_permute_fusion=False",
        why="the slot is released after the sort/unpermute that copies it; only the unfused ops are "
        "verified not to save it for backward",
        test=lambda c: not _get(c.cfg, "moe_permute_fusion", False),
    ),
    Requirement(
        key="sequential_mlp",
        buffers=frozenset({"expert"}),
        paths=frozenset({"alltoall"}),
        policies=REUSE,
        text="local SequentialMLP experts (moe_grouped_gemm=False)",
        fix="set moe_grouped_gemm=False (the grouped MLP takes the buffer only through the TE adapter)",
        why="on the NCCL path the FC2 output is written into the buffer by the SequentialMLP hook",
        test=lambda c: not _get(c.cfg, "moe_grouped_gemm", False),
    ),
    Requirement(
        key="no_shared_expert_overlap",
        buffers=frozenset({"dispatch"}),
        paths=frozenset({"alltoall"}),
        policies=REUSE,
        text="no shared-expert overlap inside the dispatcher",
        fix="set moe_shared_expert_overlap=False",
        why="megatron-core moved the overlapped shared-expert FC1 between token_dispatch (0.19) and "
        "dispatch_postprocess (0.16); the dispatch hook does not replay either",
        test=lambda c: not _get(c.cfg, "moe_shared_expert_overlap", False),
    ),
    Requirement(
        key="no_moe_recompute",
        buffers=BOTH,
        paths=frozenset({"alltoall"}),
        policies=RING,
        text="no MoE-layer activation recompute",
        fix="drop 'moe' from recompute_modules, set moe_layer_recompute=False and recompute_granularity!='full'",
        why="recompute re-runs dispatch during backward and needs extra slots; not validated",
        test=_no_moe_recompute,
    ),
    Requirement(
        key="no_cuda_graphs",
        buffers=BOTH,
        paths=frozenset({"alltoall"}),
        policies=REUSE,
        text="no per-layer CUDA graphs; a full-iteration graph only with drop-and-pad",
        fix="set cuda_graph_impl='none', or cuda_graph_impl='full_iteration' with "
        "moe_pad_expert_input_to_capacity=True and moe_expert_capacity_factor",
        why="the full-iteration path runs capture, replays and eager calls through the pool's phase API "
        "(bufreuse.integrations.graphs); per-layer graphs capture part of an iteration while slots are held, "
        "and a dropless dispatcher syncs token counts to the host, which capture forbids",
        test=_graphs_ok,
    ),
    Requirement(
        key="dispatch_slots",
        buffers=frozenset({"dispatch"}),
        paths=PATHS | {None},
        policies=RING,  # type: ignore[operator]
        text="at least one dispatch-output slot",
        fix="set moe_hybridep_num_dispatch_output_buffers >= 1 (4 is a good start)",
        why="a ring with 0 slots cannot hold a buffer",
        test=lambda c: c.knobs.slots("dispatch") != 0,  # an int >= 1 or "auto"
    ),
)


@dataclass(kw_only=True, slots=True)
class CheckItem:
    """One evaluated row for one buffer."""

    key: str
    buffer: str
    policy: str
    ok: bool
    text: str
    why: str
    fix: str
    note: str = ""


@dataclass(kw_only=True, slots=True)
class CheckReport:
    """Everything ``check`` found: rows, path, bounds, features."""

    path: str | None
    knobs: BufReuseConfig
    items: list[CheckItem] = field(default_factory=list)
    bounds: dict[str, BufferBound] = field(default_factory=dict)
    features: Features | None = None

    @property
    def ok(self) -> bool:
        return all(i.ok for i in self.items)

    @property
    def unmet(self) -> list[CheckItem]:
        return [i for i in self.items if not i.ok]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (``bufreuse check-config --json``)."""
        return {
            "ok": self.ok,
            "path": self.path,
            "enabled": self.knobs.enabled(),
            "requirements": [
                {k: getattr(i, k) for k in ("key", "buffer", "policy", "ok", "text", "why", "fix", "note")}
                for i in self.items
            ],
            "rings": {
                b.buffer: {
                    "rows": b.rows,
                    "hidden": b.hidden,
                    "element_size": b.element_size,
                    "slots": b.slots,
                    "slot_bytes": b.slot_bytes,
                    "persistent_bytes": b.persistent_bytes,
                    "bound_source": b.source,
                }
                for b in self.bounds.values()
            },
            "persistent_bytes_total": sum(b.persistent_bytes for b in self.bounds.values()),
            "features": None if self.features is None else self.features.to_dict(),
        }


def check(
    cfg: Any,
    knobs: BufReuseConfig,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    features: Features | None = None,
) -> CheckReport:
    """Evaluate every applicable row of :data:`REQUIREMENTS` for the enabled buffers."""
    feats = features if features is not None else detect_features()
    path = dispatch_path(cfg)
    tokens = tokens_per_microbatch(cfg, seq_length=seq_length, micro_batch_size=micro_batch_size)
    ctx = _Ctx(cfg=cfg, knobs=knobs, path=path, tokens=tokens, features=feats)
    report = CheckReport(path=path, knobs=knobs, features=feats)
    for buffer, policy in knobs.enabled().items():
        for req in REQUIREMENTS:
            if buffer not in req.buffers or policy not in req.policies:
                continue
            if path is not None and path not in req.paths:
                continue
            if path is None and req.key != "dispatcher":
                continue
            ok = bool(req.test(ctx))
            note = ""
            missing = [f for f in req.needs_fields if not _has(cfg, f)]
            if not ok and missing:
                note = f"cannot be met on this megatron-core: field(s) {', '.join(missing)} do not exist (needs 0.19+)"
            if req.key == "deepep_output_token" or req.key == "te_grouped_output":
                note = feats.deepep_detail if req.key == "deepep_output_token" else feats.te_detail
            report.items.append(
                CheckItem(
                    key=req.key, buffer=buffer, policy=policy, ok=ok, text=req.text, why=req.why, fix=req.fix, note=note
                )
            )
    if path is not None:
        report.bounds = static_bounds(cfg, knobs, path=path, tokens=tokens)
    return report


def validate(
    cfg: Any,
    knobs: BufReuseConfig,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    features: Features | None = None,
) -> CheckReport:
    """Check at start-up; raise ONE :class:`ConfigError` naming every unmet row and its fix."""
    report = check(cfg, knobs, seq_length=seq_length, micro_batch_size=micro_batch_size, features=features)
    if not report.ok:
        lines = [
            f"[{i.buffer}/{i.policy}] {i.key}: needs {i.text} -> {i.fix}" + (f" ({i.note})" if i.note else "")
            for i in report.unmet
        ]
        raise ConfigError(
            f"bufreuse cannot be enabled as configured ({len(lines)} unmet requirement(s)): " + "; ".join(lines)
        )
    return report
