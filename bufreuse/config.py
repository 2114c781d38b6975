"""The feature's knobs, where they come from (YAML, argparse) and what they cost in memory.

The one place the static bound of each buffer is computed: ``check-config``, ``install()``,
``compare`` and the planner all call :func:`static_bounds`. Three knobs are named exactly as the
Megatron-LM draft PR names them; two more (per-buffer policy) are ours so users can pick ``ring`` /
``stream-ordered`` / ``record-stream`` by measurement. The requirement matrix and ``validate()``
live in :mod:`bufreuse.integrations.requirements`. This module imports neither torch nor
megatron-core, and nothing of bufreuse but :mod:`bufreuse.errors`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bufreuse.errors import ConfigError, InputError

__all__ = [
    "AUTO",
    "BUFFERS",
    "POLICIES",
    "BufReuseConfig",
    "BufferBound",
    "TorchAssumption",
    "add_arguments",
    "check_field_types",
    "dispatch_path",
    "dispatch_rows",
    "expert_tp",
    "identity_dispatch",
    "load_megatron_file",
    "nccl_records_streams",
    "pending_free_at_ep",
    "persistent_bytes",
    "probs_cast_copies",
    "single_rank_expert",
    "static_bounds",
    "sync_collectives_on_current_stream",
    "tokens_per_microbatch",
    "torch_assumption",
    "unused_rings",
]

POLICIES = ("ring", "stream-ordered", "record-stream")
"""Per-buffer policies; names match ``bufreuse.pool.Policy`` values."""

BUFFERS = {"dispatch": "dispatch_output", "expert": "expert_fc2_output"}
"""Short buffer key -> the pool's standard ring name."""

AUTO = "auto"
"""Slot count that the ring settles on during eager warm-up (``num_slots="auto"`` in the pool)."""


