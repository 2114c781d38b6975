"""Test helper: expert parallelism (EP >= 2) with real megatron-core 0.19.2 over gloo, in several processes.

One *world* is ``EP x expert-TP`` processes on 127.0.0.1 (``gloo``; CPU tensors, or CUDA tensors on the one
GPU every rank shares). Each process runs :func:`worker_main`: it sets up megatron's model-parallel state
once and runs every :class:`Case` of the world in order, reusing the process group. A case builds a real
``MoELayer`` (all-to-all dispatcher; ``local`` spec = ``SequentialMLP``, ``te-fake`` = megatron's
``TEGroupedMLP`` over ``tests/fakes/te_grouped_linear.py``, ``te`` = real TE) and drives its stages with a
routing the case chooses (:func:`routing`), over one of the schedule harness's orders
(``schedule_harness.ORDERS``):

- the control (no hooks) twice: it must be deterministic, or bit-equality means nothing; its token splits
  and per-expert counts are checked against the ones derived here from the routing alone;
- then, in production mode and in debug mode (``schedule_harness.mode_env``), a fresh layer from the same
  seeds with ``bufreuse.integrations.megatron.install`` as production calls it (no validation aids):
  outputs, input and router-probability gradients and every parameter gradient bit-equal to the control
  (or, on the GPU where TE is not bitwise reproducible, within the control-against-control spread);
  both rings hooked; each ring's deferred releases equal to the count derived here from the routing and
  to the planner's rule (``Installation.release_check``).

The parent (:func:`run_world`) spawns the processes, waits, and returns each rank's per-case report;
tests assert on them. A rank that raises outside what its case expects writes its report and exits, and the
parent stops the world (a peer would otherwise wait in a collective until the gloo timeout).

Rings: the ``production`` arm passes the knobs production passes, and ``install`` decides by its own rule which
rings are worth hooking; where that rule leaves one unused at EP x ETP > 1, a ``kept`` arm
(``moe_bufreuse_keep_unused_rings``) runs both on the path production takes where it
does use them (no copy added).

Shims (:func:`apply_shims`), each standing in for a megatron-core 0.19.2 line; only
``megatron/core/tensor_parallel/mappings.py`` sees the changed ``torch`` (a proxy module):

- CPU: ``mappings.py``: ``_gather_along_first_dim`` and ``_reduce_scatter_along_first_dim`` allocate their output
  with ``device=torch.cuda.current_device()``, and ``_AllToAll.forward`` its uneven-split output the same way:
  there ``cuda.current_device()`` is the CPU;
- CPU: ``token_dispatcher.py``: ``MoEAlltoAllTokenDispatcher.__init__`` creates ``torch.cuda.Stream()`` (the class
  attribute ``cuda_dtoh_stream`` is pre-set), and ``_maybe_dtoh_and_synchronize`` (dropless) copies the token counts
  to the host on that side stream after ``torch.cuda.current_stream()``, then waits on an event:
  :func:`_cpu_dtoh_and_synchronize` does the same host conversions (splits to numpy) without streams;
- gloo, CPU and GPU (expert TP > 1, dropless): ``mappings.py:_gather_along_first_dim`` with ``output_split_sizes``
  calls ``torch.distributed.all_gather`` with uneven shards and ``_reduce_scatter_along_first_dim`` with
  ``input_split_sizes`` calls ``torch.distributed.reduce_scatter`` with uneven chunks; NCCL takes both, gloo
  neither: :func:`_uneven_all_gather` (padded gather, trimmed) and :func:`_uneven_reduce_scatter` (all-reduce,
  this rank's chunk).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HIDDEN, FFN, SEQ, MBS, MICROBATCHES = 32, 64, 8, 2, 4
TOKENS = SEQ * MBS
"""Tokens per rank per microbatch (what ``install(tokens=...)`` sizes the rings from)."""

ROUTINGS = ("random", "skewed", "empty")
"""``random``: seeded top-k per rank and microbatch. ``skewed``: geometric expert weights (uneven splits) and,
in microbatch ``m``, the last local expert of EP rank ``m % EP`` gets no token from any rank (a local expert
with zero tokens; with one local expert that rank receives nothing). ``empty``: in microbatch ``m`` no token of
any rank goes to EP rank ``(m + 1) % EP``'s experts (that rank receives no tokens at all)."""


