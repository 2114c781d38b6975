"""Every megatron-core private API bufreuse touches, in one place, with the assumptions written down.

The adapters and ``install()`` reach megatron-core internals only through this module, so an
upstream change breaks one file, and :data:`CONTRACT` (checked by ``tests/test_compat_megatron.py``
against every megatron-core version we support) says which assumption broke. Nothing here is
patched at import; every ``patch_*`` returns its undo (or None when the installed megatron-core
has no such thing).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CONTRACT",
    "EXTRA",
    "SCHEDULED_RELEASE_MODULES",
    "Assumption",
    "comm_manager",
    "contract_problems",
    "dtoh_and_synchronize",
    "full_cuda_graph_wrapper",
    "hybridep_manager_cls",
    "megatron_core_version",
    "pad_for_quantization",
    "patch_bulk_offload",
    "patch_grad_sync_coalescing",
    "patch_hybrid_ep_buffer",
    "patch_schedule_node_free_input",
    "recorded_problems",
    "scheduled_tensor_release",
    "shared_capture_stream",
    "skip_ring_forced_release",
    "skip_ring_free_input",
    "te_fused_impl",
]

_TD = "megatron.core.transformer.moe.token_dispatcher"
_A2A = "megatron.core.transformer.moe.fused_a2a"
_EXPERTS = "megatron.core.transformer.moe.experts"
_PP = "megatron.core.pipeline_parallel.utils"
_OFFLOAD = "megatron.core.pipeline_parallel.fine_grained_activation_offload"
_FCG = "megatron.core.full_cuda_graph"
_PGB = "megatron.core.distributed.param_and_grad_buffer"


@dataclass(frozen=True, slots=True)
class Assumption:
    """One thing we rely on: ``module.attr`` exists (and, for a callable, takes ``params`` in order)."""

    module: str
    attr: str
    """Dotted attribute path inside ``module`` (``Class.method``)."""
    params: tuple[str, ...] | None = None
    """Leading parameter names of the callable, ``self`` included; None: existence only."""
    optional: bool = False
    """Absent on some supported versions (the code falls back); checked only when present."""
    used_by: str = ""
    """Which bufreuse code depends on it."""


CONTRACT: tuple[Assumption, ...] = (
    Assumption(module=_TD, attr="_HybridEPManager", used_by="HybridEP adapter: supports()"),
    Assumption(
        module=_TD,
        attr="_HybridEPManager.dispatch",
        params=("self", "hidden_states", "async_finish", "allocate_on_comm_stream"),
        used_by="HybridEP adapter: dispatch hook",
    ),
    Assumption(module=_TD, attr="_HybridEPManager.setup_metadata", used_by="num_permuted_tokens (the static bound)"),
    Assumption(
        module=_TD,
        attr="MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        params=("self", "point", "tokens_per_expert"),
        used_by="NCCL adapter: token_dispatch hook",
    ),
    Assumption(
        module=_TD,
        attr="MoEFlexTokenDispatcher.token_combine",
        params=("self", "hidden_states", "async_finish", "allocate_on_comm_stream"),
        used_by="TE adapter: FC2 release after combine",
    ),
    Assumption(module=_A2A, attr="init_hybrid_ep_buffer", used_by="HybridEP adapter: output_token injection"),
    Assumption(module=_A2A, attr="_hybrid_ep_buffer", used_by="HybridEP adapter: output_token injection"),
    Assumption(module=_A2A, attr="HybridEPBuffer", optional=True, used_by="HybridEP adapter (needs DeepEP)"),
    Assumption(
        module=_EXPERTS,
        attr="SequentialMLP._pad_tensor_for_quantization",
        params=("self", "hidden", "probs"),
        used_by="NCCL adapter: SequentialMLP hook under FP8/FP4",
    ),
    Assumption(module=_EXPERTS, attr="OUTPUT_BUFFER_KEY", optional=True, used_by="TE adapter"),
    Assumption(
        module=_EXPERTS,
        attr="TEGroupedMLP._fused_forward",
        optional=True,
        used_by="TE adapter: the op-fuser grouped MLP (_with_fused_impl)",
    ),
    Assumption(module=_PP, attr="ScheduleNode._forward", params=("self",), used_by="free_input skips ring storage"),
    Assumption(module=_PP, attr="is_symm_backed", optional=True, used_by="free_input copy: zero-copy EP skip"),
    Assumption(
        module=_OFFLOAD,
        attr="ChunkOffloadHandler.bulk_offload",
        params=("self",),
        used_by="forced_released_tensors (last positional or keyword) skips ring storage",
    ),
    Assumption(module=_FCG, attr="FullCudaGraphWrapper.__call__", used_by="full-iteration CUDA graphs"),
    Assumption(module=_FCG, attr="FullCudaGraphWrapper.curr_iter", params=("self", "stage"), used_by="graphs"),
    Assumption(module=_FCG, attr="FullCudaGraphWrapper.cuda_graph", used_by="graphs: replay detection"),
    Assumption(module=_FCG, attr="get_shared_capture_stream", optional=True, used_by="graphs: capture stream"),
    Assumption(
        module=_PGB,
        attr="_coalescing_manager",
        used_by="gloo grad sync: the DDP bucket collectives' manager, replaced at this module attribute",
    ),
    Assumption(
        module=_PGB,
        attr="_ParamAndGradBucketGroup.start_grad_sync",
        params=("self", "force_all_reduce"),
        used_by="gloo grad sync: buckets reduced inside _coalescing_manager, its handle kept as grad_reduce_handle",
    ),
    Assumption(
        module=_PGB,
        attr="_ParamAndGradBucketGroup.finish_grad_sync",
        params=("self", "force_all_reduce"),
        used_by="gloo grad sync: waits grad_reduce_handle",
    ),
    Assumption(
        module=_PGB,
        attr="_ParamAndGradBucketGroup.start_param_sync",
        params=("self", "force_sync"),
        used_by="gloo grad sync: distributed optimizer's param all-gather inside _coalescing_manager",
    ),
)
"""What ``tests/test_compat_megatron.py`` checks against each supported megatron-core."""

_MOE = "megatron.core.transformer.moe.moe_layer"
_TE_EXT = "megatron.core.extensions.transformer_engine"

EXTRA: tuple[Assumption, ...] = (
    Assumption(
        module=_EXPERTS,
        attr="TEGroupedMLP.forward",
        params=("self", "permuted_local_hidden_states", "tokens_per_expert", "permuted_probs", "output_buffer"),
        optional=True,
        used_by="TE adapter, op-fuser route: output_buffer= (refused by name where absent)",
    ),
    Assumption(
        module=_EXPERTS,
        attr="SequentialMLP.forward",
        params=("self", "permuted_local_hidden_states", "tokens_per_expert", "permuted_probs"),
        used_by="all-to-all adapter, FC2 ring: experts.forward replaced by one with these parameters",
    ),
    Assumption(
        module="megatron.core.transformer.mlp",
        attr="MLP.forward",
        params=("self", "hidden_states"),
        used_by="all-to-all adapter, FC2 ring: each local expert called as expert(tokens, probs)",
    ),
    Assumption(
        module=_TE_EXT,
        attr="TEGroupedLinear.forward",
        params=("self", "x", "m_splits"),
        optional=True,
        used_by="TE adapter, module route: FC2 called as (x, m_splits); the TE class gets out=",
    ),
    Assumption(
        module=_PP,
        attr="ScheduleNode.__init__",
        params=("self", "forward_func", "stream", "event", "backward_func", "free_input"),
        used_by="free_input skips ring storage",
    ),
    Assumption(
        module="megatron.core.pipeline_parallel.combined_1f1b_tensor_release",
        attr="Combined1F1BTensorRelease",
        optional=True,
        used_by="combined-1F1B scheduled tensor release: refused with the ring under EP overlap",
    ),
    Assumption(module=_MOE, attr="MoELayer.routed_experts_compute", used_by="every adapter: experts hook"),
    Assumption(module=_MOE, attr="MoELayer.backward_dw", optional=True, used_by="delayed wgrad"),
    Assumption(module=_TD, attr="MoEAlltoAllTokenDispatcher.token_dispatch", used_by="NCCL adapter: dispatch hook"),
    Assumption(
        module=_TD, attr="MoEAlltoAllTokenDispatcher.dispatch_postprocess", used_by="NCCL adapter: sort release"
    ),
    Assumption(module=_TD, attr="MoEAlltoAllTokenDispatcher.combine_preprocess", used_by="NCCL adapter: FC2 release"),
    Assumption(module=_TD, attr="MoEAlltoAllTokenDispatcher.token_combine", used_by="NCCL adapter: FC2 release"),
    Assumption(module=_TD, attr="MoEAlltoAllTokenDispatcher.combine_postprocess", used_by="NCCL adapter: FC2 release"),
)
"""Upstream names the adapters reach through instance overrides or feature checks rather than this module;
recorded for Megatron-LM main/dev (``scripts/record_megatron_contract.py``) beside :data:`CONTRACT`."""

SCHEDULED_RELEASE_MODULES = (
    "megatron.core.pipeline_parallel.combined_1f1b_tensor_release",
    "megatron.core.pipeline_parallel.tensor_lifetime",
)
"""Megatron-LM dev's combined-1F1B scheduled tensor release (PR 7062 and its successor): it binds producer
streams to tensor objects, rejects storage aliases in a node transition, and empties consumed storage with
``untyped_storage().resize_(0)`` -- a ring slot's storage is the whole ring. Not on PyPI releases yet."""


