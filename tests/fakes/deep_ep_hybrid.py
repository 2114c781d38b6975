"""A fake DeepEP ``HybridEPBuffer`` (world size 1) with the seed's ``output_token=`` and nothing else added.

Signature source: deepseek-ai/DeepEP, hybrid-ep branch, ``deep_ep/hybrid_ep_buffer.py`` at commit
098da2a6dee107028535a5776248891d6e376918 (``HybridEPBuffer.__init__``, and the keyword-only
``dispatch_with_permute`` and ``combine_with_unpermute``). The ``UPSTREAM_*`` strings are those
parameter lists as text; tests compare the fakes to them. The bodies are ours: at world size 1,
dispatch is an expert-major permutation of the local tokens (each expert's rows padded to
``pad_multiple``, the rest of the ``num_permuted_tokens`` rows zero) and combine sums each token's
expert rows back; the handle carries the routing so backward passes (dispatch with a handle,
combine with probs) work as megatron-core's ``HybridEPDispatch`` / ``HybridEPCombine`` call them.
"""

from __future__ import annotations

import torch

UPSTREAM_COMMIT = "098da2a6dee107028535a5776248891d6e376918"
UPSTREAM_INIT = (  # upstream annotates these (ProcessGroup, int, bool); names, order and defaults are what count
    "(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts, use_fp8=False, "
    "num_sms_dispatch_api=None, num_sms_combine_api=None, num_sms_preprocessing_api=None, "
    "num_sms_permute_api=None, num_of_ranks_per_nvlink_domain=None, use_mnnvl=None)"
)
UPSTREAM_DISPATCH_WITH_PERMUTE = (
    "(self, *, hidden, topk_idx=None, topk_weights=None, num_of_experts_per_rank=None, num_of_experts=None, "
    "use_fp8=None, routing_map=None, probs=None, scaling_factor=None, num_permuted_tokens=None, "
    "pad_multiple=None, handle=None, non_blocking=False)"
)
UPSTREAM_COMBINE_WITH_UNPERMUTE = "(self, *, hidden, probs=None, handle=None, pad_multiple=None)"


def _layout(routing_map: torch.Tensor, pad_multiple: int | None) -> tuple[list[torch.Tensor], list[int]]:
    """Token indices per expert and each expert's row count after padding to ``pad_multiple``."""
    idx = [routing_map[:, e].nonzero().flatten() for e in range(routing_map.shape[1])]
    rows = [int(i.numel()) for i in idx]
    if pad_multiple:
        rows = [r + (-r % pad_multiple) for r in rows]
    return idx, rows


def _permute(hidden, routing_map, probs, num_permuted_tokens, out, pad_multiple=None, handle=None):
    if handle is not None:
        routing_map, pad_multiple = handle[0], handle[2]
    idx, rows = _layout(routing_map, pad_multiple)
    n = sum(rows) if num_permuted_tokens is None else int(num_permuted_tokens)
    if out is None:
        out = hidden.new_empty((n, hidden.shape[1]))
    out.zero_()
    p = None if probs is None else probs.new_zeros(n)
    off = 0
    for e, (i, r) in enumerate(zip(idx, rows, strict=True)):
        take = min(int(i.numel()), max(0, n - off))  # rows past the budget are dropped
        out[off : off + take] = hidden[i[:take]]
        if p is not None:
            p[off : off + take] = probs[i[:take], e]
        off += r
    counts = torch.tensor(rows)
    overflow = torch.tensor(int(sum(rows) > n))
    return out, p, counts, (routing_map, counts, pad_multiple, hidden.shape[0], overflow)


def _unpermute(hidden, probs, handle):
    routing_map, counts, _, num_tokens, _ = handle
    idx, _ = _layout(routing_map, handle[2])
    out = hidden.new_zeros((num_tokens, hidden.shape[1]))
    p = None if probs is None else probs.new_zeros(routing_map.shape)
    off = 0
    for e, (i, r) in enumerate(zip(idx, counts.tolist(), strict=True)):
        take = min(int(i.numel()), max(0, hidden.shape[0] - off))
        out.index_add_(0, i[:take], hidden[off : off + take])
        if p is not None:
            p[i[:take], e] = probs[off : off + take]
        off += r
    return out, p


class HybridEPBufferUpstream:
    """The upstream API: no way to pass the output buffer."""

    def __init__(
        self,
        group,
        hidden_dim,
        max_num_of_tokens_per_rank,
        num_local_experts,
        use_fp8=False,
        num_sms_dispatch_api=None,
        num_sms_combine_api=None,
        num_sms_preprocessing_api=None,
        num_sms_permute_api=None,
        num_of_ranks_per_nvlink_domain=None,
        use_mnnvl=None,
    ):
        self.group, self.hidden_dim, self.num_local_experts = group, hidden_dim, num_local_experts
        self.calls: list[str] = []
        """``dispatch`` / ``combine`` per call, with ``+output_token`` when a caller buffer came in."""
        self.output_tokens: list[torch.Tensor] = []
        """Every ``output_token`` received (tests compare ``data_ptr`` with the ring's slots)."""

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
        self.calls.append("dispatch")
        out, p, counts, handle = _permute(hidden, routing_map, probs, num_permuted_tokens, None, pad_multiple, handle)
        return out, p, None, counts, handle

    def combine_with_unpermute(self, *, hidden, probs=None, handle=None, pad_multiple=None):
        self.calls.append("combine")
        return _unpermute(hidden, probs, handle)


class HybridEPBuffer(HybridEPBufferUpstream):
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
        self.calls.append("dispatch" if output_token is None else "dispatch+output_token")
        if output_token is not None:
            self.output_tokens.append(output_token)
        out, p, counts, handle = _permute(
            hidden, routing_map, probs, num_permuted_tokens, output_token, pad_multiple, handle
        )
        return out, p, None, counts, handle


class HybridEPBufferIgnoringOutput(HybridEPBuffer):
    """Accepts ``output_token`` but allocates anyway (what the adapter must catch)."""

    def dispatch_with_permute(self, *, output_token=None, **kwargs):  # type: ignore[override]
        return super().dispatch_with_permute(output_token=None, **kwargs)
