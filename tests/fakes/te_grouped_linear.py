"""Fake Transformer Engine grouped linear: the module ``out=`` route and the op-fuser output buffer.

Names follow megatron-core 0.19.2 (``megatron/core/transformer/moe/experts.py`` imports
``OUTPUT_BUFFER_KEY`` from ``transformer_engine.pytorch.ops.basic.grouped_linear`` and passes
``op_kwargs={-1: {OUTPUT_BUFFER_KEY: output_buffer}}`` to the fused ops;
``extensions/transformer_engine.py`` calls ``GroupedLinear.forward(x, m_splits,
is_first_microbatch=...)``). ``out=`` on the module is TE PR #3161 (see docs/megatron.md). The
buffer rules are TE's: exact shape, contiguous, ``requires_grad=False``.
"""

from __future__ import annotations

import types
from collections import deque

import torch

UPSTREAM_MODULE_FORWARD = "(self, inp, m_splits, is_first_microbatch=None)"
TE_2_20_MODULE_FORWARD = "(self, inp, m_splits, is_first_microbatch=None, out=None, dgrad_out=None)"
"""``transformer_engine.pytorch.GroupedLinear.forward`` in TE 2.20.2 (annotations dropped)."""
ops_grouped_linear = types.SimpleNamespace(OUTPUT_BUFFER_KEY="output_buffer", GRAD_INPUT_BUFFER_KEY="grad_input_buffer")
ops_without_key = types.SimpleNamespace()


