"""GPU-side waits of one iteration as a happens-before graph over streams, and the cycles in it.

Nodes are the stream operations of :func:`bufreuse.plan.ops.expand` (or any list of :class:`Op`). Edges
``a -> b`` mean "b cannot start on the GPU before a finished":

- **program order**: consecutive operations of one stream;
- **data**: a reader waits on the producer of the acquisition it reads (experts.fwd on the dispatch, on
  the compute stream; combine.fwd on the FC2 output, on the communication stream);
- **ring**: the producer of an acquisition waits on the last release of the slot it gets. Slots are
  assigned as ``BufferRing`` assigns them (the cursor's slot if free, else the next free one); when every
  slot is held the ring would have to hand out the cursor's slot, whose release comes *later* in program
  order: that edge points backwards, and a backward edge closes a cycle with the forward edges that lead
  from the producer to that release;
- **stream-ordered**: a release makes the producer stream wait on the consumer -- an edge from the release
  to the next operation the host issues on the producer stream.

All edges but the ring's backward ones point forward in host order, so every cycle passes through one: a
wait that can never be satisfied. The pool turns it into ``EarlyReuseError`` on the host before any GPU
work; a backend that waits for the slot on the GPU itself (a flag the consumer writes, like HybridEP's
internal buffers) would spin forever -- the seed's "spun before the first iteration".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bufreuse.plan.depth import ALL_CHUNKS
from bufreuse.plan.ops import COMM, COMPUTE, Acq, Op

__all__ = ["Cycle", "HazardReport", "find_hazards", "producer_stream"]

RING_NAMES = {"dispatch": "dispatch_output", "expert": "expert_fc2_output"}


def producer_stream(buffer: str) -> str:
    """Stream that writes ``buffer``: the dispatch on comm, the expert FC2 on compute."""
    return COMM if buffer == "dispatch" else COMPUTE


@dataclass(kw_only=True, slots=True)
class Cycle:
    """One wait the GPU can never satisfy, with the operations on the cycle."""

    ring: str
    """The pool's ring name (``dispatch_output`` / ``expert_fc2_output``)."""
    chunk: int
    """The ring's model chunk; ``ALL_CHUNKS`` for the rank's shared ring."""
    slot: int
    waiter: Op
    """The producer that waits on the slot."""
    holder: Op
    """The later release it would wait on."""
    path: list[Op] = field(default_factory=list)
    """Operations from the waiter to the holder along forward edges (the rest of the cycle)."""

    @property
    def streams(self) -> list[str]:
        seen: list[str] = []
        for op in self.path:
            if op.stream not in seen:
                seen.append(op.stream)
        return seen

    def describe(self) -> str:
        """One line; long paths keep their ends and the stream switches in between."""
        keep = [
            op for k, op in enumerate(self.path) if k in (0, len(self.path) - 1) or op.stream != self.path[k - 1].stream
        ]
        if len(keep) > 8:
            keep = [*keep[:4], None, *keep[-3:]]
        hops = " -> ".join("..." if op is None else op.label() for op in keep)
        return (
            f"ring '{self.ring}'{f' (chunk {self.chunk})' if self.chunk >= 0 else ''} slot {self.slot}: "
            f"{self.waiter.label()} waits on the release "
            f"in {self.holder.label()}, which runs after it: {hops} -> (waits) {self.waiter.name}; "
            f"streams {' and '.join(self.streams)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ring": self.ring,
            "chunk": self.chunk,
            "slot": self.slot,
            "waiter": self.waiter.label(),
            "holder": self.holder.label(),
            "streams": self.streams,
            "path": [op.label() for op in self.path],
            "text": self.describe(),
        }


@dataclass(kw_only=True, slots=True)
class HazardReport:
    """What :func:`find_hazards` found."""

    cycles: list[Cycle] = field(default_factory=list)
    """Every unsatisfiable ring wait found (the first per ring when ``first_only``)."""
    edges: int = 0

    @property
    def ok(self) -> bool:
        return not self.cycles

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "edges": self.edges, "cycles": [c.to_dict() for c in self.cycles]}