@dataclass(frozen=True)
class Case:
    """One configuration run in a world (all of its ranks run it together)."""

    name: str
    experts: int
    """Experts in the layer (``num_moe_experts``), over all EP ranks."""
    order: str = "1f1b"
    spec: str = "local"
    """``local`` (SequentialMLP), ``te-fake`` (TEGroupedMLP over the CPU fake) or ``te`` (real TE, GPU)."""
    policy: str = "ring"
    """``ring`` or ``stream-ordered`` for both buffers (``moe_bufreuse_{dispatch,expert}_policy``)."""
    routing: str = "random"
    dropless: bool = False
    """Dropless (capacity None, no padding), else pad-to-capacity with capacity factor 1.0."""
    topk: int = 2
    dtype: str = "float32"
    fp8: str | None = None
    """``hybrid`` (real TE, delayed scaling; GPU only)."""
    delay_wgrad: bool = False
    """``delay_wgrad_compute`` (megatron wants ``overlap_moe_expert_parallel_comm`` with it: both set; TE's wgrad store
    and ``backward_dw`` run, the overlap flag is only read, see ``overlap``)."""
    overlap: bool = False
    """``overlap_moe_expert_parallel_comm`` set in the config only (bf16; megatron allows it at EP > 1): the harness
    drives the layer's stages itself, not megatron's combined-1F1B schedule, so ``ScheduleNode.free_input`` and the
    comm stream never run (CPU or GPU); what it checks is install's rule under the flag and the rings' releases.
    Cases that set it say ``flag-only`` in their name."""
    slots: int | None = None
    """Ring depth; default: the order's in-flight count (+1 with delayed wgrad)."""
    expect: str = "bit-equal"
    """``bit-equal``; ``early-reuse:<depth>`` (the ring must refuse); ``broken`` (the release rule is broken on
    purpose, :func:`break_release_rule`: the report must show it)."""
    sync_check: bool = False
    """Compare each arm's steady state (a layer's second run) and, on the GPU, count its synchronizing CUDA calls
    (sync debug mode)."""
    streams: bool = False
    """GPU: each microbatch's forward and backward on its own CUDA stream, which never joins another's, with a delay
    (``SLOW_MS``) before the experts read the dispatch slot and before the backward that reads what FC1 saved: the
    next producer of a slot (another microbatch's dispatch, on its own stream) is ordered after the last reader only
    by the ring's GPU wait (``tests/test_ep_gloo_gpu.py``, the producer-wait mutations). CPU: no effect."""

    @property
    def depth(self) -> int:
        from schedule_harness import in_flight

        if self.slots is not None:
            return self.slots
        return in_flight(self.order) + (1 if self.delay_wgrad else 0)


# -- the case tables ------------------------------------------------------------------------------------------


