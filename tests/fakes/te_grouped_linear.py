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

import torch

UPSTREAM_MODULE_FORWARD = "(self, inp, m_splits, is_first_microbatch=None)"
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

    def forward(self, inp, m_splits, is_first_microbatch=None, out=None):
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
