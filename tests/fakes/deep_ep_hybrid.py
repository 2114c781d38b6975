"""A fake DeepEP ``HybridEPBuffer`` (world size 1) with the seed's ``output_token=`` and nothing else added.

Signatures: deepseek-ai/DeepEP, branch hybrid-ep, ``deep_ep/hybrid_ep_buffer.py`` at commit
94a9f8f6b146c07d97ec58f67cd6d303296d6098 (2026-07-10): ``HybridEPBuffer.__init__`` and the
keyword-only ``dispatch_with_permute`` / ``combine_with_unpermute``, parameter names, kinds, order
and defaults as upstream has them (deprecated ones included), and the 11-field handle. No text
copy of them is kept here: ``tests/test_fake_deep_ep_contract.py`` checks these signatures against
what megatron-core 0.19.2 really passes (its call sites read with ``ast``, and its own
``fused_a2a`` code calling into this fake on every branch).

The bodies are ours: at world size 1, dispatch is an expert-major permutation of the local tokens
(each expert's rows padded to ``pad_multiple`` with zero rows, rows past that budget dropped and
``overflow_flag`` set) and combine sums each token's expert rows back. Which rows a dispatch writes
follows upstream's kernels (hybrid-ep @ 94a9f8f6, ``csrc/hybrid_ep/extension/permute.cu`` and the fused
dispatch-permute in ``backend/hybrid_ep_backend.cuh``): the dispatched rows, and each expert's padding
rows set to zero (tokens, probs and scales); the rows past the padded splits are not written (upstream
allocates its output with ``torch::empty``; the fake's own output is zeros there, a caller's
``output_token`` keeps what it held). The handle's ``sparse_to_dense_map`` (token x expert -> permuted
row, -1 if none) is what both directions use, so backward passes (dispatch with a handle, combine with
probs) work as megatron-core's ``HybridEPDispatch`` / ``HybridEPCombine`` call them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

UPSTREAM_COMMIT = "94a9f8f6b146c07d97ec58f67cd6d303296d6098"
"""The DeepEP hybrid-ep commit whose signatures these fakes mirror."""
HANDLE_FIELDS = 11
"""Upstream's handle: sparse_to_dense_map ... config, overflow_flag (megatron reads ``handle[-1]``)."""


@dataclass(kw_only=True, slots=True)
class TemplateConfig:
    """Stands in for upstream's ``HybridEpConfigInstance`` (field 10 of the handle)."""

    hidden_dim: int
    num_of_experts_per_rank: int
    pad_multiple: int
    fuse_permute_dispatch: bool