def _topk(experts: int, ep: int) -> int:
    """Top-2 where the ``empty`` routing leaves two experts to choose from, else top-1."""
    return min(2, experts - experts // ep)


def cpu_cases(ep: int, etp: int, *, full: bool = False) -> list[Case]:
    """The cases one CPU world runs.

    Default (CI): every order at one and two local experts (pad-to-capacity, float32), every routing dropless
    at both, the stream-ordered policy on pad, skewed and empty routing, bf16, the EP overlap flag (flag only: no
    combined-1F1B schedule, ``Case.overlap``), and
    (without expert TP, which the CPU fake does not shard) the TE grouped MLP with delayed wgrad. ``full``:
    the cross product order x local experts x routing x policy x dtype on top.
    """
    from schedule_harness import ORDERS

    orders = list(ORDERS)
    out: list[Case] = []

    def add(name: str, local: int, **kw: Any) -> None:
        e = ep * local
        out.append(Case(name=f"l{local}-{name}", experts=e, topk=_topk(e, ep), **kw))

    for order in orders:
        for local in (1, 2):
            add(f"pad-{order}", local, order=order)
    for i, r in enumerate(ROUTINGS):
        for local in (1, 2):
            add(f"dropless-{r}", local, dropless=True, routing=r, order=orders[(i + local) % len(orders)])
    add("stream-ordered-pad", 1, policy="stream-ordered")
    add("stream-ordered-dropless-skewed", 2, policy="stream-ordered", dropless=True, routing="skewed", order="vpp")
    add("stream-ordered-dropless-empty", 1, policy="stream-ordered", dropless=True, routing="empty", order="fwd_bwd")
    add("bf16-dropless-1f1b_dw", 1, dtype="bfloat16", dropless=True, order="1f1b_dw")
    add("bf16-pad-vpp", 2, dtype="bfloat16", order="vpp")
    add("bf16-overlap-flag-only-dropless", 1, dtype="bfloat16", overlap=True, dropless=True, routing="skewed")
    add("steady-state-dropless-empty", 1, dropless=True, routing="empty", sync_check=True)  # the GPU protocol
    if etp == 1:
        add("te-fake-delay_wgrad-pad", 1, spec="te-fake", dtype="bfloat16", delay_wgrad=True, order="1f1b_dw")
        add("te-fake-delay_wgrad-dropless-empty", 1, spec="te-fake", dtype="bfloat16", delay_wgrad=True,
            order="1f1b_dw", dropless=True, routing="empty")  # fmt: skip
        add("te-fake-dropless-random", 2, spec="te-fake", dtype="bfloat16", dropless=True, order="fwd_bwd")
    if full:
        for order in orders:
            for local in (1, 2):
                for r in ("pad", *ROUTINGS):
                    for policy in ("ring", "stream-ordered"):
                        for dtype in ("float32", "bfloat16"):
                            routing_kw = {} if r == "pad" else {"dropless": True, "routing": r}
                            add(f"full-{order}-{r}-{policy}-{dtype}", local, order=order, policy=policy,
                                dtype=dtype, **routing_kw)  # fmt: skip
    return out


def break_cases() -> list[Case]:
    """EP = 2, one local expert (FC1 saves the dispatch slot): the release rule broken at the planned depth and at
    a shallow one, the same shallow depth unbroken (the ring must refuse), and the unbroken twin; dropless with the
    ``empty`` routing (a rank receives nothing in every other microbatch: empty acquisitions, released at the
    forward), broken and unbroken."""
    return [
        Case(name="unbroken-1f1b", experts=2, topk=1),
        Case(name="broken-1f1b", experts=2, topk=1, expect="broken"),
        Case(name="unbroken-dropless-empty-1f1b", experts=2, topk=1, dropless=True, routing="empty"),
        Case(name="broken-dropless-empty-1f1b", experts=2, topk=1, dropless=True, routing="empty", expect="broken"),
        Case(name="broken-shallow-fwd_bwd", experts=2, topk=1, order="fwd_bwd", slots=2, expect="broken"),
        Case(name="unbroken-shallow-fwd_bwd", experts=2, topk=1, order="fwd_bwd", slots=2, expect="early-reuse:3"),
    ]


# -- routing, and what it implies (derived here, independently of megatron) ---------------------------------


def routing(case: Case, ep: int, sender: int, mb: int) -> tuple[Any, Any]:
    """``(routing_map [T, E] bool, probs [T, E] float32)`` of global rank ``sender`` in microbatch ``mb``."""
    import torch

    e, k = case.experts, case.topk
    local = e // ep
    g = torch.Generator().manual_seed(10_000 * (sender + 1) + 97 * mb + ROUTINGS.index(case.routing))
    allowed = torch.ones(e, dtype=torch.bool)
    if case.routing == "skewed":
        allowed[(mb % ep) * local + local - 1] = False
        weights = torch.tensor([2.0 ** -(i % 4) for i in range(e)])
    elif case.routing == "empty":
        empty = (mb + 1) % ep
        allowed[empty * local : (empty + 1) * local] = False
        weights = torch.ones(e)
    else:
        weights = torch.ones(e)
    if int(allowed.sum()) < k:
        raise ValueError(f"case {case.name}: routing {case.routing} leaves {int(allowed.sum())} experts for top-{k}")
    weights = weights * allowed
    picks = torch.multinomial(weights.expand(TOKENS, e), k, replacement=False, generator=g)
    rmap = torch.zeros(TOKENS, e, dtype=torch.bool).scatter(1, picks, True)
    scores = torch.rand(TOKENS, k, generator=g) + 0.1
    probs = torch.zeros(TOKENS, e).scatter(1, picks, scores / scores.sum(-1, keepdim=True))
    return rmap, probs


@dataclass(frozen=True)
class Expected:
    """What one rank's dispatch must look like in one microbatch, from the routing alone (dropless)."""

    input_splits: list[int]
    """Tokens this rank sends to each member of its EP group."""
    output_splits: list[int]
    """Tokens this rank receives from each member of its EP group (the dispatch all-to-all's output rows)."""
    per_local_expert: list[int]
    """Tokens each local expert computes (after the expert-TP all-gather)."""


def expected_dispatch(case: Case, ep: int, ep_group: list[int], tp_ep_group: list[int], me: int, mb: int) -> Expected:
    """Splits and per-expert counts of rank ``me``, summed from every rank's :func:`routing`."""
    local = case.experts // ep
    mine = ep_group.index(me)  # this rank's EP index: its experts are mine*local ...
    maps = {r: routing(case, ep, r, mb)[0] for r in set(ep_group) | set(tp_ep_group)}
    cols = slice(mine * local, (mine + 1) * local)
    return Expected(
        input_splits=[int(maps[me][:, i * local : (i + 1) * local].sum()) for i in range(len(ep_group))],
        output_splits=[int(maps[r][:, cols].sum()) for r in ep_group],
        per_local_expert=[int(sum(maps[r][:, c].sum() for r in tp_ep_group)) for c in range(cols.start, cols.stop)],
    )


def slot_read_directly(case: Case, ep: int, etp: int) -> bool:
    """Whether the experts read the dispatch slot itself (so FC1 saves it for backward): one local expert,
    no expert-TP all-gather, no FP8 copy. Otherwise the local sort or the gather copies it in forward."""
    return case.experts // ep == 1 and etp == 1 and case.fp8 is None


# -- the layer and the schedule ------------------------------------------------------------------------------


def build_layer(case: Case, ep: int, etp: int, device: str):
    """A fresh ``MoELayer`` for ``case`` from fixed seeds (every arm gets identical weights)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    dtype = getattr(torch, case.dtype)
    kw: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=4,
        num_moe_experts=case.experts,
        moe_router_topk=case.topk,
        moe_router_pre_softmax=case.topk == 1,  # megatron refuses top-1 without it
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        use_cpu_initialization=device == "cpu",  # on the GPU: megatron's seeded CUDA init (TE modules need it)
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        moe_expert_capacity_factor=None if case.dropless else 1.0,
        moe_pad_expert_input_to_capacity=not case.dropless,
        moe_grouped_gemm=case.spec == "te",
        overlap_moe_expert_parallel_comm=case.overlap or case.delay_wgrad,
        delay_wgrad_compute=case.delay_wgrad,
    )
    if case.fp8:
        kw.update(fp8=case.fp8, fp8_recipe="delayed")
    cfg = TransformerConfig(**kw)
    if case.spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=case.experts, moe_grouped_gemm=True)
    else:
        spec = get_gpt_layer_local_spec(num_experts=case.experts, moe_grouped_gemm=False)
    layer = spec.submodules.mlp(config=cfg)
    if case.spec == "te-fake":
        from fakes import te_grouped_linear as te
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

        subs = GroupedMLPSubmodules(linear_fc1=te.MegatronTEGroupedLinear, linear_fc2=te.MegatronTEGroupedLinear)
        layer.experts = TEGroupedMLP(
            case.experts // ep, cfg, subs, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        )
        cfg.moe_grouped_gemm = True
    layer = layer.to(dtype)
    return layer.cuda() if device == "cuda" else layer


def inputs(case: Case, rank: int, device: str) -> list:
    """This rank's microbatches [seq, batch, hidden] (seeded by rank)."""
    import torch

    dtype = getattr(torch, case.dtype)
    gens = [torch.Generator().manual_seed(1_000 * (rank + 1) + i) for i in range(MICROBATCHES)]
    return [torch.randn(SEQ, MBS, HIDDEN, generator=g).to(device=device, dtype=dtype) for g in gens]


def _fp8_context(layer):
    import contextlib

    if not layer.config.fp8:
        return contextlib.nullcontext()
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(layer.config)


SLOW_MS = 50
"""``Case.streams``: the delay before each slow reader (far above a gloo all-to-all's host round trip)."""
_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep spins in clock cycles; H100 and H200 run near 2 GHz


def _slow() -> None:
    """A ``SLOW_MS`` delay on the current CUDA stream (``Case.streams``)."""
    import torch

    torch.cuda._sleep(SLOW_MS * _CYCLES_PER_MS)


def forward(layer, x, rmap, probs, slow: bool = False):
    """The layer's stages in ``MoELayer.forward``'s order with the given routing (the router is bypassed so that
    routing is known exactly; megatron's own ``forward`` calls these same stages). ``slow``: delay the experts'
    read of the dispatch output (``Case.streams``)."""
    with _fp8_context(layer):
        h, p = layer.preprocess(x, probs, rmap)
        d, p = layer.dispatch(h, p)
        if slow:
            _slow()
        out, _ = layer.routed_experts_compute(d, p)
        return layer.postprocess(layer.combine(out), None)


def run_order(
    layer, case: Case, xs: list, routes: list, gouts: list, seen: list | None = None
) -> tuple[list, list, dict]:
    """Run ``case.order`` over the microbatches: outputs, input and probs gradients, parameter gradients.

    ``xs``, ``routes`` (routing map, probs) and ``gouts`` (the output gradients) live on the run's device already,
    so a run copies nothing from the host. ``seen`` (control): gets ``(input_splits, output_splits, tokens per
    local expert, dispatch rows)`` per forward.
    """
    import torch
    from schedule_harness import ORDERS

    layer.zero_grad(set_to_none=True)
    device = xs[0].device
    leaves = [x.clone().requires_grad_(True) for x in xs]
    probs = [p.detach().clone().requires_grad_(True) for _, p in routes]
    outs: dict[int, Any] = {}
    hook = None
    if seen is not None:
        disp = layer.token_dispatcher
        rows: list[int] = []
        orig = disp.token_dispatch

        def record_dispatch(tokens, p):
            out = orig(tokens, p)
            rows.append(int(out[0].shape[0]))
            return out

        disp.token_dispatch = record_dispatch

        def record(module, args):
            splits = [None if s is None else [int(v) for v in s] for s in (disp.input_splits, disp.output_splits)]
            seen.append((*splits, [int(v) for v in args[1]], rows[-1]))

        hook = layer.experts.register_forward_pre_hook(record)
    streams = None
    if case.streams and device.type == "cuda":  # one stream per microbatch, each after the inputs, never joined
        streams = [torch.cuda.Stream(device) for _ in xs]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream(device))
    try:
        for step in ORDERS[case.order]:
            i = int(step[1:])
            with torch.cuda.stream(streams[i]) if streams else contextlib.nullcontext():
                if step[0] == "F":
                    outs[i] = forward(layer, leaves[i], routes[i][0], probs[i], slow=streams is not None)
                elif step[0] == "W":
                    layer.backward_dw()  # delayed weight gradients of microbatch i (FIFO)
                else:
                    if streams:
                        _slow()  # the backward (on this stream: autograd runs it where the forward ran) starts late
                    outs[i].backward(gouts[i])
    finally:
        if hook is not None:
            hook.remove()
            del layer.token_dispatcher.token_dispatch
    if device.type == "cuda":
        torch.cuda.synchronize()
    params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    grads = [x.grad for x in leaves] + [p.grad for p in probs]
    return [outs[i].detach() for i in sorted(outs)], grads, params


