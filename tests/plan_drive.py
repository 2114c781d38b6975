"""Drive real pool rings through a planned schedule: acquire and release where the planner's ops say.

Shared by ``tests/test_plan_pool.py`` (CPU tensors: the ring's state machine runs on the host) and
``tests/test_plan_gpu.py`` (CUDA: two streams, producers write the slot, readers wait on them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bufreuse.plan.hazards import RING_NAMES
from bufreuse.plan.ops import COMM, Op, expand
from bufreuse.plan.rules import ReleasePoint, ReleaseRule
from bufreuse.plan.schedule import ScheduleKind, ScheduleSpec, build_steps
from bufreuse.plan.slots import proxy_ops
from bufreuse.pool import BufferPool

SHAPE = (64, 32)

B, F, W = ReleasePoint.BACKWARD, ReleasePoint.FORWARD, ReleasePoint.WGRAD
K = ScheduleKind


@dataclass(frozen=True)
class Case:
    """One schedule of the pool-vs-planner table."""

    name: str
    kind: ScheduleKind | None  # None: the sweep's proxy
    pp: int = 1
    rank: int = 0
    microbatches: int = 4
    vpp: int = 1
    layers: int = 1
    dispatch: ReleasePoint = B
    expert: ReleasePoint = F
    recompute: bool = False
    cycle_below: bool = True
    """Whether one slot fewer also closes a happens-before cycle (a GPU-waiting ring would hang). In the
    proxy it does not: D1 waits for E0's release of D0, and E0 needs only D0, so the GPU could wait it
    out; the pool still refuses on the host, where E0's release has not been issued yet."""

    def ops(self) -> list[Op]:
        if self.kind is None:
            return proxy_ops(self.microbatches)
        spec = ScheduleSpec(kind=self.kind, pp=self.pp, rank=self.rank, microbatches=self.microbatches, vpp=self.vpp)
        rules = {
            "dispatch": ReleaseRule(buffer="dispatch", point=self.dispatch, reason="", recompute=self.recompute),
            "expert": ReleaseRule(buffer="expert", point=self.expert, reason="", recompute=self.recompute),
        }
        return expand(build_steps(spec), [self.layers] * self.vpp, rules)


CASES = [
    Case(name="none-bwd-L3", kind=K.NONE, layers=3),
    Case(name="1f1b-r0of4-bwd-L2", kind=K.ONE_F_ONE_B, pp=4, microbatches=8, layers=2),
    Case(name="1f1b-r2of4-bwd-L2", kind=K.ONE_F_ONE_B, pp=4, rank=2, microbatches=8, layers=2),
    Case(name="1f1b-r0of4-fwd-L2", kind=K.ONE_F_ONE_B, pp=4, microbatches=8, layers=2, dispatch=F),
    Case(name="1f1b-recompute-bwd", kind=K.ONE_F_ONE_B, pp=3, microbatches=6, layers=2, recompute=True),
    Case(name="interleaved-p2v2-bwd-L2", kind=K.INTERLEAVED, pp=2, microbatches=4, vpp=2, layers=2),
    Case(name="interleaved-p4v3-r1-bwd", kind=K.INTERLEAVED, pp=4, rank=1, microbatches=8, vpp=3),
    Case(name="combined-pp1-wgrad-L2", kind=K.COMBINED, microbatches=5, layers=2, dispatch=W),
    Case(name="combined-p2v2-bwd-L2", kind=K.COMBINED, pp=2, microbatches=6, vpp=2, layers=2),
    Case(name="1f1b-expert-bwd", kind=K.ONE_F_ONE_B, pp=3, microbatches=6, layers=2, dispatch=F, expert=B),
    Case(name="proxy-m6", kind=None, microbatches=6, cycle_below=False),
]
"""Schedules where the planner's minimum must equal the smallest slot count the pool runs."""


def drive(
    ops: Sequence[Op], slots: dict[str, int], device: str | torch.device = "cpu", *, debug: bool = False
) -> dict[str, int]:
    """Run ``ops`` through a pool with ``slots`` per buffer; returns each ring's peak held.

    Production mode by default (``debug=True``: the pool's per-call checks and watchdog on top). Raises the
    pool's ``EarlyReuseError`` when a ring is too small.
    """
    dev = torch.device(device)
    pools: dict[int, BufferPool] = {}  # one pool for every model chunk, as install() and the entry register it

    def pool_of(chunk: int) -> BufferPool:
        chunk = 0
        if chunk not in pools:
            pool = pools[chunk] = BufferPool(dev, debug=debug)
            for buf, n in slots.items():
                pool.register(RING_NAMES[buf], policy="ring", num_slots=n, max_shape=SHAPE, dtype=torch.float32)
        return pools[chunk]

    try:
        cuda = dev.type == "cuda"
        streams: dict[str, Any] = {}
        if cuda:
            streams = {COMM: torch.cuda.Stream(dev), "compute": torch.cuda.Stream(dev)}
        held: dict[tuple, torch.Tensor] = {}
        written: dict[tuple, Any] = {}
        for op in ops:
            stream = streams.get(op.stream)
            ctx = torch.cuda.stream(stream) if cuda else contextlib.nullcontext()
            with ctx:
                for acq in op.reads:
                    if acq in held:
                        if cuda and acq in written:
                            stream.wait_event(written[acq])
                        held[acq].sum()
                for acq in op.releases:
                    pool_of(acq[1]).release(RING_NAMES[acq[0]], held.pop(acq), stream=stream)
                for acq in op.acquires:
                    t = pool_of(acq[1]).acquire(RING_NAMES[acq[0]], stream=stream)
                    t.fill_(float(acq[2]))
                    held[acq] = t
                    if cuda:
                        ev = torch.cuda.Event()
                        ev.record(stream)
                        written[acq] = ev
        if held:
            raise AssertionError(f"acquisitions never released: {sorted(held)[:4]}")
        if cuda:
            torch.cuda.synchronize(dev)
        return {buf: max(p.stats()[RING_NAMES[buf]].peak_held for p in pools.values()) for buf in slots}
    finally:
        for pool in pools.values():
            pool.close()
