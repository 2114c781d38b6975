"""``bufreuse check-config FILE``: the requirement checklist for a Megatron YAML or arguments file.

Megatron-LM argument names are mapped to ``TransformerConfig`` field names where they differ
(``--num-experts`` -> ``num_moe_experts``, ``--fp8-format`` -> ``fp8``, ...); everything else is
read under its own name. No megatron-core is needed: the checks read the fields as plain data.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from bufreuse.config import BufReuseConfig, TorchAssumption, load_megatron_file
from bufreuse.errors import InputError
from bufreuse.integrations.features import Features
from bufreuse.integrations.requirements import CheckReport, check

__all__ = ["ARG_ALIASES", "check_file", "megatron_fields"]

ARG_ALIASES = {
    "num_experts": "num_moe_experts",
    "fp8_format": "fp8",
    "fp4_format": "fp4",
}
"""Megatron-LM argument name -> TransformerConfig field, where they differ."""


def megatron_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Normalise a loaded file into TransformerConfig field names (aliases applied, dashes removed)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = ARG_ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        out[name] = value
    if isinstance(out.get("offload_modules"), str):
        out["offload_modules"] = [out["offload_modules"]]
    if isinstance(out.get("recompute_modules"), str):
        out["recompute_modules"] = [out["recompute_modules"]]
    return out


def check_file(
    path: str | Path,
    *,
    assume_enabled: bool = False,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    features: Features | None = None,
    torch_version: TorchAssumption | None = None,
) -> CheckReport:
    """Load ``path`` and evaluate the requirement matrix for the buffers it enables.

    ``assume_enabled`` checks both buffers as if switched on (slot counts from the file or the
    defaults: 4 dispatch, 4 expert) -- useful on a baseline config. Raises :class:`InputError`
    for unreadable files or bad knob values.
    """
    fields = megatron_fields(load_megatron_file(path))
    try:
        knobs = BufReuseConfig.from_mapping(fields)
    except InputError as e:
        raise InputError(f"{path}: {e}") from None
    if assume_enabled:
        knobs = replace(
            knobs,
            moe_hybridep_reuse_dispatch_output_buffers=True,
            moe_hybridep_num_expert_output_buffers=knobs.moe_hybridep_num_expert_output_buffers or 4,
        )
    return check(
        fields,
        knobs,
        seq_length=seq_length if seq_length is not None else fields.get("seq_length"),
        micro_batch_size=micro_batch_size if micro_batch_size is not None else fields.get("micro_batch_size"),
        features=features,
        torch_version=torch_version,
    )