def knobs_for(case: Case):
    """Both buffers on, the case's policy, no validation aids (what production passes)."""
    from bufreuse.config import BufReuseConfig

    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=case.depth,
        moe_hybridep_num_expert_output_buffers=case.depth,
        moe_bufreuse_dispatch_policy=case.policy,
        moe_bufreuse_expert_policy=case.policy,
    )


RINGS = ("dispatch_output", "expert_fc2_output")


def hooked_sites(layer) -> list[str]:
    """Which of the layer's entry points carry an instance override (what ``install`` put there)."""
    disp, experts = layer.token_dispatcher, layer.experts
    stages = ("token_dispatch", "combine_preprocess", "token_combine")
    sites = [f"token_dispatcher.{a}" for a in stages if a in vars(disp)]
    sites += [f"layer.{a}" for a in ("routed_experts_compute",) if a in vars(layer)]
    sites += ["experts.forward"] if "forward" in vars(experts) else []
    fc2 = getattr(experts, "linear_fc2", None)
    if fc2 is not None:
        sites.append(f"experts.linear_fc2: {type(fc2).__name__}")
    return sites


# -- the release rule broken on purpose (the harness must go red) ------------------------------------------


class _Blind:
    """A saved-tensor region that sees nothing: what the pool's ``track_saved()`` returns when broken."""

    regions = 0
    strict = False

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def run(self, fn, args, kwargs):
        return fn(*args, **kwargs)


def break_release_rule(pool) -> None:
    """Make ``pool``'s production regions blind (before ``install``): the hooks then count no saved reference to
    the dispatch slot, so it is released at its last forward reader (the end of the experts stage, before the
    combine) although FC1 saved it for backward; the next acquisition may overwrite what a backward still reads.
    Debug mode's autograd guard (a separate strict tracker) still counts, so the break shows in production."""
    pool.track_saved = lambda **kw: _Blind()