@dataclass(kw_only=True, slots=True)
class BufReuseConfig:
    """The opt-in switches; both buffers are independent and off by default."""

    moe_hybridep_reuse_dispatch_output_buffers: bool = False
    """Take the MoE dispatch output from a caller-owned buffer (the seed's knob; also the NCCL path)."""
    moe_hybridep_num_dispatch_output_buffers: int | str = 4
    """Slots in the dispatch-output ring (each holds one static-bound dispatch output), or ``"auto"``."""
    moe_hybridep_num_expert_output_buffers: int | str = 0
    """Slots in the expert FC2-output ring, or ``"auto"``; 0 disables expert-output reuse."""
    moe_bufreuse_dispatch_policy: str = "ring"
    """How the dispatch buffer is managed: ring | stream-ordered | record-stream (control)."""
    moe_bufreuse_expert_policy: str = "ring"
    """How the expert FC2 output is managed: ring | stream-ordered | record-stream (control)."""
    moe_bufreuse_auto_max_mib: int = 0
    """Memory cap per ``auto`` ring in MiB (its growth during warm-up stops there); 0: no cap."""
    moe_bufreuse_ring_identity_dispatch: bool = False
    """Validation aid: put an EP = 1 all-to-all dispatch (an identity upstream, so normally left alone) into
    the dispatch ring anyway, one copy per call, to exercise the dispatch ring's hooks on one GPU."""
    moe_bufreuse_ring_single_rank_expert: bool = False
    """Validation aid: put the FC2 output of an all-to-all layer at EP x ETP = 1 (made and read on one stream,
    so normally left alone) into the expert ring anyway, to exercise and measure its hooks on one GPU; TE
    writes into the slot, so this adds no copy."""
    moe_bufreuse_keep_unused_rings: bool = False
    """Override: keep rings the stream rule leaves unused (use when a trace shows MoE pending-free the rule does not
    predict): the rings :func:`pending_free_at_ep` finds nothing pending-free for at EP x ETP > 1 stay in use (also
    how to measure what they cost there)."""

    def __post_init__(self) -> None:
        bad = []
        for name in ("moe_bufreuse_dispatch_policy", "moe_bufreuse_expert_policy"):
            value = getattr(self, name)
            if value not in POLICIES:
                bad.append(f"{name}={value!r} (choose from {', '.join(POLICIES)})")
        for name in ("moe_hybridep_num_dispatch_output_buffers", "moe_hybridep_num_expert_output_buffers"):
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().lower() == AUTO:
                setattr(self, name, AUTO)
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                bad.append(f"{name}={value!r} (must be an integer >= 0 or 'auto')")
        cap = self.moe_bufreuse_auto_max_mib
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            bad.append(f"moe_bufreuse_auto_max_mib={cap!r} (must be an integer >= 0)")
        if bad:
            raise ConfigError("invalid bufreuse knobs: " + "; ".join(bad))

    @property
    def dispatch_enabled(self) -> bool:
        return bool(self.moe_hybridep_reuse_dispatch_output_buffers)

    @property
    def expert_enabled(self) -> bool:
        n = self.moe_hybridep_num_expert_output_buffers
        return n == AUTO or n > 0

    @property
    def auto_max_bytes(self) -> int | None:
        """The ``auto`` rings' memory cap in bytes (the pool's ``max_bytes``), None without a cap."""
        return self.moe_bufreuse_auto_max_mib * 2**20 or None

    def enabled(self) -> dict[str, str]:
        """``{buffer key: policy}`` for the buffers switched on."""
        out = {}
        if self.dispatch_enabled:
            out["dispatch"] = self.moe_bufreuse_dispatch_policy
        if self.expert_enabled:
            out["expert"] = self.moe_bufreuse_expert_policy
        return out

    def slots(self, buffer: str) -> int | str:
        """Slots the pool registers for ``buffer`` (0 unless its policy is ``ring``; ``"auto"`` if so set)."""
        policy = self.enabled().get(buffer)
        if policy != "ring":
            return 0
        if buffer == "dispatch":
            return self.moe_hybridep_num_dispatch_output_buffers
        return self.moe_hybridep_num_expert_output_buffers

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> BufReuseConfig:
        """Pick our knobs out of a Megatron YAML dict or args mapping (dashes or underscores)."""
        norm = {str(k).lstrip("-").replace("-", "_"): v for k, v in data.items()}
        kwargs = {f.name: norm[f.name] for f in fields(cls) if f.name in norm and norm[f.name] is not None}
        return cls(**kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace | Any) -> BufReuseConfig:
        """From a parsed namespace that went through :func:`add_arguments` (Megatron's ``args``)."""
        return cls.from_mapping({f.name: getattr(args, f.name, None) for f in fields(cls)})


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the knobs on ``parser``; usable as Megatron-LM's ``extra_args_provider``."""
    group = parser.add_argument_group(title="bufreuse (MoE buffer reuse)")
    group.add_argument(
        "--moe-hybridep-reuse-dispatch-output-buffers",
        action="store_true",
        default=False,
        help="Take the MoE dispatch output from a caller-owned buffer ring.",
    )
    group.add_argument(
        "--moe-hybridep-num-dispatch-output-buffers",
        type=_slots_arg,
        default=4,
        help="Slots in the dispatch-output ring, or 'auto' (grown during eager warm-up).",
    )
    group.add_argument(
        "--moe-hybridep-num-expert-output-buffers",
        type=_slots_arg,
        default=0,
        help="Slots in the expert FC2-output ring (0 disables), or 'auto'.",
    )
    group.add_argument(
        "--moe-bufreuse-auto-max-mib",
        type=int,
        default=0,
        help="Memory cap per 'auto' ring in MiB (0: no cap).",
    )
    group.add_argument(
        "--moe-bufreuse-ring-identity-dispatch",
        action="store_true",
        default=False,
        help="Validation aid: ring the EP = 1 dispatch (an identity, normally left alone) to exercise its hooks.",
    )
    group.add_argument(
        "--moe-bufreuse-ring-single-rank-expert",
        action="store_true",
        default=False,
        help="Validation aid: ring the FC2 output at EP x ETP = 1 (one stream, normally left alone) to exercise "
        "its hooks.",
    )
    group.add_argument(
        "--moe-bufreuse-keep-unused-rings",
        action="store_true",
        default=False,
        help="Override: keep rings the stream rule leaves unused (use when a trace shows MoE pending-free the rule "
        "does not predict).",
    )
    for buf in ("dispatch", "expert"):
        group.add_argument(
            f"--moe-bufreuse-{buf}-policy",
            choices=POLICIES,
            default="ring",
            help=f"Policy for the {buf} buffer: ring, stream-ordered or record-stream (control).",
        )
    return parser


def _slots_arg(text: str) -> int | str:
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {value}")
    return value


def load_megatron_file(path: str | Path) -> dict[str, Any]:
    """Read a Megatron YAML config or a file of command-line arguments into one flat dict.

    YAML: top-level keys (nested ``model:``/``language_model:`` sections are flattened). Args
    file: ``--flag value`` / ``--flag`` tokens, whitespace or newline separated, ``#`` comments.
    Raises :class:`InputError` when the file cannot be read or parsed.
    """
    p = Path(path)
    text = _read_config_text(p)
    if _is_yaml(p, text):
        import yaml

        try:
            data = yaml.load(text, Loader=_no_alias_loader())
            if not isinstance(data, dict):
                raise InputError(f"{p}: expected a mapping of Megatron fields at the top level")
            return check_field_types(_flatten(data), p)
        except yaml.YAMLError as e:  # the message names the place, never quotes the file's text
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or type(e).__name__
            raise InputError(f"{p} is not valid YAML{at}: {_cut(' '.join(str(problem).split()))}") from None
        except RecursionError:
            raise InputError(f"{p}: YAML nested too deep for a Megatron config") from None
        except ValueError as e:  # a key Python cannot print (an int of 10^5 digits, say)
            raise InputError(f"{p}: unusable YAML key ({_cut(str(e))})") from None
    return check_field_types(_parse_args_text(text, p), p)


