"""Detect what the installed DeepEP and Transformer Engine offer, by feature, never by version.

- DeepEP: ``HybridEPBuffer.dispatch_with_permute`` accepting ``output_token`` (the seed's API;
  upstream hybrid-ep has none as of deepseek-ai/DeepEP@098da2a6dee107028535a5776248891d6e376918).
- Transformer Engine: ``transformer_engine.pytorch.ops.basic.grouped_linear.OUTPUT_BUFFER_KEY``
  importable (the op-fuser route megatron-core 0.19.2 uses), or ``GroupedLinear.forward`` taking
  ``out``. Imports happen only when :func:`detect_features` is called.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Features", "accepts_keyword", "deepep_output_token", "detect_features", "te_grouped_output"]


@dataclass(kw_only=True, slots=True)
class Features:
    """Backend capabilities found in this environment, with a sentence each."""

    deepep_output_token: bool
    deepep_detail: str
    te_grouped_output: bool
    te_detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """True if ``fn`` takes keyword ``name`` explicitly (a bare ``**kwargs`` does not count)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return p is not None and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def deepep_output_token(buffer_cls: Any = None) -> tuple[bool, str]:
    """Whether ``buffer_cls.dispatch_with_permute`` takes ``output_token`` (imports DeepEP if None)."""
    if buffer_cls is None:
        buffer_cls = _import_attr(("deep_ep", "deep_ep.hybrid_ep_buffer"), "HybridEPBuffer")
        if buffer_cls is None:
            return False, "DeepEP with HybridEP is not installed (deep_ep.HybridEPBuffer not importable)"
    fn = getattr(buffer_cls, "dispatch_with_permute", None)
    if fn is None:
        return False, f"{buffer_cls.__name__} has no dispatch_with_permute"
    if accepts_keyword(fn, "output_token"):
        return True, f"{buffer_cls.__name__}.dispatch_with_permute accepts output_token"
    return False, f"{buffer_cls.__name__}.dispatch_with_permute has no output_token parameter (upstream lacks it)"


def te_grouped_output(grouped_linear_cls: Any = None, ops_module: Any = None) -> tuple[bool, str]:
    """Whether TE takes a caller-provided grouped-linear output (op-fuser key or ``out=``)."""
    if ops_module is None and grouped_linear_cls is None:
        ops_module = _import_module("transformer_engine.pytorch.ops.basic.grouped_linear")
        grouped_linear_cls = _import_attr(("transformer_engine.pytorch",), "GroupedLinear")
    if ops_module is not None and getattr(ops_module, "OUTPUT_BUFFER_KEY", None) is not None:
        return True, "transformer_engine ops grouped_linear.OUTPUT_BUFFER_KEY is importable"
    if grouped_linear_cls is not None and accepts_keyword(grouped_linear_cls.forward, "out"):
        return True, "transformer_engine GroupedLinear.forward accepts out="
    if ops_module is None and grouped_linear_cls is None:
        return False, "Transformer Engine (torch) is not installed"
    return False, "Transformer Engine has neither OUTPUT_BUFFER_KEY nor GroupedLinear.forward(out=)"


def detect_features() -> Features:
    """Probe the environment once (imports DeepEP/TE if present; costs their import time)."""
    d_ok, d_detail = deepep_output_token()
    t_ok, t_detail = te_grouped_output()
    return Features(deepep_output_token=d_ok, deepep_detail=d_detail, te_grouped_output=t_ok, te_detail=t_detail)


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception:  # a broken optional backend counts as absent
        return None


def _import_attr(modules: tuple[str, ...], attr: str) -> Any:
    for name in modules:
        mod = _import_module(name)
        if mod is not None and getattr(mod, attr, None) is not None:
            return getattr(mod, attr)
    return None