# -- one case, on one rank -----------------------------------------------------------------------------------


@dataclass
class World:
    """What :func:`run_case` needs of the running world."""

    ep: int
    etp: int
    rank: int
    device: str
    ep_group: list[int]
    tp_ep_group: list[int]


def _sync_count(fn, count: bool = True):
    """``fn()`` under ``torch.cuda.set_sync_debug_mode('warn')``: its result and the synchronizing calls it made
    (``count`` False, on CPU: only ``fn()``, so the CPU twin runs the same steady-state protocol)."""
    import warnings

    import torch

    if not count:
        return fn(), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchronizing" in str(w.message)]
    return result, syncs


def spread(a: tuple, b: tuple) -> dict[str, float]:
    """Max abs difference per kind (outputs, grads, params) between two runs' results."""
    from schedule_harness import max_abs_diff

    out = {"output": 0.0, "grad": 0.0, "param": 0.0}
    for kind, x, y in (("output", a[0], b[0]), ("grad", a[1], b[1])):
        for t, u in zip(x, y, strict=True):
            out[kind] = max(out[kind], max_abs_diff(t, u) if u is not None else float("inf"))
    for n in a[2]:
        out["param"] = max(out["param"], max_abs_diff(a[2][n], b[2][n]) if n in b[2] else float("inf"))
    return out


def _within(case: str, mode: str, ref: tuple, got: tuple, bound: dict[str, float]) -> list[str]:
    d = spread(ref, got)
    return [f"[{case}/{mode}] {k}: max abs diff {d[k]:.3e} beyond the control's spread {bound[k]:.3e}"
            for k in d if d[k] > bound[k]]  # fmt: skip


def run_case(case: Case, w: World, result: dict) -> None:
    """Control twice, then rings in production and in debug mode; every problem found, named, into ``result``
    (``problems``, ``info``: filled as the case goes, so a case that raises keeps what it found)."""
    import torch
    from schedule_harness import MODES, compare, guard, mode_env

    from bufreuse.integrations.megatron import install
    from bufreuse.plan.rules import ReleasePoint
    from bufreuse.pool import BufferPool, EarlyReuseError

    problems: list[str] = result["problems"]
    info: dict[str, Any] = result["info"]
    info["rank"], info["device"] = w.rank, w.device
    xs = inputs(case, w.rank, w.device)
    routes = [tuple(t.to(w.device) for t in routing(case, w.ep, w.rank, mb)) for mb in range(MICROBATCHES)]
    gouts = [torch.randn(x.shape, generator=torch.Generator().manual_seed(2_000 + i)).to(x) for i, x in enumerate(xs)]
    seen: list = []
    sync, count = case.sync_check, w.device == "cuda"

    def run(layer, record: list | None = None):
        return run_order(layer, case, xs, routes, gouts, record)

    def fresh():
        return build_layer(case, w.ep, w.etp, w.device)

    if sync:
        # steady state: the counted run is each layer's second (first calls set up lazy state); FP8 scaling
        # state carries over, so second runs are compared with second runs
        a, b = fresh(), fresh()
        first, first_b = run(a, seen), run(b)
        ref, info["control_syncs"] = _sync_count(lambda: run(a), count)
        ref2 = run(b)
        det = compare(f"{case.name} (control vs control, first runs)", "control", first, first_b)
    else:
        ref, ref2 = run(fresh(), seen), run(fresh())
        det = []
    # megatron's splits and per-expert counts against the ones derived from the routing alone
    order_f = [int(s[1:]) for s in _orders()[case.order] if s[0] == "F"]
    rows = []
    for mb, (ins, outs, per_expert, got_rows) in zip(order_f, seen, strict=True):
        rows.append(got_rows)
        if case.dropless:
            want = expected_dispatch(case, w.ep, w.ep_group, w.tp_ep_group, w.rank, mb)
            got = (ins, outs, per_expert, got_rows)
            exp = (want.input_splits, want.output_splits, want.per_local_expert, sum(want.output_splits))
            if got != exp:
                problems.append(f"[{case.name}] microbatch {mb}: megatron's (input splits, output splits, tokens per "
                                f"local expert, dispatch rows) {got} != derived {exp}")  # fmt: skip
        elif ins is not None or outs is not None:
            problems.append(f"[{case.name}] pad-to-capacity with splits {ins} {outs} (megatron sends equal capacity)")
    info["dispatch_rows"] = rows
    info["tokens_per_local_expert"] = [s[2] for s in seen]
    det += compare(f"{case.name} (control vs control)", "control", ref, ref2)
    exact = case.spec != "te"  # real TE (bf16 atomics, FP8) need not be bitwise reproducible
    if det and exact:
        problems += ["the control is not deterministic:", *det]
    bound = spread(ref, ref2)
    info["control_spread"] = bound
    direct = slot_read_directly(case, w.ep, w.etp)
    want_deferred = {"dispatch_output": sum(1 for r in rows if r > 0) if direct else 0, "expert_fc2_output": 0}
    if direct and case.spec in ("te-fake", "te") and case.delay_wgrad:  # TE's FC1 keeps its input for backward_dw
        want_point = ReleasePoint.WGRAD
    else:
        want_point = ReleasePoint.BACKWARD if direct else ReleasePoint.FORWARD
    info["arms"] = {}
    for arm, knobs in arms(case, w):
        info["arms"][arm] = {}
        for mode in MODES:
            report: dict[str, Any] = {}
            info["arms"][arm][mode] = report
            tag = f"[{case.name}/{arm}/{mode}]"
            layer = build_layer(case, w.ep, w.etp, w.device)
            with mode_env(mode):
                pool = BufferPool(w.device)
                if pool.debug is not (mode == "debug"):
                    problems.append(f"{tag} pool.debug is {pool.debug}")
                if case.expect == "broken":
                    break_release_rule(pool)
                inst = install(layer, pool, knobs, tokens=TOKENS)
                try:
                    hooked = _rings_arm(case, w, inst, layer, report, tag, problems)
                    if hooked is None:
                        continue
                    try:
                        with guard(pool, mode):
                            if sync:
                                run(layer)  # warm-up (first acquisitions, lazy state)
                                got, report["syncs"] = _sync_count(lambda lay=layer: run(lay), count)
                            else:
                                got = run(layer)
                    except EarlyReuseError as e:  # symmetric: every rank's ring is in the same state
                        report["early_reuse"] = str(e)
                        pool.reset()
                        depth = case.expect.split(":", 1)[1] if case.expect.startswith("early-reuse:") else None
                        if depth is None or f"to at least {depth}" not in str(e):
                            problems.append(f"{tag} EarlyReuseError: {e}")
                        continue
                    if case.expect.startswith("early-reuse:") and hooked:
                        problems.append(f"{tag} expected EarlyReuseError, the run completed")
                    diffs = compare(tag, "", ref, got) if exact else _within(tag, "", ref, got, bound)
                    report["bit_equal"] = not compare(tag, "", ref, got)
                    report["compared"] = {"outputs": len(got[0]), "grads": len(got[1]), "param_grads": len(got[2])}
                    report["spread_vs_control"] = spread(ref, got)
                    problems += diffs
                    runs = 2 if sync else 1
                    stats = pool.stats()
                    report["stats"] = {n: dataclasses.asdict(s) for n, s in stats.items()}
                    for name in hooked:
                        s = stats[name]
                        if s.acquisitions != s.releases or s.acquisitions != runs * MICROBATCHES:
                            problems.append(f"{tag} {name}: {s.acquisitions} acquisitions, {s.releases} releases, "
                                            f"expected {runs * MICROBATCHES} each")  # fmt: skip
                        if case.policy == "ring" and s.deferred_releases != runs * want_deferred[name]:
                            problems.append(f"{tag} {name}: {s.deferred_releases} deferred releases, derived from "
                                            f"the routing: {runs * want_deferred[name]}")  # fmt: skip
                        if case.policy == "ring" and s.peak_held > case.depth:
                            problems.append(f"{tag} {name}: peak held {s.peak_held} > depth {case.depth}")
                    rule = inst.expected_release.get("dispatch_output")
                    if "dispatch_output" in hooked and (rule is None or rule.point is not want_point):
                        problems.append(f"{tag} planner's dispatch rule {rule and rule.point} != {want_point} "
                                        f"(slot read directly by the experts: {direct})")  # fmt: skip
                    if case.policy == "ring":
                        report["release_check"] = [str(d) for d in inst.release_check()]
                        problems += [f"{tag} release check: {d}" for d in report["release_check"]]
                finally:
                    inst.uninstall()
            if sync:
                extra = len(report.get("syncs", [])) - len(info["control_syncs"])
                if extra > 0:
                    problems.append(f"{tag} {extra} synchronizing CUDA call(s) beyond the control's: "
                                    f"{report['syncs']} vs {info['control_syncs']}")  # fmt: skip