_INT_FIELDS = (
    "hidden_size", "moe_latent_size", "seq_length", "micro_batch_size", "num_moe_experts", "num_experts",
    "moe_router_topk", "tensor_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "num_layers", "microbatch_group_size_per_vp_stage",
    "num_microbatches", "global_batch_size", "data_parallel_size",
)  # fmt: skip
_FLOAT_FIELDS = ("moe_expert_capacity_factor", "moe_expert_rank_capacity_factor")
_LIST_FIELDS = ("offload_modules", "recompute_modules")
"""Lists of module names (a single name is accepted and read as a list of one)."""
_MAX_FIELD = 1 << 40  # far above any model dimension, far below where byte products stop making sense


def check_field_types(fields_: dict[str, Any], where: str | Path) -> dict[str, Any]:
    """Refuse the fields the checks and the planner compute with when they are not of their type.

    Sizing fields must be integers in [0, 2^40] (capacity factors numbers in [0, 1e6]), module
    lists a name or a list of names. One :class:`ConfigError` line naming the field and the
    value's type, never the file's text (which may be anything). Returns ``fields_``.
    """
    for name in _INT_FIELDS:
        v = fields_.get(name)
        if v is not None and (type(v) is not int or not 0 <= v <= _MAX_FIELD):
            what = "out of range" if type(v) is int else _a_type(v)
            raise ConfigError(f"{where}: {name} is {what}, expected an integer in [0, 2^40]")
    for name in _FLOAT_FIELDS:
        v = fields_.get(name)
        if v is not None and (type(v) not in (int, float) or not 0 <= v <= 1e6):
            what = "out of range" if type(v) in (int, float) else _a_type(v)
            raise ConfigError(f"{where}: {name} is {what}, expected a number in [0, 1e6]")
    for name in _LIST_FIELDS:
        v = fields_.get(name)
        if v is None or isinstance(v, str):
            continue
        if not isinstance(v, list):
            raise ConfigError(f"{where}: {name} is {_a_type(v)}, expected a list of module names")
        bad = [x for x in v if not isinstance(x, str)]
        if bad:
            raise ConfigError(f"{where}: {name} holds {_a_type(bad[0])}, expected module names (strings)")
    return fields_


def _a_type(v: Any) -> str:
    """``a str``, ``an int``: the value's type for a message (never the value, which may be anything)."""
    name = type(v).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


_MAX_CONFIG_BYTES = 16 << 20  # a Megatron config is kilobytes; anything this big is not one


def _cut(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _read_config_text(p: Path) -> str:
    """The file as text; refuses huge files, binary files and invalid UTF-8 with one :class:`InputError`."""
    from bufreuse.fsutil import refuse_special_file

    refuse_special_file(p, what="a Megatron config")  # open() of a FIFO waits for a writer forever
    try:
        with open(p, "rb") as f:
            if os.fstat(f.fileno()).st_size > _MAX_CONFIG_BYTES:
                raise InputError(f"{p}: larger than {_MAX_CONFIG_BYTES >> 20} MiB, not a Megatron config")
            data = f.read(_MAX_CONFIG_BYTES + 1)  # regular file: read() sizes its buffer by the file
    except OSError as e:
        raise InputError(f"cannot read {p}: {e.strerror or type(e).__name__}") from None
    if len(data) > _MAX_CONFIG_BYTES:
        raise InputError(f"{p}: larger than {_MAX_CONFIG_BYTES >> 20} MiB, not a Megatron config")
    if b"\0" in data:
        raise InputError(f"{p}: a binary file (NUL bytes), not a Megatron config")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{p}: not UTF-8 text (bad byte at offset {e.start})") from None


def _no_alias_loader() -> type:
    """A ``yaml.SafeLoader`` that refuses aliases: ``*ref`` "billion laughs" expand without bound."""
    import yaml

    class _NoAliasLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            """A key given twice is refused: YAML's 'the later wins' would silently drop a setting."""
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {_cut(str(key), 60)!r} (first at line {seen[key].line + 1})",
                        key_node.start_mark,
                    )  # fmt: skip
                seen[key] = key_node.start_mark
            return super().construct_mapping(node, deep=deep)

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, "aliases (*name) are not allowed in a Megatron config", event.start_mark
                )
            return super().compose_node(parent, index)

    return _NoAliasLoader


def _flatten(data: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v))
        else:
            out[str(k).replace("-", "_")] = v
    return out


def unknown_flags(path: str | Path) -> list[str]:
    """Flags of an args file that neither Megatron-LM (the version in :mod:`bufreuse.megatron_flags`)
    nor bufreuse's knobs define: Megatron would refuse them, and the planner reads nothing from them.

    Empty for a YAML config (its sections hold keys of other tools too). Raises like :func:`load_megatron_file`.
    """
    from bufreuse.megatron_flags import MEGATRON_FLAGS

    p = Path(path)
    text = _read_config_text(p)
    if _is_yaml(p, text):
        return []
    ours = {f.name.replace("_", "-") for f in fields(BufReuseConfig)}
    known = MEGATRON_FLAGS | ours
    return [f"--{k.replace('_', '-')}" for k in _parse_args_text(text, p) if k.replace("_", "-") not in known]