def _sparse_to_dense(
    routing_map: torch.Tensor, pad_multiple: int | None, num_permuted_tokens: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    """Permuted row of every (token, expert), -1 where unrouted or dropped; counts; row total; overflow."""
    tokens_per_expert = routing_map.sum(0).to(torch.int64)
    padded = tokens_per_expert.clone()
    if pad_multiple:
        padded += -padded % pad_multiple
    needed = int(padded.sum())
    rows = needed if num_permuted_tokens is None else int(num_permuted_tokens)
    mapping = torch.full(routing_map.shape, -1, dtype=torch.int64)
    off = 0
    for e in range(routing_map.shape[1]):
        idx = routing_map[:, e].nonzero().flatten()
        take = min(int(idx.numel()), max(0, rows - off))
        mapping[idx[:take], e] = torch.arange(off, off + take)
        off += int(padded[e])
    return mapping, tokens_per_expert, padded, rows, needed > rows


def _padding_rows(counts: torch.Tensor, padded: torch.Tensor, rows: int) -> torch.Tensor:
    """Row indices of every expert's padding (after its ``counts`` tokens, up to ``padded``), below ``rows``."""
    idx: list[int] = []
    off = 0
    for c, p in zip(counts.tolist(), padded.tolist(), strict=True):
        idx.extend(range(min(off + c, rows), min(off + p, rows)))
        off += p
    return torch.tensor(idx, dtype=torch.long)


class HybridEPBufferUpstream:
    """The upstream API: no way to pass the output buffer."""

    zero_padding = True
    """Whether a caller's ``output_token`` gets its padding rows zeroed, as upstream's kernels zero theirs."""

    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        num_sms_dispatch_api: int | None = None,
        num_sms_combine_api: int | None = None,
        num_sms_preprocessing_api: int | None = None,
        num_blocks_permute: int | None = None,
        num_blocks_unpermute: int | None = None,
        load_cached_kernels: bool = False,
        use_shared_buffer: bool = True,
        enable_custom_allgather: bool = False,
        num_of_hybrid_ep_ranks_per_nvlink_domain: int | None = None,
        use_mnnvl: bool | None = None,
    ):
        size = 1 if group is None else group.size()
        if size != 1:
            raise ValueError(f"the fake HybridEPBuffer runs at world size 1 only (group size {size})")
        self.group, self.hidden_dim, self.num_local_experts = group, hidden_dim, num_local_experts
        self.calls: list[str] = []
        """``dispatch`` / ``combine`` per call, with ``+output_token`` when a caller buffer came in."""
        self.received: list[tuple[str, dict]] = []
        """Every call's keyword arguments by method name (the constructor's as ``__init__``)."""
        self.output_tokens: list[torch.Tensor] = []
        """Every ``output_token`` received (tests compare ``data_ptr`` with the ring's slots)."""
        init_args = dict(locals())
        for k in ("self", "group", "size", "__class__"):
            init_args.pop(k, None)
        self.received.append(("__init__", init_args))

    def dispatch_with_permute(
        self,
        *,
        hidden: torch.Tensor,
        topk_idx: torch.Tensor = None,
        topk_weights: torch.Tensor = None,
        num_of_experts_per_rank: int | None = None,
        num_of_experts: int | None = None,
        use_fp8: bool | None = None,
        routing_map: torch.Tensor = None,
        probs: torch.Tensor = None,
        scaling_factor: torch.Tensor = None,
        num_permuted_tokens: int | None = None,
        pad_multiple: int | None = None,
        handle: tuple | None = None,
        non_blocking: bool = False,
        fuse_permute_dispatch: bool = False,
        num_dispatched_tokens: int | None = None,
        use_host_meta: bool | None = None,
    ):
        args = dict(locals())
        del args["self"]
        self.calls.append("dispatch")
        self.received.append(("dispatch_with_permute", args))
        return self._dispatch(None, **args)

    def combine_with_unpermute(
        self,
        *,
        hidden: torch.Tensor,
        probs: torch.Tensor = None,
        handle: tuple | None = None,
        pad_multiple: int | None = None,
        fuse_unpermute_combine: bool = False,
        num_dispatched_tokens: int | None = None,
    ):
        args = dict(locals())
        del args["self"]
        self.calls.append("combine")
        self.received.append(("combine_with_unpermute", args))
        if num_dispatched_tokens is not None:
            warnings.warn("The num_dispatched_tokens is deprecated, it will be removed in the future.", stacklevel=2)
        assert handle is not None, "The handle is necessary in the combine pass."
        assert len(handle) == HANDLE_FIELDS, f"a HybridEP handle has {HANDLE_FIELDS} fields, got {len(handle)}"
        mapping, num_tokens = handle[0], handle[8]
        out = hidden.new_zeros((num_tokens, hidden.shape[1]))
        p = None if probs is None else probs.new_zeros(mapping.shape)
        for e in range(mapping.shape[1]):
            tok = (mapping[:, e] >= 0).nonzero().flatten()
            rows = mapping[tok, e]
            out.index_add_(0, tok, hidden[rows])
            if p is not None:
                p[tok, e] = probs[rows]
        return out, p

    def _dispatch(self, output_token, *, hidden, routing_map, probs, num_permuted_tokens, pad_multiple, handle,
                  non_blocking, fuse_permute_dispatch, num_of_experts_per_rank, topk_idx, num_dispatched_tokens,
                  use_host_meta, **_unused):  # fmt: skip
        if num_dispatched_tokens is not None:
            warnings.warn("The num_dispatched_tokens is deprecated, it will be removed in the future.", stacklevel=3)
        if use_host_meta is not None:
            warnings.warn("The use_host_meta is deprecated, it will be removed in the future.", stacklevel=3)
            non_blocking = not use_host_meta
        if topk_idx is not None:
            raise NotImplementedError("the fake takes routing_map, not topk_idx (megatron-core passes routing_map)")
        if non_blocking:
            assert num_permuted_tokens is not None and num_permuted_tokens >= 0, (
                "The num_permuted_tokens is required for non-blocking mode."
            )
            if pad_multiple:
                assert num_permuted_tokens % pad_multiple == 0, "num_permuted_tokens must be a multiple of pad_multiple"
        num_tokens = hidden.shape[0]
        if handle is None:
            assert routing_map is not None and routing_map.dtype == torch.bool
            assert num_tokens == routing_map.size(0), "The hidden and the routing_map should have the same row number."
            mapping, counts, padded, rows, overflow = _sparse_to_dense(routing_map, pad_multiple, num_permuted_tokens)
            config = TemplateConfig(
                hidden_dim=hidden.shape[1],
                num_of_experts_per_rank=num_of_experts_per_rank or routing_map.shape[1],
                pad_multiple=pad_multiple or 0,
                fuse_permute_dispatch=fuse_permute_dispatch,
            )
            handle = (
                mapping,
                routing_map.any(1),  # rdma_to_attn_map (one node)
                routing_map.any(1, keepdim=True),  # attn_to_rdma_map
                torch.tensor(rows),  # num_dispatched_tokens_tensor
                routing_map,  # local_expert_routing_map (EP = 1: every expert is local)
                padded.cumsum(0) - padded,  # dense_chunk_layout: first row of each expert
                torch.repeat_interleave(torch.arange(padded.numel()), padded),  # dense_to_expert_map
                counts,  # tokens_per_expert
                num_tokens,  # num_of_tokens_per_rank
                config,
                torch.tensor(int(overflow)),  # overflow_flag
            )
        else:
            assert len(handle) == HANDLE_FIELDS, f"a HybridEP handle has {HANDLE_FIELDS} fields, got {len(handle)}"
            if handle[8] != num_tokens:
                warnings.warn("This handle could be invalid.", stacklevel=3)
            mapping, padded = handle[0], torch.bincount(handle[6], minlength=handle[7].numel())
            rows = int(padded.sum()) if num_permuted_tokens is None else int(num_permuted_tokens)
        # Like the kernels: the dispatched rows, then each expert's padding rows zeroed; a caller's output_token
        # keeps what it held past the padded splits (stale data in a reused slot).
        out = hidden.new_zeros((rows, hidden.shape[1])) if output_token is None else output_token
        p = None if probs is None else probs.new_zeros(rows)
        for e in range(mapping.shape[1]):
            tok = (mapping[:, e] >= 0).nonzero().flatten()
            out[mapping[tok, e]] = hidden[tok]
            if p is not None:
                p[mapping[tok, e]] = probs[tok, e]
        if output_token is not None and self.zero_padding:
            out[_padding_rows(handle[7], padded, rows)] = 0
        return out, p, None, padded, handle