def arm_rings(case: Case, ep: int, etp: int) -> list[tuple[str, list[str]]]:
    """``(arm, the rings its install hooks)`` per arm of ``case`` in an ``ep x etp`` world, by the same rule install
    reads (torch-free: known when the tests are collected, before any world runs). An arm with no ring stands down:
    it runs the control's code and is no evidence about the rings."""
    from bufreuse.config import unused_rings

    w = World(ep=ep, etp=etp, rank=0, device="cpu", ep_group=list(range(ep)), tp_ep_group=[0])
    out = []
    for arm, knobs in arms(case, w):
        unused = {_ring(b) for b in unused_rings(_config_view(case, w), knobs, "alltoall")}
        out.append((arm, sorted(set(RINGS) - unused)))
    return out


def arms(case: Case, w: World) -> list[tuple[str, Any]]:
    """``production``: the knobs production passes (install decides which rings are worth it, by its own rule);
    ``kept``: the same with ``moe_bufreuse_keep_unused_rings`` where that rule leaves a ring unused at EP x ETP > 1:
    both rings on the path production takes where it uses them, to check them in every configuration (no copy
    added, unlike the EP = 1 validation aids). The knob is set by name, unconditionally: a rename fails here."""
    from bufreuse.config import unused_rings

    knobs = knobs_for(case)
    out = [("production", knobs)]
    if unused_rings(_config_view(case, w), knobs, "alltoall"):
        out.append(("kept", dataclasses.replace(knobs, moe_bufreuse_keep_unused_rings=True)))
    return out


def _config_view(case: Case, w: World) -> dict[str, Any]:
    """The config fields the unused-ring rule reads, as a flat mapping (``overlap_moe_expert_parallel_comm`` as the
    flag only: the stages run without megatron's combined-1F1B schedule, ``Case.overlap``); the backend is gloo, as
    every world here runs (``install`` reads it from the EP group)."""
    return {
        "distributed_backend": "gloo",
        "num_moe_experts": case.experts,
        "expert_model_parallel_size": w.ep,
        "expert_tensor_parallel_size": w.etp,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": case.spec != "local",
        "overlap_moe_expert_parallel_comm": case.overlap or case.delay_wgrad,
        "fp8": case.fp8,
        "moe_pad_expert_input_to_capacity": not case.dropless,
        "moe_expert_capacity_factor": None if case.dropless else 1.0,
    }


