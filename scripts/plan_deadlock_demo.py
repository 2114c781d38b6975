"""One GPU, EP = 1: a schedule that hangs a GPU-waiting ring with too few slots, predicted by the planner.

Schedule: 1F1B, rank 0 of 3 stages, 4 microbatches, one MoE layer, the dispatch output released after
the experts' backward (bf16 experts). The planner's minimum is L x (p - r) = 3 slots.

Three views of the same schedule at ``--slots N``:

1. the planner: ``bufreuse.plan`` minimum and, below it, the happens-before cycle (ring, slot, streams);
2. the pool: real ``BufferRing`` slots driven in program order -- too few slots raise ``EarlyReuseError`` on
   the host before any GPU work (what bufreuse does in production);
3. a ring that waits **on the GPU** for the slot's release, the way a backend's internal buffer does (the
   seed's "spun before the first iteration"): the producer stream runs ``cuStreamWaitValue32`` on a per-slot
   release counter that the consumer stream bumps with ``cuStreamWriteValue32`` (driver API via ctypes). Too
   few slots and the two streams wait on each other forever; the pool's :class:`bufreuse.pool.Watchdog`,
   fed each GPU wait, names the ring and the slot. The script then unsticks the GPU by writing the counters
   from a third stream, so the process exits cleanly.

Prints one JSON object: slots, planner minimum and cycle, pool error, completed, watchdog reports.
Usage: ``python scripts/plan_deadlock_demo.py --slots 2 [--watchdog-s 2] [--wait-s 8]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from typing import Any

import torch

from bufreuse.plan import ReleasePoint, ReleaseRule, ScheduleKind, ScheduleSpec, build_steps, expand, find_hazards
from bufreuse.plan.depth import ring_depths
from bufreuse.pool import BufferPool, EarlyReuseError, Watchdog

RING = "dispatch_output"
SHAPE = (1024, 1024)


def planned_ops() -> list[Any]:
    spec = ScheduleSpec(kind=ScheduleKind.ONE_F_ONE_B, pp=3, rank=0, microbatches=4)
    rules = {"dispatch": ReleaseRule(buffer="dispatch", point=ReleasePoint.BACKWARD, reason="bf16 experts")}
    return expand(build_steps(spec), [1], rules)


class _StreamMemOps:
    """``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` from libcuda (GEQ wait, plain write)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        self._write = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        for fn in (self._wait, self._write):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int

    def wait_geq(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        self._check(self._wait(ctypes.c_void_p(stream.cuda_stream), addr, value, 0), "cuStreamWaitValue32")

    def write(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        self._check(self._write(ctypes.c_void_p(stream.cuda_stream), addr, value, 0), "cuStreamWriteValue32")

    @staticmethod
    def _check(rc: int, call: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{call} returned CUresult {rc}")


class _PendingRelease:
    """What the watchdog polls for one GPU wait: the release event, once the host has issued it."""

    def __init__(self) -> None:
        self.event: torch.cuda.Event | None = None

    def query(self) -> bool:
        return self.event is not None and self.event.query()

    def __repr__(self) -> str:
        return "<release not issued yet>" if self.event is None else "<release event on the compute stream>"


def pool_view(ops: list[Any], slots: int, dev: torch.device) -> str | None:
    """Real pool rings in program order: the host-side refusal, if any."""
    pool = BufferPool(dev, debug=False)
    pool.register(RING, policy="ring", num_slots=slots, max_shape=SHAPE, dtype=torch.float32)
    held: dict[Any, torch.Tensor] = {}
    try:
        for op in ops:
            for acq in op.releases:
                pool.release(RING, held.pop(acq))
            for acq in op.acquires:
                held[acq] = pool.acquire(RING)
    except EarlyReuseError as e:
        return str(e)
    finally:
        torch.cuda.synchronize(dev)
        pool.close()
    return None


def gpu_waiting_ring(ops: list[Any], slots: int, dev: torch.device, *, watchdog_s: float, wait_s: float) -> dict:
    """Run ``ops`` on two streams with a ring whose producer waits on the GPU; report whether it finished."""
    mem = _StreamMemOps()
    comm, compute, rescue = (torch.cuda.Stream(dev) for _ in range(3))
    storage = torch.zeros(slots, *SHAPE, device=dev)
    counters = torch.zeros(slots, dtype=torch.int32, device=dev)  # releases seen per slot
    base = counters.data_ptr()
    reports: list[str] = []
    dog = Watchdog(watchdog_s, poll_s=min(0.25, watchdog_s / 4), on_report=reports.append)
    streams = {"comm": comm, "compute": compute}
    order: dict[Any, int] = {}
    written: dict[Any, torch.cuda.Event] = {}
    pending: dict[Any, _PendingRelease] = {}
    sink = torch.zeros((), device=dev)
    done: list[torch.cuda.Event] = []
    completed = False
    try:
        for op in ops:
            stream = streams[op.stream]
            with torch.cuda.stream(stream):
                for acq in op.reads:
                    stream.wait_event(written[acq])
                    sink.add_(storage[order[acq] % slots].sum())
                for acq in op.releases:
                    k = order[acq]
                    mem.write(stream, base + 4 * (k % slots), k // slots + 1)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    pending.setdefault(acq, _PendingRelease()).event = ev
                for acq in op.acquires:
                    k = order[acq] = len(order)
                    slot, generation = k % slots, k // slots
                    if generation:
                        mem.wait_geq(stream, base + 4 * slot, generation)  # the previous holder's release
                        prev = next(a for a, n in order.items() if n == k - slots)
                        dog.track(RING, slot, generation, pending.setdefault(prev, _PendingRelease()))
                    storage[slot].fill_(float(k))
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    written[acq] = ev
        for stream in streams.values():
            ev = torch.cuda.Event()
            ev.record(stream)
            done.append(ev)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not all(ev.query() for ev in done):
            time.sleep(0.05)
        completed = all(ev.query() for ev in done)
        time.sleep(min(1.0, watchdog_s / 2))  # let a last poll report
    finally:
        if not done or not all(ev.query() for ev in done):
            for slot in range(slots):  # unstick: satisfy every pending wait from an idle stream
                mem.write(rescue, base + 4 * slot, 1 << 30)
        torch.cuda.synchronize(dev)
        dog.close()
    return {"completed": completed, "watchdog_reports": reports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--watchdog-s", type=float, default=2.0, help="watchdog threshold")
    parser.add_argument("--wait-s", type=float, default=8.0, help="how long to wait for the GPU to finish")
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    ops = planned_ops()
    minimum = max(d.peak for d in ring_depths(ops).values())
    hazards = find_hazards(ops, {"dispatch": args.slots})
    out: dict[str, Any] = {
        "slots": args.slots,
        "planner_minimum": minimum,
        "planner_cycle": hazards.cycles[0].to_dict() if hazards.cycles else None,
        "pool_error": pool_view(ops, args.slots, dev),
    }
    out.update(gpu_waiting_ring(ops, args.slots, dev, watchdog_s=args.watchdog_s, wait_s=args.wait_s))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
