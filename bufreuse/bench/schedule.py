"""The MoE-layer proxy's tensors and its overlapped microbatch schedule (one step).

Stream pattern (the seed's): the dispatch output is written on the communication stream and last
read by the experts on the compute stream; the expert FC2 output is written on the compute stream
and last read by combine on the communication stream. Both go through a ``BufferPool`` under the
names ``"dispatch_output"`` and ``"expert_fc2_output"``, so control (``record-stream``),
``stream-ordered`` and ``ring`` are the pool's policies, not code here.

Issue order per step, for microbatches ``0..M-1`` (``D`` dispatch, ``E`` experts, ``C`` combine,
``A`` independent attention-like GEMMs)::

    comm:    D0 D1 C0 D2 C1 D3 C2 ...      (the next dispatch is issued before this combine)
    compute: A0 E0 A1 E1 A2 E2 ...          (E_i waits on D_i, C_i waits on E_i)

so one microbatch's communication overlaps another's compute, as combined-1F1B does. A policy
that makes one stream wait on the other (stream-ordered free) shows its cost here.

Allocation sites are named for the snapshot categories of ``bufreuse.analysis``: the dispatch
output is acquired only inside :func:`dispatch`, the FC2 output only inside
:func:`expert_fc2_output`; every other allocation happens in frames whose names match neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DISPATCH",
    "EXPERT",
    "MoEProxy",
    "ProxyStreams",
    "attention",
    "calibrate_sleep",
    "combine",
    "dispatch",
    "expert_fc2_output",
    "experts",
]

DISPATCH = "dispatch_output"
EXPERT = "expert_fc2_output"


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _mark(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


def calibrate_sleep(stream: torch.cuda.Stream, *, cycles: int = 20_000_000) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured with CUDA events (~20 ms)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles // 10)  # wake the clock up before measuring
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        torch.cuda._sleep(cycles)
        end.record(stream)
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-6)


@dataclass(kw_only=True, slots=True)
class ProxyStreams:
    """The proxy's two streams. Pass one instance to every :class:`MoEProxy` of a process that
    measures several configurations: cuBLAS keeps a workspace per stream, so new streams per
    measurement grow max allocated (measured: docs/benchmarks.md)."""

    comm: torch.cuda.Stream | None
    """Dispatch and combine run here (None on CPU: everything is in program order)."""
    compute: torch.cuda.Stream | None
    """Experts and attention-like GEMMs run here; CUDA graphs capture on it."""


def dispatch(proxy: MoEProxy, mb: int) -> torch.Tensor:
    """Write microbatch ``mb``'s permuted tokens into a dispatch output taken from the pool (comm stream)."""
    s = proxy.streams.comm
    out = proxy.pool.acquire(DISPATCH, proxy.dispatch_shape, stream=s)
    if proxy.group is not None:
        torch.index_select(proxy.x, 0, proxy.perms[mb], out=proxy.send)
        torch.distributed.all_to_all_single(out, proxy.send, group=proxy.group)
    else:
        if proxy.sleep_cycles:
            torch.cuda._sleep(proxy.sleep_cycles)
        torch.index_select(proxy.x, 0, proxy.perms[mb], out=out)
    return out


def expert_fc2_output(proxy: MoEProxy) -> torch.Tensor:
    """Take the expert FC2 output from the pool (compute stream): the only allocation in this frame."""
    return proxy.pool.acquire(EXPERT, proxy.dispatch_shape, stream=proxy.streams.compute)


def experts(proxy: MoEProxy, tokens: torch.Tensor) -> torch.Tensor:
    """Per-expert FC1 → SiLU → FC2, FC2 written with ``out=`` straight into the pooled output."""
    out = expert_fc2_output(proxy)
    rows = proxy.rows_per_expert
    for e in range(proxy.num_experts):
        chunk = slice(e * rows, (e + 1) * rows)
        h = torch.nn.functional.silu(torch.mm(tokens[chunk], proxy.w1[e]))
        torch.mm(h, proxy.w2[e], out=out[chunk])
    return out


def combine(proxy: MoEProxy, expert_out: torch.Tensor, mb: int) -> None:
    """Un-permute the expert output and add each token's top-k copies into the step output (comm stream)."""
    src = expert_out
    if proxy.group is not None:
        torch.distributed.all_to_all_single(proxy.recv, expert_out, group=proxy.group)
        src = proxy.recv
    elif proxy.sleep_cycles:
        torch.cuda._sleep(proxy.sleep_cycles)
    for k in range(proxy.topk):
        torch.index_select(src, 0, proxy.inv_perms[mb][k], out=proxy.scratch)
        proxy.acc.add_(proxy.scratch)


def attention(proxy: MoEProxy) -> None:
    """Independent attention-like GEMMs on the compute stream (ping-pong persistent outputs)."""
    a = proxy.x
    for j, w in enumerate(proxy.wa):
        dst = proxy.att[j % 2]
        torch.mm(a, w, out=dst)
        a = dst