def _resolve(module: str, attr: str) -> Any:
    import importlib

    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def megatron_core_version() -> str:
    """The importable megatron-core's version (``package_info``), ``unknown`` when it has none."""
    try:
        from megatron.core import package_info
    except ImportError:
        return "unknown"
    return str(getattr(package_info, "__version__", "unknown"))


def contract_problems(contract: tuple[Assumption, ...] = CONTRACT) -> list[str]:
    """Check every assumption against the importable megatron-core; one line per broken one."""
    ver = megatron_core_version()
    problems = []
    for a in contract:
        where = f"megatron-core {ver}: {a.module}.{a.attr} (used by {a.used_by})"
        try:
            obj = _resolve(a.module, a.attr)
        except (ImportError, AttributeError) as e:
            if not a.optional:
                problems.append(f"{where} is missing: {e}")
            continue
        if a.params is not None:
            try:
                names = tuple(inspect.signature(obj).parameters)
            except (TypeError, ValueError) as e:
                problems.append(f"{where} has no inspectable signature: {e}")
                continue
            problems += _param_problem(a, names, where)
    return problems


def recorded_problems(symbols: dict[str, dict], contract: tuple[Assumption, ...], label: str) -> list[str]:
    """:func:`contract_problems` over a recording (``module:attr`` -> ``{"present", "params"}``) of sources
    that cannot be installed (Megatron-LM main/dev); parameters as the recorder writes them (``*args``)."""
    problems = []
    for a in contract:
        where = f"{label}: {a.module}.{a.attr} (used by {a.used_by})"
        entry = symbols.get(f"{a.module}:{a.attr}")
        if entry is None:
            problems.append(f"{where} was not recorded (re-run scripts/record_megatron_contract.py)")
            continue
        if not entry["present"]:
            if not a.optional:
                problems.append(f"{where} is missing")
            continue
        if a.params is not None and entry["params"] is not None:
            names = tuple(n.lstrip("*") for n in entry["params"])
            problems += _param_problem(a, names, where)
    return problems


