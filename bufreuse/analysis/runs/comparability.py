"""Whether two runs can be compared: their configurations (from Megatron's arguments) and their scopes.

A step-time delta between runs with another world size or pipeline layout says nothing about
buffer rings. Megatron prints its arguments at start-up; :func:`run_config` reads the fields that
change throughput or memory (parallel layout, batch, sequence length, precision, recompute), and
:func:`config_caveats` lists every difference, to be stated above the verdicts.

Scopes: a Megatron log's memory peaks are the maximum over the ranks that report (one job), a
snapshot's are one device of one process, a sweep's ``metrics.json`` one device of its run.
Comparing a log with a snapshot compares different things: :func:`scope_conflict` says so, and
``compare`` refuses unless forced (then it states the caveat).
"""

from __future__ import annotations

from bufreuse.analysis.runs.record import RunRecord

__all__ = ["CONFIG_FIELDS", "SCOPES", "SOFTWARE", "config_caveats", "run_config", "scope_conflict", "software_caveats"]

CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("world_size", "world size"),
    ("data_parallel_size", "DP"),
    ("tensor_model_parallel_size", "TP"),
    ("pipeline_model_parallel_size", "PP"),
    ("virtual_pipeline_model_parallel_size", "virtual PP"),
    ("expert_model_parallel_size", "EP"),
    ("expert_tensor_parallel_size", "ETP"),
    ("context_parallel_size", "CP"),
    ("sequence_parallel", "sequence parallel"),
    ("micro_batch_size", "micro batch"),
    ("global_batch_size", "global batch"),
    ("seq_length", "sequence length"),
    ("precision", "precision"),
    ("recompute", "recompute"),
    ("num_experts", "experts"),
    ("moe_router_topk", "top-k"),
    ("moe_token_dispatcher_type", "dispatcher"),
    ("moe_capacity_factor", "capacity factor"),
    ("moe_grouped_gemm", "grouped GEMM"),
)
"""(key in :attr:`RunRecord.config`, name in caveats), in the order caveats list them. FP8 is part of
``precision``; EP and the MoE keys are read under the names each fork prints (:data:`ALIASES`)."""

ALIASES: dict[str, tuple[str, ...]] = {
    "expert_model_parallel_size": ("expert_model_parallel_size", "moe_expert_parallel_size", "ep_size"),
    "num_experts": ("num_experts", "num_moe_experts"),
    "moe_router_topk": ("moe_router_topk", "topk", "moe_top_k"),
    "moe_token_dispatcher_type": ("moe_token_dispatcher_type",),
    "moe_capacity_factor": (
        "moe_expert_capacity_factor",
        "moe_train_capacity_factor",
        "moe_expert_rank_capacity_factor",
    ),
    "moe_grouped_gemm": ("moe_grouped_gemm",),
}
"""Comparable key -> the argument names Megatron-LM and Megatron-DeepSpeed print for it (first found wins)."""

SCOPES = {
    "megatron": "a Megatron log: memory is the maximum over the job's reporting ranks",
    "snapshot": "an allocator snapshot: memory of one device of one process",
    "sweep": "a sweep configuration: metrics.json of one device",
}

_DIRECT = {key for key, _ in CONFIG_FIELDS} - {"precision", "recompute"} - set(ALIASES)


def run_config(args: dict[str, str]) -> dict[str, str]:
    """The comparable fields of Megatron's printed arguments, as display strings (absent ones left out)."""
    cfg = {k: args[k] for k in _DIRECT if args.get(k) not in (None, "")}
    for key, names in ALIASES.items():
        value = next((args[n] for n in names if args.get(n) not in (None, "")), None)
        if value is not None:
            cfg[key] = value
    dispatcher = cfg.get("moe_token_dispatcher_type")
    backend = args.get("moe_flex_dispatcher_backend") or ("deepep" if args.get("moe_enable_deepep") == "True" else None)
    if dispatcher == "flex" and backend not in (None, "None", ""):
        cfg["moe_token_dispatcher_type"] = f"flex ({backend})"
    if "seq_length" not in cfg and args.get("encoder_seq_length"):
        cfg["seq_length"] = args["encoder_seq_length"]
    precision = _precision(args)
    if precision:
        cfg["precision"] = precision
    recompute = _recompute(args)
    if recompute:
        cfg["recompute"] = recompute
    return cfg