def _check_buffer(buf: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(buf.shape) != shape or not buf.is_contiguous() or buf.requires_grad:
        raise ValueError(f"bad output buffer: shape {tuple(buf.shape)} vs {shape}, requires_grad={buf.requires_grad}")


def _grouped(inp, m_splits, weights, out):
    y = out if out is not None else inp.new_empty((inp.shape[0], weights[0].shape[0]))
    with torch.no_grad():
        torch.cat([x @ w.t() for x, w in zip(torch.split(inp, list(m_splits)), weights, strict=True)], out=y)
    return y


class GroupedLinear(torch.nn.Module):
    """``forward(inp, m_splits, is_first_microbatch=None, out=None)`` (forward only; enough for routing)."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.weights = [torch.randn(out_features, in_features) for _ in range(num_gemms)]

    def forward(self, inp, m_splits, is_first_microbatch=None, out=None, dgrad_out=None):
        if out is not None:
            _check_buffer(out, (inp.shape[0], self.out_features))
        return _grouped(inp, m_splits, self.weights, out)


class GroupedLinearUpstream(GroupedLinear):
    def forward(self, inp, m_splits, is_first_microbatch=None):  # type: ignore[override]
        return _grouped(inp, m_splits, self.weights, None)


class FusedGroupedMLP:
    """The op-fuser sequence [fc1, activation, fc2]; FC2 writes into ``op_kwargs[-1][OUTPUT_BUFFER_KEY]``."""

    def __init__(self, fc1: GroupedLinear, fc2: GroupedLinear) -> None:
        self.fc1, self.fc2 = fc1, fc2

    def __call__(self, x, m_splits, probs, fc2_splits, op_kwargs=None):
        h = torch.relu(_grouped(x, m_splits, self.fc1.weights, None)) * probs.unsqueeze(-1)
        buf = (op_kwargs or {}).get(-1, {}).get(ops_grouped_linear.OUTPUT_BUFFER_KEY)
        if buf is not None:
            _check_buffer(buf, (x.shape[0], self.fc2.out_features))
        return _grouped(h, fc2_splits, self.fc2.weights, buf)


class _QuantizedCopy(torch.autograd.Function):
    """Stand-in for TE's FP8 cast: a new tensor (what autograd saves), never the caller's input."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad


class _IntoBuffer(torch.autograd.Function):
    """The FC2 result lands in the caller's ``OUTPUT_BUFFER_KEY`` tensor, which becomes the op output."""

    @staticmethod
    def forward(ctx, y, buf):  # type: ignore[override]
        buf.copy_(y)
        return buf

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class MegatronGroupedLinear(torch.nn.Module):
    """Trainable grouped linear built the way ``TEGroupedMLP`` calls its ``linear_fc1`` / ``linear_fc2`` builders."""

    def __init__(self, num_gemms, in_features, out_features, *, config, init_method, bias, skip_bias_add,
                 is_expert, tp_comm_buffer_name, pg_collection, name=None):  # fmt: skip
        super().__init__()
        self.out_features, self.use_bias = out_features, bool(bias)
        g = torch.Generator().manual_seed(in_features * 31 + out_features)
        self.weight = torch.nn.Parameter(torch.randn(num_gemms, out_features, in_features, generator=g) / in_features)

    def grouped(self, x, m_splits):
        """Rows past ``sum(m_splits)`` (the unused part of a static-bound input) come out zero."""
        splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        used = sum(splits)
        parts = [p @ w.t() for p, w in zip(torch.split(x[:used], splits), self.weight, strict=True)]
        parts.append(x.new_zeros((x.shape[0] - used, self.out_features)))
        return torch.cat(parts, dim=0)


class TrainableFusedGroupedMLP:
    """Op-fuser stand-in for [fc1, scaled activation, fc2] with autograd, as ``TEGroupedMLP._fused_forward`` calls it.

    The input goes through a quantized copy first (FP8 expert GEMMs save that, not the dispatch
    output); the FC2 output is written into ``op_kwargs[-1][OUTPUT_BUFFER_KEY]`` when given.
    """

    def __init__(self, fc1: MegatronGroupedLinear, fc2: MegatronGroupedLinear) -> None:
        self.fc1, self.fc2 = fc1, fc2
        self.received_buffers: list[torch.Tensor | None] = []

    def __call__(self, x, m_splits, probs, fc2_splits, op_kwargs=None):
        buf = (op_kwargs or {}).get(-1, {}).get(ops_grouped_linear.OUTPUT_BUFFER_KEY)
        self.received_buffers.append(buf)
        h = torch.relu(self.fc1.grouped(_QuantizedCopy.apply(x), m_splits)) * probs.unsqueeze(-1)
        y = self.fc2.grouped(_QuantizedCopy.apply(h), fc2_splits)
        if buf is None:
            return y
        _check_buffer(buf, tuple(y.shape))
        return _IntoBuffer.apply(y, buf)


class _GroupedLinearFn(torch.autograd.Function):
    """TE's ``_GroupedLinear`` in miniature: writes into ``out`` when given; saves the input, or its
    quantized copy (FP8), through ``ctx.save_for_backward`` as TE does."""

    @staticmethod
    def forward(ctx, inp, weight, splits, out, quantized, store=None):  # type: ignore[override]
        rows = sum(splits)
        if out is not None:
            _check_buffer(out, (rows, weight.shape[1]))
        y = out if out is not None else inp.new_empty((rows, weight.shape[1]))
        with torch.no_grad():
            torch.cat([x @ w.t() for x, w in zip(torch.split(inp, splits), weight, strict=True)], out=y)
        ctx.save_for_backward(inp.clone() if quantized else inp, weight)
        ctx.splits = splits
        ctx.store = store
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        inp, weight = ctx.saved_tensors
        xs, gs = torch.split(inp, ctx.splits), torch.split(grad, ctx.splits)
        dx = torch.cat([g @ w for g, w in zip(gs, weight, strict=True)])
        if ctx.store is not None:  # TE's delayed wgrad: the saved input goes on into the store (a FIFO)
            ctx.store.append((inp, grad, ctx.splits))
            return dx, None, None, None, None, None
        dw = torch.stack([g.t() @ x for g, x in zip(gs, xs, strict=True)])
        return dx, dw, None, None, None, None


class TEGroupedLinearBase(torch.nn.Module):
    """Trainable stand-in for ``transformer_engine.pytorch.GroupedLinear`` (2.20.2 forward signature).

    ``quantized`` (class attribute): save a copy of the input like an FP8 GEMM saves its quantized
    input, instead of the input itself (bf16).
    """

    quantized = False

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, delay_wgrad: bool = False) -> None:
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        g = torch.Generator().manual_seed(in_features * 31 + out_features)
        self.weight = torch.nn.Parameter(torch.randn(num_gemms, out_features, in_features, generator=g) / in_features)
        self.received_out: list[torch.Tensor | None] = []
        self.wgrad_store: deque | None = deque() if delay_wgrad else None

    def need_backward_dw(self) -> bool:
        """TE's ``need_backward_dw``: a wgrad store with delay on."""
        return self.wgrad_store is not None

    def backward_dw(self) -> None:
        """TE's ``backward_dw``: pop the oldest stored (input, grad) and accumulate the weight gradient.

        It reads the stored input, i.e. whatever storage FC1 saved (a ring slot, bf16): if that slot
        was overwritten since, the weight gradient differs from the control.
        """
        if not self.need_backward_dw():
            return
        inp, grad, splits = self.wgrad_store.popleft()
        xs, gs = torch.split(inp, splits), torch.split(grad, splits)
        dw = torch.stack([g.t() @ x for g, x in zip(gs, xs, strict=True)])
        self.weight.grad = dw if self.weight.grad is None else self.weight.grad + dw

    def forward(self, inp, m_splits, is_first_microbatch=None, out=None, dgrad_out=None):
        if dgrad_out is not None:
            raise NotImplementedError("the fake takes no dgrad_out")
        self.received_out.append(out)
        splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        return _GroupedLinearFn.apply(inp, self.weight, splits, out, self.quantized, self.wgrad_store)


class MegatronTEGroupedLinear(TEGroupedLinearBase):
    """megatron's ``TEGroupedLinear``: ``forward(x, m_splits)`` calls ``super().forward(..., is_first_microbatch=)``."""

    def __init__(self, num_gemms, in_features, out_features, *, config, init_method, bias, skip_bias_add,
                 is_expert, tp_comm_buffer_name, pg_collection, name=None):  # fmt: skip
        overlap = getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False)
        delay = bool(config.delay_wgrad_compute or overlap)
        super().__init__(num_gemms, in_features, out_features, delay_wgrad=delay)
        self.use_bias = bool(bias)
        self.is_first_microbatch = True

    def forward(self, x, m_splits):  # type: ignore[override]
        out = super().forward(x, m_splits, is_first_microbatch=self.is_first_microbatch)
        self.is_first_microbatch = False
        return out, None