def _rings_arm(case: Case, w: World, inst, layer, report: dict, tag: str, problems: list[str]) -> list[str] | None:
    """Record what ``install`` hooked; the ring names it hooked, or None (and a problem) where it disagrees with
    its own unused-ring rule or hooked a ring at all without hooking the layer."""
    from bufreuse.config import unused_rings

    report["hooked_layers"] = inst.layers
    report["unused"] = dict(inst.unused)
    report["rings"] = sorted(inst.pool.names())
    report["sites"] = hooked_sites(layer)
    report["rules"] = {k: r.point.value for k, r in inst.expected_release.items()}
    rule_unused = {_ring(b) for b in unused_rings(inst.config_of(layer), inst.knobs, "alltoall")}
    want = sorted(set(RINGS) - rule_unused)
    if report["rings"] != want or set(inst.unused) != rule_unused or inst.layers != (1 if want else 0):
        problems.append(f"{tag} install() at EP {w.ep} x ETP {w.etp} hooked {inst.layers} layer(s), rings "
                        f"{report['rings']}, unused {inst.unused}; the rule leaves {sorted(rule_unused)}")  # fmt: skip
        return None
    if "dispatch_output" in want and "token_dispatcher.token_dispatch" not in report["sites"]:
        problems.append(f"{tag} token_dispatch not hooked: {report['sites']}")
    if not want and report["sites"] != [s for s in report["sites"] if s.startswith("experts.linear_fc2")]:
        problems.append(f"{tag} no ring used, yet entry points were replaced: {report['sites']}")
    return want


def _ring(buffer: str) -> str:
    from bufreuse.config import BUFFERS

    return BUFFERS[buffer]


def _orders() -> dict:
    from schedule_harness import ORDERS

    return ORDERS


# -- CPU shims (megatron-core 0.19.2 lines that assume CUDA) -------------------------------------------------


def _cpu_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
    """``token_dispatcher.py:MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` on CPU: at
    ``cuda_dtoh_point`` the same conversions (``maybe_move_tensor_to_cpu``: splits to numpy), no side stream
    and no event (the tensors already live on the host)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:

        def host(t, as_numpy: bool = False):
            import torch

            if torch.is_tensor(t):
                t = t.cpu()
                return t.numpy() if as_numpy else t
            return t

        tokens_per_expert = host(tokens_per_expert)
        self.input_splits = host(self.input_splits, True)
        self.output_splits = host(self.output_splits, True)
        self.output_splits_tp = host(self.output_splits_tp, True)
        self.num_out_tokens = host(self.num_out_tokens)
        if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
            self.num_global_tokens_per_local_expert = host(self.num_global_tokens_per_local_expert)
    return tokens_per_expert


def _uneven_all_gather(tensor_list, tensor, group=None, async_op=False):
    """``mappings.py:_gather_along_first_dim`` with ``output_split_sizes`` calls ``torch.distributed.all_gather`` with
    shards of different rows (NCCL takes them); gloo's allgather wants equal ones: gather padded shards, trim."""
    import torch.distributed as dist

    rows = [t.shape[0] for t in tensor_list]
    if len(set(rows)) == 1:
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    padded = tensor.new_zeros((max(rows), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    shards = [padded.new_empty(padded.shape) for _ in rows]
    dist.all_gather(shards, padded, group=group)
    for out, shard, n in zip(tensor_list, shards, rows, strict=True):
        out.copy_(shard[:n])
    return None


def _uneven_reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    """``mappings.py:_reduce_scatter_along_first_dim`` with ``input_split_sizes`` calls
    ``torch.distributed.reduce_scatter`` with uneven chunks, which gloo lacks: all-reduce the whole, keep this
    rank's chunk (deterministic; the control and the rings arm both run it)."""
    import torch
    import torch.distributed as dist

    full = torch.cat(list(input_list)).contiguous()
    dist.all_reduce(full, group=group)
    rank = dist.get_rank(group)
    start = sum(t.shape[0] for t in input_list[:rank])
    output.copy_(full[start : start + input_list[rank].shape[0]])


def _proxy(module: Any, name: str, **overrides: Any) -> types.ModuleType:
    """A module object that is ``module`` except for ``overrides``."""
    proxy = types.ModuleType(name)
    proxy.__getattr__ = lambda attr: overrides[attr] if attr in overrides else getattr(module, attr)  # type: ignore[method-assign]
    return proxy


def apply_shims(device: str) -> None:
    """The shims of this module's docstring (process-wide in a worker; not undone): the gloo ones always, the CUDA
    ones on CPU. Only ``megatron/core/tensor_parallel/mappings.py`` sees the changed ``torch``."""
    import torch
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    dist = _proxy(torch.distributed, "dist", all_gather=_uneven_all_gather, reduce_scatter=_uneven_reduce_scatter)
    over: dict[str, Any] = {"distributed": dist}
    if device == "cpu":
        over["cuda"] = types.SimpleNamespace(current_device=lambda: torch.device("cpu"))
        D.cuda_dtoh_stream = object()
        D._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize
    mappings.torch = _proxy(torch, "torch_for_megatron_mappings", **over)


# -- worker (one process of a world) -------------------------------------------------------------------------


def worker_main(spec_path: str, rank: int) -> int:
    """Set up the world once, run every case in order, write ``rank<r>.jsonl`` (one line per case) next to the spec."""
    import datetime

    global HIDDEN, FFN, SEQ, MBS, TOKENS
    spec = json.loads(Path(spec_path).read_text())
    HIDDEN, FFN, SEQ, MBS = (spec["sizes"][k] for k in ("hidden", "ffn", "seq", "mbs"))
    TOKENS = SEQ * MBS
    out = Path(spec_path).parent / f"rank{rank}.jsonl"
    ep, etp, device, world = spec["ep"], spec["etp"], spec["device"], spec["ep"] * spec["etp"]
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)  # every rank shares the one GPU
        torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=spec["timeout_s"]),
    )
    from megatron.core import parallel_state as ps

    apply_shims(device)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    w = World(
        ep=ep,
        etp=etp,
        rank=rank,
        device=device,
        ep_group=dist.get_process_group_ranks(ps.get_expert_model_parallel_group()),
        tp_ep_group=dist.get_process_group_ranks(ps.get_expert_tensor_and_model_parallel_group()),
    )
    with out.open("w") as f:
        for raw in spec["cases"]:
            case = Case(**raw)
            t0 = time.perf_counter()
            result: dict[str, Any] = {"problems": [], "info": {}}
            try:
                run_case(case, w, result)
            except BaseException:
                result["problems"].append(f"[{case.name}] rank {rank} raised:\n{traceback.format_exc()}")
                result["aborted"] = True
            result["case"], result["wall_s"] = case.name, round(time.perf_counter() - t0, 3)
            f.write(json.dumps(result, default=str) + "\n")
            f.flush()
            if result.get("aborted"):
                os._exit(3)  # peers may be inside a collective: the parent stops the world
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


