"""A fake DeepEP ``HybridEPBuffer`` (world size 1) with the seed's ``output_token=`` and nothing else added.

Signature source: deepseek-ai/DeepEP, hybrid-ep branch, ``deep_ep/hybrid_ep_buffer.py`` at commit
098da2a6dee107028535a5776248891d6e376918 (``HybridEPBuffer.dispatch_with_permute``, keyword-only).
:data:`UPSTREAM_DISPATCH_WITH_PERMUTE` is that parameter list as text; tests compare the fakes to it.
The body is ours: at world size 1, dispatch is an expert-major permutation of the local tokens.
"""

from __future__ import annotations

import torch

UPSTREAM_COMMIT = "098da2a6dee107028535a5776248891d6e376918"
UPSTREAM_DISPATCH_WITH_PERMUTE = (
    "(self, *, hidden, topk_idx=None, topk_weights=None, num_of_experts_per_rank=None, num_of_experts=None, "
    "use_fp8=None, routing_map=None, probs=None, scaling_factor=None, num_permuted_tokens=None, "
    "pad_multiple=None, handle=None, non_blocking=False)"
)


def _permute(hidden, routing_map, probs, num_permuted_tokens, out):
    rows = [hidden[routing_map[:, e]] for e in range(routing_map.shape[1])]
    counts = torch.tensor([r.shape[0] for r in rows])
    n = int(counts.sum()) if num_permuted_tokens is None else int(num_permuted_tokens)
    if out is None:
        out = hidden.new_empty((n, hidden.shape[1]))
    torch.cat(rows, dim=0, out=out[: int(counts.sum())])
    out[int(counts.sum()) :].zero_()
    p = None if probs is None else torch.cat([probs[routing_map[:, e], e] for e in range(routing_map.shape[1])])
    return out, p, counts


class HybridEPBufferUpstream:
    """The upstream API: no way to pass the output buffer."""

    def dispatch_with_permute(
        self,
        *,
        hidden,
        topk_idx=None,
        topk_weights=None,
        num_of_experts_per_rank=None,
        num_of_experts=None,
        use_fp8=None,
        routing_map=None,
        probs=None,
        scaling_factor=None,
        num_permuted_tokens=None,
        pad_multiple=None,
        handle=None,
        non_blocking=False,
    ):
        out, p, counts = _permute(hidden, routing_map, probs, num_permuted_tokens, None)
        return out, p, None, counts, ("handle",)


class HybridEPBuffer:
    """The seed's API: upstream plus ``output_token`` (the caller-owned output)."""

    def dispatch_with_permute(
        self,
        *,
        hidden,
        topk_idx=None,
        topk_weights=None,
        num_of_experts_per_rank=None,
        num_of_experts=None,
        use_fp8=None,
        routing_map=None,
        probs=None,
        scaling_factor=None,
        num_permuted_tokens=None,
        pad_multiple=None,
        handle=None,
        non_blocking=False,
        output_token=None,
    ):
        out, p, counts = _permute(hidden, routing_map, probs, num_permuted_tokens, output_token)
        return out, p, None, counts, ("handle",)


class HybridEPBufferIgnoringOutput(HybridEPBuffer):
    """Accepts ``output_token`` but allocates anyway (what the adapter must catch)."""

    def dispatch_with_permute(self, *, output_token=None, **kwargs):  # type: ignore[override]
        return super().dispatch_with_permute(output_token=None, **kwargs)