class MoEProxy:
    """One MoE layer's worth of persistent tensors plus :meth:`step`, the overlapped schedule.

    Persistent memory (allocated once): input ``x`` [tokens/topk, hidden], weights, two attention
    outputs, the step output ``acc`` and one combine scratch; it is the same in every mode. What
    differs between modes is only how the two pooled buffers are provided and freed.
    """

    @staticmethod
    def new_streams(device: torch.device) -> ProxyStreams:
        """Two fresh streams on a CUDA ``device``; none on CPU (everything in program order)."""
        cuda = device.type == "cuda"
        return ProxyStreams(
            comm=torch.cuda.Stream(device) if cuda else None, compute=torch.cuda.Stream(device) if cuda else None
        )

    def __init__(
        self, cfg: Any, pool: Any, device: torch.device, *, group: Any = None, streams: ProxyStreams | None = None
    ) -> None:
        dtype = cfg.torch_dtype
        self.cfg, self.pool, self.group, self.device = cfg, pool, group, device
        self.microbatches, self.num_experts, self.topk = cfg.microbatches, cfg.local_experts, cfg.topk
        tokens, hidden, ffn = cfg.tokens, cfg.hidden, cfg.ffn
        self.tokens_in = tokens // cfg.topk
        self.dispatch_shape = (tokens, hidden)
        self.rows_per_expert = tokens // cfg.local_experts
        gen = torch.Generator(device=device).manual_seed(cfg.seed + 1000 * cfg.rank)

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

        self.x = randn(self.tokens_in, hidden)
        self.w1 = randn(cfg.local_experts, hidden, ffn, scale=1 / math.sqrt(hidden))
        self.w2 = randn(cfg.local_experts, ffn, hidden, scale=1 / math.sqrt(ffn))
        self.wa = [randn(hidden, hidden, scale=1 / math.sqrt(hidden)) for _ in range(cfg.attn_gemms)]
        self.att = [torch.empty(self.tokens_in, hidden, dtype=dtype, device=device) for _ in range(2)]
        self.acc = torch.zeros(self.tokens_in, hidden, dtype=dtype, device=device)
        self.scratch = torch.empty(self.tokens_in, hidden, dtype=dtype, device=device)
        self.perms: list[torch.Tensor] = []
        self.inv_perms: list[list[torch.Tensor]] = []
        for _ in range(cfg.microbatches):
            p = torch.randperm(tokens, generator=gen, device=device)
            self.inv_perms.append(list(torch.argsort(p).view(cfg.topk, self.tokens_in).unbind(0)))
            self.perms.append(p % self.tokens_in)
        self.send = self.recv = None
        if group is not None:
            self.send = torch.empty(self.dispatch_shape, dtype=dtype, device=device)
            self.recv = torch.empty(self.dispatch_shape, dtype=dtype, device=device)
        cuda = device.type == "cuda"
        self.streams = streams if streams is not None else self.new_streams(device)
        self.sleep_cycles = 0
        if cuda and cfg.comm_ms > 0 and group is None:
            self.sleep_cycles = int(cfg.comm_ms * calibrate_sleep(self.streams.comm))
        if cuda:
            torch.cuda.synchronize(device)

    def flops_per_step(self) -> float:
        c = self.cfg
        expert = 2 * 2 * c.tokens * c.hidden * c.ffn
        att = 2 * self.tokens_in * c.hidden * c.hidden * c.attn_gemms
        return float(c.microbatches * (expert + att))

    def step(self) -> None:
        """Issue one step (all microbatches) on the two streams; returns before the GPU finishes."""
        comm, compute, pool = self.streams.comm, self.streams.compute, self.pool
        if comm is not None:
            comm.wait_stream(compute)  # fork: under graph capture the comm stream joins here
        with _on(comm):
            self.acc.zero_()
            disp = {0: dispatch(self, 0)}
            ready = {0: _mark(comm)}
        for i in range(self.microbatches):
            if i + 1 < self.microbatches:
                with _on(comm):
                    disp[i + 1] = dispatch(self, i + 1)
                    ready[i + 1] = _mark(comm)
            with _on(compute):
                attention(self)
                _wait(compute, ready.pop(i))
                tokens = disp.pop(i)
                out = experts(self, tokens)
                pool.release(DISPATCH, tokens, stream=compute)
                del tokens
                done = _mark(compute)
            with _on(comm):
                _wait(comm, done)
                combine(self, out, i)
                pool.release(EXPERT, out, stream=comm)
                del out
        if comm is not None:
            compute.wait_stream(comm)  # join: the step ends on the compute stream

    def checksum(self) -> str:
        """SHA-256 (16 hex digits) of the step output and the attention output: equal across modes."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        h = hashlib.sha256()
        for t in (self.acc, self.att[(len(self.wa) - 1) % 2] if self.wa else self.acc):
            h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest()[:16]