# -- parent --------------------------------------------------------------------------------------------------


@dataclass
class WorldResult:
    """Every rank's report per case (``by_case[name][rank]``), and how the world ended."""

    by_case: dict[str, list[dict | None]]
    returncodes: list[int | None]
    logs: list[str]
    wall_s: float

    def failure(self, name: str, arm: str | None = None) -> str | None:
        """Why case ``name`` did not pass on every rank, or None; with ``arm``, leaving out the other arms' problems
        (those tagged ``[name/<other arm>/<mode>]``)."""
        reports = self.by_case.get(name)
        if reports is None:
            return f"case {name} not run in this world"
        lines: list[str] = []
        stopped = [(c, k) for c, reps in self.by_case.items() for k, r in enumerate(reps) if r and r.get("aborted")]
        for rank, r in enumerate(reports):
            if r is None and stopped:
                lines.append(f"rank {rank}: not reached: the world stopped after case {stopped[0][0]} raised on rank "
                             f"{stopped[0][1]}")
            elif r is None:
                lines.append(f"rank {rank}: no report (exit {self.returncodes[rank]}):\n{self.logs[rank][-3000:]}")
            elif r["problems"]:
                others = [f"[{name}/{a}/" for a in r["info"].get("arms", {}) if a != arm] if arm else []
                lines += [f"rank {rank}: {p}" for p in r["problems"] if not any(o in p for o in others)]
        return "\n".join(lines) or None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(
    ep: int, etp: int, cases: Iterable[Case], *, device: str = "cpu", workdir: Path, timeout_s: float = 600,
    env: dict[str, str] | None = None, sizes: dict[str, int] | None = None,
) -> WorldResult:  # fmt: skip
    """Spawn ``ep * etp`` workers running ``cases`` in order; their reports, per case and rank. ``sizes``: hidden,
    ffn, seq, mbs (default: this module's)."""
    cases = list(cases)
    world = ep * etp
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {
        "ep": ep, "etp": etp, "device": device, "port": _free_port(), "timeout_s": 120,
        "sizes": sizes or {"hidden": HIDDEN, "ffn": FFN, "seq": SEQ, "mbs": MBS},
        "cases": [dataclasses.asdict(c) for c in cases],
    }  # fmt: skip
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    penv = dict(os.environ, **(env or {}))
    penv["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [penv.get("PYTHONPATH")])])
    penv.setdefault("OMP_NUM_THREADS", "1")
    penv.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (GPU worlds)
    penv.pop("BUFREUSE_DEBUG", None)  # each case sets its modes itself
    logs = [workdir / f"rank{r}.log" for r in range(world)]
    t0 = time.perf_counter()
    procs = []
    for r in range(world):
        with logs[r].open("w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__)), str(spec_path), str(r)],
                stdout=log, stderr=subprocess.STDOUT, env=penv, cwd=str(HERE.parent),
            ))  # fmt: skip
    deadline = t0 + timeout_s
    first_exit: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.perf_counter()
        if any(p.returncode not in (None, 0) for p in procs) and first_exit is None:
            first_exit = now
        if now > deadline or (first_exit is not None and now > first_exit + 10):
            for p in procs:  # only the processes started here
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
    by_case: dict[str, list[dict | None]] = {c.name: [None] * world for c in cases}
    for r in range(world):
        path = workdir / f"rank{r}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            rep = json.loads(line)
            by_case[rep["case"]][r] = rep
    return WorldResult(
        by_case=by_case,
        returncodes=[p.returncode for p in procs],
        logs=[log.read_text() for log in logs],
        wall_s=time.perf_counter() - t0,
    )


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1], int(sys.argv[2])))