class HybridEPBuffer(HybridEPBufferUpstream):
    """The seed's API: upstream plus ``output_token`` (the caller-owned output)."""

    def dispatch_with_permute(
        self,
        *,
        hidden: torch.Tensor,
        topk_idx: torch.Tensor = None,
        topk_weights: torch.Tensor = None,
        num_of_experts_per_rank: int | None = None,
        num_of_experts: int | None = None,
        use_fp8: bool | None = None,
        routing_map: torch.Tensor = None,
        probs: torch.Tensor = None,
        scaling_factor: torch.Tensor = None,
        num_permuted_tokens: int | None = None,
        pad_multiple: int | None = None,
        handle: tuple | None = None,
        non_blocking: bool = False,
        fuse_permute_dispatch: bool = False,
        num_dispatched_tokens: int | None = None,
        use_host_meta: bool | None = None,
        output_token: torch.Tensor = None,
    ):
        args = dict(locals())
        del args["self"], args["output_token"]
        self.calls.append("dispatch" if output_token is None else "dispatch+output_token")
        self.received.append(("dispatch_with_permute", dict(args, output_token=output_token)))
        if output_token is not None:
            self.output_tokens.append(output_token)
        return self._dispatch(output_token, **args)


class HybridEPBufferSkippingPadding(HybridEPBuffer):
    """Breaks the ``output_token`` contract: writes the dispatched rows only, padding rows keep the slot's data."""

    zero_padding = False


class HybridEPBufferIgnoringOutput(HybridEPBuffer):
    """Accepts ``output_token`` but allocates anyway (what the adapter must catch)."""

    def dispatch_with_permute(self, *, output_token=None, **kwargs):  # type: ignore[override]
        return super().dispatch_with_permute(output_token=None, **kwargs)