def _param_problem(a: Assumption, names: tuple[str, ...], where: str) -> list[str]:
    if names[: len(a.params or ())] != a.params:
        return [f"{where} takes {names}, expected it to start with {a.params}"]
    return []


def scheduled_tensor_release() -> str | None:
    """The module of megatron's combined-1F1B scheduled tensor release when importable, else None."""
    import importlib.util

    for name in SCHEDULED_RELEASE_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def hybridep_manager_cls() -> type | None:
    """``token_dispatcher._HybridEPManager`` (the flex dispatcher's HybridEP backend), None if absent."""
    from megatron.core.transformer.moe import token_dispatcher as td

    return getattr(td, "_HybridEPManager", None)


def comm_manager(dispatcher: Any) -> Any:
    """The flex dispatcher's backend manager (``MoEFlexTokenDispatcher._comm_manager``)."""
    return getattr(dispatcher, "_comm_manager", None)


def dtoh_and_synchronize(dispatcher: Any, point: str, tokens_per_expert: Any) -> Any:
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` (host copy of the token counts)."""
    return dispatcher._maybe_dtoh_and_synchronize(point, tokens_per_expert)


def pad_for_quantization(experts: Any, tokens: Any, probs: Any) -> tuple[Any, Any]:
    """``SequentialMLP._pad_tensor_for_quantization`` (row padding an FP8/FP4 GEMM needs)."""
    return experts._pad_tensor_for_quantization(tokens, probs)


def te_fused_impl(experts: Any) -> bool:
    """Whether a ``TEGroupedMLP`` runs the TE op fuser (``_with_fused_impl``)."""
    return bool(getattr(experts, "_with_fused_impl", False))


def patch_hybrid_ep_buffer(
    fused_a2a: Any, wrap: Callable[[Any], Any], unwrap: Callable[[Any], Any | None]
) -> Callable[[], None]:
    """Wrap fused_a2a's process-wide ``_hybrid_ep_buffer`` now and whenever megatron (re)creates it.

    ``wrap(buffer)`` returns the stand-in; ``unwrap(obj)`` returns the wrapped buffer, or None when
    ``obj`` is not a stand-in. Returns the undo, which restores ``init_hybrid_ep_buffer`` and the buffer.
    """
    orig_init = fused_a2a.init_hybrid_ep_buffer

    def rewrap() -> None:
        buf = getattr(fused_a2a, "_hybrid_ep_buffer", None)
        if buf is not None and unwrap(buf) is None:
            fused_a2a._hybrid_ep_buffer = wrap(buf)

    @functools.wraps(orig_init)
    def init_hybrid_ep_buffer(*args: Any, **kwargs: Any) -> None:
        orig_init(*args, **kwargs)
        rewrap()

    fused_a2a.init_hybrid_ep_buffer = init_hybrid_ep_buffer
    rewrap()

    def restore() -> None:
        fused_a2a.init_hybrid_ep_buffer = orig_init
        inner = unwrap(getattr(fused_a2a, "_hybrid_ep_buffer", None))
        if inner is not None:
            fused_a2a._hybrid_ep_buffer = inner

    return restore


def _patch_class(cls: type, attr: str, new: Any) -> Callable[[], None]:
    old = cls.__dict__[attr]
    setattr(cls, attr, new)
    return lambda: setattr(cls, attr, old)


def skip_ring_free_input(
    pp_utils: Any, probe: Callable[[Any], bool]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A ``ScheduleNode._forward`` whose ``free_input`` leaves ring storage alone.

    When an input is ring storage, the original runs with ``free_input=False`` and the free is
    replayed here for the other inputs: ``record_stream`` then ``resize_(0)``, skipping symmetric-
    memory buffers under zero-copy EP exactly as megatron-core's body does.
    """

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


def skip_ring_forced_release(probe: Callable[[Any], bool]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A ``ChunkOffloadHandler.bulk_offload`` whose ``forced_released_tensors`` omit ring storage."""

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


def patch_schedule_node_free_input(probe: Callable[[Any], bool]) -> Callable[[], None] | None:
    """Make ``ScheduleNode._forward``'s ``free_input`` skip ring storage; the undo, or None."""
    try:
        from megatron.core.pipeline_parallel import utils as pp_utils
    except ImportError:
        return None
    cls = getattr(pp_utils, "ScheduleNode", None)
    if cls is None:
        return None
    return _patch_class(cls, "_forward", skip_ring_free_input(pp_utils, probe)(cls.__dict__["_forward"]))


def patch_bulk_offload(probe: Callable[[Any], bool]) -> Callable[[], None] | None:
    """Make ``ChunkOffloadHandler.bulk_offload``'s forced release skip ring storage; the undo, or None."""
    try:
        from megatron.core.pipeline_parallel import fine_grained_activation_offload as off
    except ImportError:
        return None
    cls = getattr(off, "ChunkOffloadHandler", None)
    if cls is None or "bulk_offload" not in cls.__dict__:
        return None
    return _patch_class(cls, "bulk_offload", skip_ring_forced_release(probe)(cls.__dict__["bulk_offload"]))


def patch_grad_sync_coalescing(make: Callable[[Any], Any], *, marker: str = "") -> Callable[[], None] | None:
    """Replace ``param_and_grad_buffer._coalescing_manager`` (DDP grad reduce, param all-gather) with
    ``make(original)``; the undo, or None when absent or already carrying the attribute ``marker``."""
    try:
        from megatron.core.distributed import param_and_grad_buffer as pgb
    except ImportError:
        return None
    orig = getattr(pgb, "_coalescing_manager", None)
    if orig is None or (marker and getattr(orig, marker, False)):
        return None
    pgb._coalescing_manager = make(orig)
    return lambda: setattr(pgb, "_coalescing_manager", orig)


def full_cuda_graph_wrapper() -> type | None:
    """megatron-core's ``FullCudaGraphWrapper`` (``cuda_graph_impl="full_iteration"``), None if absent."""
    try:
        from megatron.core import full_cuda_graph as fcg
    except ImportError:
        return None
    cls = getattr(fcg, "FullCudaGraphWrapper", None)
    return cls if cls is not None and "__call__" in vars(cls) else None


def shared_capture_stream() -> Any:
    """``full_cuda_graph.get_shared_capture_stream()``; None on older megatron-core (capture syncs first)."""
    fcg = sys.modules.get(_FCG)
    get = getattr(fcg, "get_shared_capture_stream", None) if fcg is not None else None
    return get() if get is not None else None