def find_hazards(
    ops: Sequence[Op],
    slots: Mapping[str, int],
    *,
    policies: Mapping[str, str] | None = None,
    first_only: bool = True,
    per_chunk: bool = False,
) -> HazardReport:
    """Build the happens-before graph of ``ops`` and report the ring waits that close a cycle.

    Args:
        ops: operations in host program order.
        slots: ring slots per buffer (``dispatch``/``expert``).
        policies: ``ring`` (default) or ``stream-ordered`` per buffer.
        first_only: stop at the first cycle of each ring (the GPU is stuck there anyway).
        per_chunk: one ring per model chunk (default: one per buffer shared by the rank's chunks, as
            ``install()`` and the entry register them).
    """
    policies = dict(policies or {})
    succ: list[list[int]] = [[] for _ in ops]
    last_on: dict[str, int] = {}
    producer: dict[Acq, int] = {}
    release_of: dict[Acq, int] = {}
    for op in ops:
        for acq in op.releases:
            release_of[acq] = op.index
    backward: list[tuple[int, int, str, int, int]] = []  # (release op, waiter op, buffer, chunk, slot)
    rings: dict[tuple[str, int], _RingModel] = {}
    pending_so: dict[str, list[int]] = {COMM: [], COMPUTE: []}  # stream-ordered releases awaiting a producer op
    for op in ops:
        i = op.index
        prev = last_on.get(op.stream)
        if prev is not None:
            succ[prev].append(i)
        last_on[op.stream] = i
        for r in pending_so[op.stream]:
            succ[r].append(i)
        pending_so[op.stream] = []
        for acq in op.reads:
            p = producer.get(acq)
            if p is not None and p != i:
                succ[p].append(i)
        for acq in op.acquires:
            producer[acq] = i
            buf, chunk = acq[0], acq[1] if per_chunk else ALL_CHUNKS
            if policies.get(buf, "ring") != "ring":
                continue
            ring = rings.get((buf, chunk))
            if ring is None:
                ring = rings[buf, chunk] = _RingModel(slots.get(buf, 1))
            slot, wait_on, holder = ring.acquire(acq)
            if wait_on is not None:
                succ[wait_on].append(i)
            if holder is not None:
                rel = release_of.get(holder)
                if rel is not None:
                    succ[rel].append(i)
                    backward.append((rel, i, buf, chunk, slot))
        for acq in op.releases:
            buf, chunk = acq[0], acq[1] if per_chunk else ALL_CHUNKS
            if policies.get(buf, "ring") == "ring":
                ring = rings.get((buf, chunk))
                if ring is not None:
                    ring.release(acq, i)
            else:
                pending_so[producer_stream(buf)].append(i)
    report = HazardReport(edges=sum(len(s) for s in succ))
    reported: set[tuple[str, int]] = set()
    for rel, waiter, buf, chunk, slot in backward:
        if first_only and (buf, chunk) in reported:
            continue
        path = _path(succ, waiter, rel)
        if path is None:
            continue
        reported.add((buf, chunk))
        report.cycles.append(
            Cycle(
                ring=RING_NAMES.get(buf, buf),
                chunk=chunk,
                slot=slot,
                waiter=ops[waiter],
                holder=ops[rel],
                path=[ops[k] for k in path],
            )
        )
    return report


class _RingModel:
    """``BufferRing``'s slot choice, without storage: cursor slot if free, else the next free one."""

    __slots__ = ("cursor", "holder", "last_release", "n", "slot_of")

    def __init__(self, n: int) -> None:
        self.n = max(1, n)
        self.cursor = 0
        self.holder: list[Acq | None] = [None] * self.n
        self.last_release: list[int | None] = [None] * self.n
        self.slot_of: dict[Acq, int] = {}

    def acquire(self, acq: Acq) -> tuple[int, int | None, Acq | None]:
        """Returns (slot, release op to wait on, holder whose future release it must wait on)."""
        n = self.n
        slot = next((s for s in (self.cursor + k for k in range(n)) if self.holder[s % n] is None), None)
        overflow: Acq | None = None
        if slot is None:
            slot, overflow = self.cursor, self.holder[self.cursor]
        slot %= n
        wait_on = self.last_release[slot] if overflow is None else None
        self.holder[slot] = acq
        self.slot_of[acq] = slot
        self.cursor = (slot + 1) % n
        return slot, wait_on, overflow

    def release(self, acq: Acq, op: int) -> None:
        slot = self.slot_of.pop(acq, None)
        if slot is not None and self.holder[slot] == acq:
            self.holder[slot] = None
            self.last_release[slot] = op


def _path(succ: list[list[int]], start: int, goal: int) -> list[int] | None:
    """Shortest forward path ``start -> ... -> goal`` (nodes beyond ``goal`` cannot lead back to it)."""
    prev = {start: start}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            out = [node]
            while node != start:
                node = prev[node]
                out.append(node)
            return out[::-1]
        for nxt in succ[node]:
            if nxt <= goal and nxt not in prev:
                prev[nxt] = node
                queue.append(nxt)
    return None