def _is_yaml(p: Path, text: str) -> bool:
    first = next((ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
    return p.suffix in (".yaml", ".yml") or not first.startswith("--")


def _parse_args_text(text: str, path: Path) -> dict[str, Any]:
    import shlex

    text = text.replace("\\\n", " ")  # shell line continuations
    try:
        tokens = [t for line in text.splitlines() for t in shlex.split(line, comments=True)]
    except ValueError as e:
        raise InputError(f"{path}: cannot split into arguments: {e}") from None
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            raise InputError(f"{path}: expected --flag, got {tok!r}")
        key, eq, val = tok[2:].partition("=")
        key = key.replace("-", "_")
        if eq:
            out[key] = _scalar(val)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            vals = []
            while i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                vals.append(_scalar(tokens[i + 1]))
                i += 1
            out[key] = vals[0] if len(vals) == 1 else vals
            i += 1
        else:
            out[key] = True
            i += 1
    return out


def _scalar(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


@dataclass(kw_only=True, slots=True)
class BufferBound:
    """The static bound of one buffer and what its ring holds persistently."""

    buffer: str
    """``dispatch`` or ``expert``."""
    rows: int
    """Token rows of the largest output (the static bound)."""
    hidden: int
    """Columns per row."""
    element_size: int
    """Bytes per element of the activation dtype."""
    slots: int
    """Ring slots (0 for stream-ordered / record-stream, and for ``auto`` until warm-up settles it)."""
    source: str
    """Where the bound comes from, in words."""

    @property
    def slot_bytes(self) -> int:
        return self.rows * self.hidden * self.element_size

    @property
    def persistent_bytes(self) -> int:
        return self.slots * self.slot_bytes


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default) if not isinstance(cfg, Mapping) else cfg.get(name, default)


def tokens_per_microbatch(cfg: Any, *, seq_length: int | None, micro_batch_size: int | None) -> int | None:
    """Tokens entering one MoE layer per rank per microbatch (S x B / CP / TP under sequence parallel)."""
    if not seq_length or not micro_batch_size:
        return None
    tokens = int(seq_length) * int(micro_batch_size)
    tokens //= max(1, int(_get(cfg, "context_parallel_size", 1) or 1))
    if _get(cfg, "sequence_parallel", False):
        tokens //= max(1, int(_get(cfg, "tensor_model_parallel_size", 1) or 1))
    return tokens


def _element_size(cfg: Any) -> int:
    if _get(cfg, "bf16", False) or _get(cfg, "fp16", False):
        return 2
    dtype = str(_get(cfg, "params_dtype", "") or "")
    return 2 if ("bfloat16" in dtype or "float16" in dtype) else 4


def _quant_alignment(cfg: Any) -> int:
    """Row alignment HybridEP rounds the budget to (mirrors megatron's quantization alignment)."""
    if _get(cfg, "use_transformer_engine_op_fuser", False):
        return 256
    if _get(cfg, "fp8", None):
        return 32 if "mxfp8" in str(_get(cfg, "fp8_recipe", "")) else 16
    if _get(cfg, "fp4", None):
        return 32
    return 0


def dispatch_path(cfg: Any) -> str | None:
    """``hybridep`` (flex + hybridep backend), ``alltoall`` (NCCL all-to-all) or None (unsupported)."""
    kind = _get(cfg, "moe_token_dispatcher_type", "allgather")
    if kind == "alltoall":
        return "alltoall"
    if kind == "flex" and _get(cfg, "moe_flex_dispatcher_backend", None) == "hybridep":
        return "hybridep"
    return None


def dispatch_rows(cfg: Any, path: str, tokens: int) -> tuple[int, str]:
    """Static row bound of the dispatch output on ``path`` (``hybridep`` or ``alltoall``)."""
    topk = int(_get(cfg, "moe_router_topk", 2) or 2)
    experts = int(_get(cfg, "num_moe_experts", 1) or 1)
    ep = int(_get(cfg, "expert_model_parallel_size", 1) or 1)
    local = max(1, experts // ep)
    pad = bool(_get(cfg, "moe_pad_expert_input_to_capacity", False))
    factor = _get(cfg, "moe_expert_capacity_factor", None)
    rank_factor = _get(cfg, "moe_expert_rank_capacity_factor", None)
    if path == "hybridep" and rank_factor is not None:
        budget = int(tokens * topk * float(rank_factor))
        align = _quant_alignment(cfg)
        if align:
            budget += -budget % align
        return budget, f"rank capacity: int({tokens} x {topk} x {rank_factor}) aligned to {align or 1}"
    if pad and factor is not None:
        capacity = math.ceil(tokens * topk / experts * float(factor))
        return capacity * ep * local, f"pad to capacity: {capacity} x EP {ep} x {local} local experts"
    if path == "alltoall":
        rows = ep * tokens * min(topk, local)
        return rows, f"dropless worst case: EP {ep} x {tokens} tokens x min(topk {topk}, {local} local experts)"
    return 0, "none (set moe_expert_rank_capacity_factor or moe_pad_expert_input_to_capacity)"


def identity_dispatch(cfg: Any, path: str | None) -> bool:
    """Whether the dispatch returns its input (NCCL all-to-all at EP = 1): no allocation for a ring to replace.

    ``install()`` then registers no dispatch ring, and the bounds count none of its bytes.
    """
    return path == "alltoall" and int(_get(cfg, "expert_model_parallel_size", 1) or 1) == 1


def single_rank_expert(cfg: Any, path: str | None) -> bool:
    """Whether the FC2 output is made and read on one stream with no collective (all-to-all at EP x ETP = 1).

    Then megatron's combine reduces no expert-TP shards and its all-to-all returns its input, and
    ``overlap_moe_expert_parallel_comm`` (EP > 1 only) cannot move it to a comm stream: the allocator frees
    the output at once, there is no pending free, and a ring would only add a slot and its hooks.
    """
    return path == "alltoall" and int(_get(cfg, "expert_model_parallel_size", 1) or 1) == 1 and expert_tp(cfg) == 1


def expert_tp(cfg: Any) -> int:
    """Expert tensor-parallel size; unset, it is the tensor-parallel size, as megatron's config resolves it."""
    return int(_get(cfg, "expert_tensor_parallel_size", None) or _get(cfg, "tensor_model_parallel_size", 1) or 1)


@dataclass(frozen=True, slots=True)
class TorchAssumption:
    """The torch version the EP >= 2 stream rule judges a config by, and where that version came from.

    ``bufreuse plan`` / ``check-config`` / ``advise`` run where the config is read, not where it trains:
    ``source`` is ``installed`` (this environment's torch), ``option`` (``--torch-version``) or ``assumed``
    (no torch here and no option: 2.8 or later, ``version`` None).
    """

    version: str | None
    source: str
    current_stream: bool | None = None
    """For an installed pre-release (``2.8.0a0+...``): what its ``all_to_all_single`` does with a synchronous
    collective (:func:`sync_collectives_on_current_stream`), which decides instead of the version string; None: not
    probed (a release, an option, nothing installed)."""

    def records_streams(self, env: Mapping[str, str] | None = None) -> bool:
        """:func:`nccl_records_streams` for this version (an assumed >= 2.8: False), or by the probed behaviour."""
        if self.current_stream is not None:
            return not self.current_stream and not _avoid_record_streams(os.environ if env is None else env)
        return self.version is not None and nccl_records_streams(self.version, env)

    def text(self, env: Mapping[str, str] | None = None) -> str:
        """``judged for torch X (source)``, naming ``TORCH_NCCL_AVOID_RECORD_STREAMS`` where it decided."""
        if self.version is None:
            return "judged for torch >= 2.8 (assumed: no torch installed here; pass --torch-version)"
        how = {"installed": "installed here", "option": "--torch-version"}.get(self.source, self.source)
        out = f"judged for torch {self.version} ({how})"
        counted, literal = _torch_minor(self.version), re.match(r"\s*(\d+)\.(\d+)", self.version)
        if self.current_stream is not None:
            out += (", a pre-release judged by what it does: its all_to_all_single leaves a synchronous collective "
                    "to the backend (no work.wait(): run on the current stream, no record_stream), as 2.8 does"
                    if self.current_stream else
                    ", a pre-release judged by what it does: its all_to_all_single waits on the work of a "
                    "synchronous collective (run on NCCL's own stream, record_stream), as 2.7 does")  # fmt: skip
        elif counted is not None and literal is not None and counted != (int(literal[1]), int(literal[2])):
            out += f", a pre-release counted as {counted[0]}.{counted[1]}"
        if self.records_streams({}) and not self.records_streams(env):
            out += " with TORCH_NCCL_AVOID_RECORD_STREAMS set (environment)"
        return out


def torch_assumption(version: str | None = None) -> TorchAssumption:
    """The torch version to judge by: ``version`` (``--torch-version``), else the installed one, else assumed.

    Reads the installed distribution's metadata (no torch import).

    Raises:
        InputError: ``version`` is not a version (``MAJOR.MINOR[...]``).
    """
    if version is not None:
        if _torch_minor(version) is None:
            raise InputError(f"--torch-version {version!r}: expected a torch version such as 2.7.1 or 2.8.0a0")
        return TorchAssumption(version.strip(), "option")
    installed = _installed_torch()
    if installed is None:
        return TorchAssumption(None, "assumed")
    return TorchAssumption(installed, "installed", _probe_if_pre_release(installed))


def _probe_if_pre_release(version: str) -> bool | None:
    """The installed torch's behaviour (:func:`sync_collectives_on_current_stream`) when ``version`` is a pre-release of
    the release that changed it (2.8.0a0, rc, dev: a nightly or container build between 2.7 and 2.8), else None."""
    counted, literal = _torch_minor(version), re.match(r"\s*(\d+)\.(\d+)", version)
    if counted is None or literal is None or (int(literal[1]), int(literal[2])) != (2, 8) or counted == (2, 8):
        return None
    return sync_collectives_on_current_stream()


def sync_collectives_on_current_stream(source: str | None = None) -> bool | None:
    """Whether the installed torch leaves a synchronous ``all_to_all_single`` to the backend's stream order.

    pytorch#150398 (torch 2.8) launches a synchronous NCCL collective on the current stream, with no
    ``record_stream``, and returns no work for it: ``distributed_c10d.all_to_all_single`` then calls ``work.wait()``
    only ``elif work is not None``. Before it the collective ran on NCCL's own stream, recorded there, and the Python
    side always waited on the work. Read from the installed ``torch/distributed/distributed_c10d.py`` (no torch
    import: this module stays torch-free); ``source`` stands in for that file's text (tests). None when the file or
    the function is not there.
    """
    if source is None:
        import importlib.util

        try:
            spec = importlib.util.find_spec("torch")
        except (ImportError, ValueError):
            return None
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        path = next((Path(r, "distributed", "distributed_c10d.py") for r in roots), None)
        if path is None or not path.is_file():
            return None
        source = path.read_text(encoding="utf-8", errors="replace")[:2_000_000]
    m = re.search(r"\ndef all_to_all_single\(.*?(?=\ndef |\Z)", source, re.S)
    if m is None:
        return None
    return re.search(r"elif\s*\(?\s*work\s+is\s+not\s+None", m.group(0)) is not None


def _installed_torch() -> str | None:
    """The installed torch distribution's version (metadata, no import), None when there is none."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _torch_minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of the torch release a version string has every change of; None when it does not start
    ``MAJOR.MINOR``.

    A pre-release of ``X.Y.0`` (``a``, ``b``, ``rc``, ``dev``: a nightly, an NGC build from before the release)
    counts as the minor before it, since it may predate a change that release has (conservative for the NCCL rule:
    it records streams, so the rings stay in use); a local tag (``+cu128``, ``+git...``) is ignored.
    """
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?(.*)", version.split("+")[0])
    if not m:
        return None
    major, minor, micro, rest = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), m.group(4).lower()
    if micro == 0 and re.match(r"[.\-_]?(a|alpha|b|beta|c|rc|pre|preview|dev)\d*", rest):
        return (major, minor - 1) if minor else (major - 1, 99)
    return (major, minor)


def nccl_records_streams(torch_version: str | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Whether ProcessGroupNCCL runs a collective on its own stream and records the tensors there (``recordStream``).

    Before torch 2.8 it did, for every collective, unless ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` (then it stashed
    references until ``wait()``). From 2.8 (pytorch#150398) a synchronous collective runs on the current stream
    and an asynchronous one stashes its tensors until ``wait()``: no ``recordStream`` at all, and the variable is
    deprecated. ``torch_version`` None reads the installed distribution's metadata (no torch import); unknown
    counts as the current behaviour.
    """
    env = os.environ if env is None else env
    if torch_version is None:
        return torch_assumption().records_streams(env)  # an installed pre-release: by its behaviour
    minor = _torch_minor(torch_version)
    if minor is None or minor >= (2, 8):
        return False
    return not _avoid_record_streams(env)


def _avoid_record_streams(env: Mapping[str, str]) -> bool:
    return str(env.get("TORCH_NCCL_AVOID_RECORD_STREAMS", "0")).strip().lower() in ("1", "true", "yes")


def _local_experts(cfg: Any) -> int:
    experts = int(_get(cfg, "num_moe_experts", 1) or 1)
    return max(1, experts // max(1, int(_get(cfg, "expert_model_parallel_size", 1) or 1)))


def pending_free_at_ep(cfg: Any, buffer: str, *, records_streams: bool | None = None) -> str | None:
    """Why the control leaves nothing of ``buffer`` pending-free (all-to-all path, EP x ETP > 1); None if it does.

    A buffer waits pending-free only when a stream other than the one it was allocated on is recorded on it
    (``record_stream``) and that stream still has work queued when the buffer is freed (docs/megatron.md,
    "Which buffers cross streams at EP >= 2"). On this path that happens in two ways:

    - ``overlap_moe_expert_parallel_comm`` (combined 1F1B): the all-to-alls run on the comm stream, and
      ``ScheduleNode.free_input`` records (``record_stream``) and empties the input of the ``mlp`` node (the dispatch
      output; only where megatron frees it: FP8/FP4, or more than one local expert) and of the ``moe_combine``
      node (the FC2 output only when ``combine_preprocess`` hands it on unchanged: one local expert, expert-TP 1,
      no FP8 padding inside the experts; otherwise it reads a copy the ring does not hold);
    - NCCL that records streams (``nccl_records_streams``: torch < 2.8 without ``TORCH_NCCL_AVOID_RECORD_STREAMS``):
      the dispatch output and whatever the combine's collective reads (the FC2 output with one local expert and
      no FP8 padding inside the experts).

    Not established, so kept in use (conservative): ``overlap_dispatch_backward_with_experts_wgrad`` where FC1
    saves the dispatch output itself (one bf16 local expert, expert-TP 1): its delayed wgrad reads it on
    ``_delayed_wgrad_stream``; the sources read (TE ``GroupedLinear.backward_dw``, megatron's
    ``_RegisterDelayedWgradForExperts``) drop it there without ``record_stream``, which no run has measured.

    Otherwise (torch >= 2.8, or gloo, whose side stream is idle by the time the buffer is freed because the host
    waited for it) both collectives run in order with the compute stream and nothing waits: a ring only adds its
    storage. ``records_streams`` None asks :func:`nccl_records_streams` (gloo never counts).
    """
    overlap = bool(_get(cfg, "overlap_moe_expert_parallel_comm", False))
    backend = str(_get(cfg, "distributed_backend", "nccl") or "nccl").lower()
    if backend == "gloo":
        records_streams = False
    elif backend != "nccl":
        records_streams = True  # a backend the rule does not know (ucc, mpi, a plugin): assumed to record, rings kept
    elif records_streams is None:
        records_streams = nccl_records_streams()
    local = _local_experts(cfg)
    quantized = bool(_get(cfg, "fp8", None) or _get(cfg, "fp4", None))
    if buffer == "dispatch":
        if records_streams:
            return None
        if _get(cfg, "overlap_dispatch_backward_with_experts_wgrad", False) and (
            local == 1 and not quantized and expert_tp(cfg) == 1
        ):
            return None  # FC1's delayed wgrad reads it on another stream: kept until a trace shows nothing waits
        if overlap and (quantized or local > 1):
            return None
        if overlap:
            return ("EP overlap with one bf16 local expert: the mlp node keeps the dispatch output for its "
                    "backward and frees it without record_stream, nothing waits pending-free")  # fmt: skip
        return (f"EP {_get(cfg, 'expert_model_parallel_size', 1)}: the all-to-all runs in order with the "
                f"compute stream ({_how(backend)}), the dispatch output is freed at once, nothing waits "
                "pending-free")  # fmt: skip
    cast = probs_cast_copies(cfg)
    handed_on = local == 1 and not pads_inside_experts(cfg) and cast is None
    if handed_on and (records_streams or (overlap and expert_tp(cfg) == 1)):
        return None
    if cast is not None and local == 1 and not pads_inside_experts(cfg):
        return (f"{cast}: the reduce-scatter reads that copy, so the FC2 output is freed at once, nothing waits "
                "pending-free")  # fmt: skip
    if not handed_on:
        return ("the combine's collective reads a copy of the FC2 output (the local-expert sort or FP8 unpadding "
                "on the compute stream), so the FC2 output is freed at once, nothing waits pending-free")  # fmt: skip
    if overlap:
        return ("EP overlap with expert-TP > 1: the reduce-scatter on the compute stream reads the FC2 output and "
                "the comm stream gets its result, nothing waits pending-free")  # fmt: skip
    return (f"the combine all-to-all runs in order with the compute stream ({_how(backend)}), the FC2 output is "
            "freed at once, nothing waits pending-free")  # fmt: skip


def probs_cast_copies(cfg: Any) -> str | None:
    """Why the combine copies the FC2 output before its expert-TP reduce-scatter, or None when it does not.

    megatron-core 0.19.2 ``MoEAlltoAllTokenDispatcher.combine_preprocess`` at expert TP > 1 reduce-scatters
    ``hidden_states.to(self.probs.dtype)``; the router's probs are in ``moe_router_dtype`` (fp32 / fp64) when it is
    set, else in the activations' dtype (``router.py``: logits in the router dtype, ``moe_utils``: probs
    ``type_as(logits)``). A different dtype makes ``.to`` a copy on the compute stream, and the collective reads the
    copy, not the FC2 output.
    """
    if expert_tp(cfg) == 1:
        return None
    router = str(_get(cfg, "moe_router_dtype", None) or "").lower()
    probs = {"fp32": 4, "fp64": 8}.get(router)
    if probs is None or probs == _element_size(cfg):
        return None
    return (f"expert TP {expert_tp(cfg)} with moe_router_dtype={router}: combine_preprocess casts the FC2 output to "
            f"the router probs' {router} before the reduce-scatter, a copy on the compute stream")  # fmt: skip


def _how(backend: str) -> str:
    if backend == "gloo":
        return "gloo: the host waits for its side stream, which is idle when the buffer is freed"
    return "NCCL from torch 2.8: synchronous collectives on the current stream, no record_stream"


def unused_rings(
    cfg: Any,
    knobs: BufReuseConfig,
    path: str | None,
    *,
    records_streams: bool | None = None,
    torch_version: TorchAssumption | None = None,
) -> dict[str, str]:
    """``{buffer key: why}`` for the enabled buffers ``install()`` leaves alone because they replace nothing.

    The one rule ``install()``, :func:`static_bounds` and the planner share: at EP = 1 the dispatch is an
    identity, at EP x ETP = 1 the FC2 output never leaves one stream, and at EP x ETP > 1 on the all-to-all path
    :func:`pending_free_at_ep` says where nothing waits pending-free. The validation aids
    (``moe_bufreuse_ring_identity_dispatch``, ``moe_bufreuse_ring_single_rank_expert``) and the override
    ``moe_bufreuse_keep_unused_rings`` keep a ring in use. On NCCL the EP >= 2 rule depends on the torch
    version (:func:`nccl_records_streams`): ``records_streams`` decides it outright; else it is judged for
    ``torch_version`` (default: :func:`torch_assumption`, the installed torch), and each reason it gives ends
    with the version judged for and where it came from.
    """
    enabled = knobs.enabled()
    out = {}
    if "dispatch" in enabled and identity_dispatch(cfg, path) and not knobs.moe_bufreuse_ring_identity_dispatch:
        out["dispatch"] = "EP = 1: the all-to-all dispatch returns its input, no allocation to replace"
    if "expert" in enabled and single_rank_expert(cfg, path) and not knobs.moe_bufreuse_ring_single_rank_expert:
        out["expert"] = "EP x ETP = 1: the FC2 output is made and read on one stream, nothing pending-free to replace"
    if path == "alltoall" and not knobs.moe_bufreuse_keep_unused_rings:
        ep = int(_get(cfg, "expert_model_parallel_size", 1) or 1)
        judged = None
        if records_streams is None and str(_get(cfg, "distributed_backend", "nccl") or "nccl").lower() == "nccl":
            judged = torch_version if torch_version is not None else torch_assumption()
            records_streams = judged.records_streams()
        for buf in enabled:
            if buf in out or (buf == "dispatch" and ep == 1) or (buf == "expert" and ep * expert_tp(cfg) == 1):
                continue
            why = pending_free_at_ep(cfg, buf, records_streams=records_streams)
            if why is not None:
                out[buf] = why if judged is None else f"{why}; {judged.text()}"
    return out


def static_bounds(
    cfg: Any, knobs: BufReuseConfig, *, path: str, tokens: int | None, torch_version: TorchAssumption | None = None
) -> dict[str, BufferBound]:
    """Bounds and persistent bytes per enabled buffer (slots x rows x hidden x element size).

    An enabled buffer that replaces nothing (:func:`unused_rings`, judged for ``torch_version``) is listed with
    its bound but 0 slots: ``install()`` registers no ring for it.
    """
    if tokens is None:
        return {}
    hidden = int(_get(cfg, "moe_latent_size", None) or _get(cfg, "hidden_size", 0) or 0)
    rows, source = dispatch_rows(cfg, path, tokens)
    etp = expert_tp(cfg)
    unused = unused_rings(cfg, knobs, path, torch_version=torch_version)
    out = {}
    for buf in knobs.enabled():
        r, src = (rows, source) if buf == "dispatch" else (rows * etp, source)
        pad = expert_pad_rows(cfg, path) if buf == "expert" else 0
        if pad:
            r += pad
            src += f"; + {pad} FP8/FP4 pad rows (TE grouped experts pad each local expert's split inside)"
        slots = knobs.slots(buf)
        if buf in unused:
            slots, src = 0, f"{src}; not used: {unused[buf]}"
        out[buf] = BufferBound(
            buffer=buf,
            rows=r,
            hidden=hidden,
            element_size=_element_size(cfg),
            slots=slots if isinstance(slots, int) else 0,
            source=src,
        )
    return out


def pads_inside_experts(cfg: Any) -> bool:
    """Whether megatron's ``TEGroupedMLP`` pads FP8/FP4 splits itself (``Fp8Padding``/``Fp8Unpadding``):
    quantized grouped experts without router-side padding (``moe_router_padding_for_quantization``)."""
    quantized = _get(cfg, "fp8", None) or _get(cfg, "fp4", None)
    router_pads = _get(cfg, "moe_router_padding_for_quantization", False) or _get(
        cfg, "moe_router_padding_for_fp8", False
    )
    return bool(quantized) and bool(_get(cfg, "moe_grouped_gemm", False)) and not router_pads


def expert_pad_rows(cfg: Any, path: str) -> int:
    """Rows the FC2 output gains when megatron's ``TEGroupedMLP`` pads FP8/FP4 splits itself (all-to-all).

    Without router-side padding (``moe_router_padding_for_quantization``) the experts round each local
    expert's split up to the quantization alignment (``Fp8Padding``), so TE's FC2 writes up to
    ``local experts x (alignment - 1)`` more rows than the dispatch delivered (H200, TE 2.20.2: the ring
    bound of the 2026-12-03 FP8 runs).
    """
    if path != "alltoall" or not pads_inside_experts(cfg):
        return 0
    experts = int(_get(cfg, "num_moe_experts", 1) or 1)
    ep = int(_get(cfg, "expert_model_parallel_size", 1) or 1)
    align = 128 if _get(cfg, "fp4", None) else _quant_alignment(cfg)
    return max(1, experts // ep) * max(0, align - 1)


def persistent_bytes(cfg: Any, knobs: BufReuseConfig, *, path: str, tokens: int | None) -> int:
    """Bytes the enabled rings hold for the whole run (sum of :attr:`BufferBound.persistent_bytes`)."""
    return sum(b.persistent_bytes for b in static_bounds(cfg, knobs, path=path, tokens=tokens).values())