def _true(args: dict[str, str], key: str) -> bool:
    return args.get(key) == "True"


def _precision(args: dict[str, str]) -> str | None:
    if not any(k in args for k in ("fp16", "bf16", "fp8", "params_dtype")):
        return None
    base = "bf16" if _true(args, "bf16") else "fp16" if _true(args, "fp16") else "fp32"
    fp8 = args.get("fp8")
    if fp8 not in (None, "None", "False", ""):
        recipe = args.get("fp8_recipe")
        return f"fp8 {fp8}" + (f" ({recipe})" if recipe not in (None, "None") else "") + f" over {base}"
    return base


def _recompute(args: dict[str, str]) -> str | None:
    if not any(k in args for k in ("recompute_granularity", "checkpoint_activations", "recompute_activations")):
        return None
    granularity = args.get("recompute_granularity")
    if granularity in (None, "None", ""):
        if _true(args, "checkpoint_activations") or _true(args, "recompute_activations"):
            granularity = "full" if _true(args, "checkpoint_activations") else "selective"
        else:
            return "none"
    parts = [granularity]
    for key in ("recompute_method", "recompute_num_layers"):
        if args.get(key) not in (None, "None", ""):
            parts.append(f"{key.removeprefix('recompute_')}={args[key]}")
    if args.get("recompute_modules") not in (None, "None", "") and granularity == "selective":
        parts.append(f"modules={args['recompute_modules']}")
    return " ".join(parts)


def config_caveats(base: RunRecord, run: RunRecord) -> list[str]:
    """Every configuration difference between ``base`` and ``run`` (and what could not be checked)."""
    if base.kind != "megatron" or run.kind != "megatron":
        return []
    if not base.config or not run.config:
        missing = " and ".join(r.label for r in (base, run) if not r.config)
        return [f"no Megatron arguments block in {missing}: configurations not compared"]
    out = []
    for key, name in CONFIG_FIELDS:
        a, b = base.config.get(key), run.config.get(key)
        if a is not None and b is not None and a != b:
            out.append(f"configurations differ: {name} {a} in {base.label}, {b} in {run.label}")
        elif key in _MOE_KEYS and (a is None) != (b is None):
            have, lacks = (base, run) if a is not None else (run, base)
            out.append(
                f"configurations may differ: {name} {a if a is not None else b} in {have.label}, "
                f"not printed in {lacks.label}"
            )
    return out


_MOE_KEYS = frozenset({"num_experts", "moe_router_topk", "expert_model_parallel_size", "moe_token_dispatcher_type"})
"""MoE keys whose absence on one side is itself a difference (a dense run prints none of them)."""


SOFTWARE = (("torch", "torch"), ("deepspeed", "DeepSpeed"), ("cuda", "CUDA (torch's)"))
"""(key in :attr:`RunRecord.software`, name in caveats)."""


def software_caveats(base: RunRecord, run: RunRecord) -> list[str]:
    """Every software version both runs print and that differs (``software differs: torch 2.1.0 in a, ...``)."""
    out = []
    for key, name in SOFTWARE:
        a, b = base.software.get(key), run.software.get(key)
        if a is not None and b is not None and a != b:
            out.append(f"software differs: {name} {a} in {base.label}, {b} in {run.label}")
    return out


def scope_conflict(base: RunRecord, run: RunRecord) -> str | None:
    """The caveat when ``base`` and ``run`` measure memory over different scopes, else None."""
    if base.kind == run.kind or {base.kind, run.kind} - set(SCOPES):
        return None
    return f"different scopes: {base.label} is {SCOPES[base.kind]}; {run.label} is {SCOPES[run.kind]}"
