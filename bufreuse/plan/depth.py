"""The minimum safe slot count of each ring: the most acquisitions held at once on one rank.

A ring is shared by every MoE layer of every model chunk on the rank: ``install()`` registers one ring
per buffer name in the pool it is given, and the entry (``bufreuse-megatron``) gives every chunk of a
virtual-pipelining rank the same pool. The ring hands out a free slot or raises ``EarlyReuseError``,
so it runs the schedule iff ``slots >= max held``: the minimum is the peak of ``acquisitions -
releases`` over the rank's program order, all chunks together (:func:`ring_depths`; ``per_chunk=True``
gives each chunk's own share, the figure a pool per chunk would need).

Closed forms (``L`` MoE layers per chunk, rank ``r`` of ``p``, ``m`` microbatches, ``w`` warm-up
forwards of :func:`bufreuse.plan.schedule.warmup_forwards`), each checked against the simulation in
``tests/test_plan_depth.py``:

- **forward release**, schedules without overlap (none, 1F1B, interleaved): **1**. Each layer acquires
  and releases before the next layer acquires. With recompute still 1 (the recomputed forward releases
  inside the backward of the same layer).
- **backward release, none**: **L**. F(i) holds its L acquisitions until B(i).
- **backward release, 1F1B**: **L x min(m, p - r)**, i.e. **L x (p - r)** for ``m >= p - r``.
  The steady phase runs F(w + i) before B(i): ``w + 1`` forwards are in flight, each holding L slots;
  with ``m < p - r`` every microbatch is a warm-up forward and all ``m`` are in flight.
- **backward release, interleaved** (``w`` = ``min(2 (p - r - 1) + (v - 1) g, m v)`` warm-up forwards,
  ``g`` = microbatch_group_size_per_vp_stage, default p): **L x min(m v, w + 1)**. Every forward in
  flight holds L slots of the shared ring whatever its chunk, and the steady phase runs one more forward
  before the first backward. For rank 0 with ``g = p``: **L x min(m v, (v + 1) p - 1)**. A pool per
  chunk would need ``L x min(m, 2g, w + 1)`` in each of its v rings (the chunk-0 ring's peak), never
  fewer slots in total.
- **combined-1F1B, PP > 1** (the interleaved order with one extra warm-up forward, steady steps
  overlapped): **L x min(m v, w)** with the combined ``w`` (interleaved ``w`` + 1): the same as
  interleaved, because in every overlapped layer pair the backward's release precedes the forward's
  acquisition. ``wgrad`` release: that figure or one more (when the peak step pairs a forward and a
  backward); no closed form is kept, the simulation decides. Forward release: **1**.

Verified by simulation for p in {2, 3, 4, 8}, v in {2, 3, 4}, p <= m <= 4p, every rank, L in {1, 2, 3},
g in {p, p + 1} (``tests/test_plan_depth.py`` keeps a sample of these).

Where no closed form is listed the planner reports the simulated figure and whether it grows with m
(:func:`grows_with`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bufreuse.plan.ops import Op
from bufreuse.plan.rules import ReleasePoint
from bufreuse.plan.schedule import ScheduleKind, ScheduleSpec, warmup_forwards

__all__ = ["ALL_CHUNKS", "RingDepth", "closed_form", "grows_with", "pending_at", "ring_depths"]


@dataclass(kw_only=True, slots=True)
class RingDepth:
    """The peak of one ring (one buffer, all model chunks or one) over the schedule."""

    buffer: str
    chunk: int
    """``ALL_CHUNKS`` for the rank's shared ring, else the model chunk."""
    peak: int
    """Most acquisitions held at once = the minimum safe slot count."""
    peak_op: int
    """Index of the operation after which the peak is first reached (the max-active point)."""
    acquisitions: int
    """Acquisitions in one iteration."""


ALL_CHUNKS = -1
"""The ``chunk`` of a ring shared by every model chunk of the rank."""


def ring_depths(ops: Iterable[Op], *, per_chunk: bool = False) -> dict[tuple[str, int], RingDepth]:
    """Peak held per ring over ``ops`` (one pass, O(ops)).

    Keys are ``(buffer, ALL_CHUNKS)``: one ring per buffer shared by the rank's chunks (what ``install()``
    and the entry register); ``per_chunk=True`` keys ``(buffer, chunk)``: one ring per chunk.
    """
    held: dict[tuple[str, int], int] = {}
    out: dict[tuple[str, int], RingDepth] = {}
    for op in ops:
        for acq in op.releases:
            held[acq[0], acq[1] if per_chunk else ALL_CHUNKS] -= 1
        for acq in op.acquires:
            key = (acq[0], acq[1] if per_chunk else ALL_CHUNKS)
            n = held.get(key, 0) + 1
            held[key] = n
            d = out.get(key)
            if d is None:
                out[key] = RingDepth(buffer=key[0], chunk=key[1], peak=n, peak_op=op.index, acquisitions=1)
                continue
            d.acquisitions += 1
            if n > d.peak:
                d.peak, d.peak_op = n, op.index
    return out


def closed_form(
    spec: ScheduleSpec, point: ReleasePoint, layers: int, *, recompute: bool = False
) -> tuple[int, str] | None:
    """The minimum of one ring from the closed forms above, and the formula in words (None: none known).

    The formula names what the figure grows with (``L``, ``m``, ``p - r``); ``"1"`` means constant.
    Raises ``ValueError`` for a refused rule.
    """
    if point is ReleasePoint.REFUSED:
        raise ValueError("a refused buffer has no ring")
    L, m = layers, spec.microbatches
    # Only PP = 1 combined pairs a forward and a backward of the same chunk's ring every step.
    extra = int(point is ReleasePoint.WGRAD and spec.kind is ScheduleKind.COMBINED and spec.pp == 1 and m > 1)
    if point is ReleasePoint.FORWARD:
        return 1, "1"
    if recompute:
        if spec.kind is ScheduleKind.COMBINED:
            return None  # megatron refuses MoE recompute with EP overlap; no closed form kept
        return 1, "1"
    if spec.kind is ScheduleKind.NONE or (spec.kind is ScheduleKind.COMBINED and spec.pp == 1):
        return L + extra, "L + 1" if extra else "L"
    if spec.kind is ScheduleKind.ONE_F_ONE_B:
        return L * min(m, spec.pp - spec.rank), "L x min(m, p - r)"
    w = warmup_forwards(spec)
    v = spec.vpp
    if spec.kind is ScheduleKind.INTERLEAVED:
        return L * min(m * v, w + 1), "L x min(m v, w + 1)"
    if point is ReleasePoint.WGRAD:
        return None  # L x min(m v, w) or one more, depending on which passes pair at the peak
    return L * min(m * v, w), "L x min(m v, w)"


def pending_at(ops: Sequence[Op], buffer: str, lag_steps: int) -> tuple[int, int]:
    """Buffers of ``buffer`` the control would keep pending-free at its max-active point, and that step.

    Model: under ``record_stream`` each release is a free request whose block stays pending until the
    consumer stream has run the work before it. The GPU trails the host by ``lag_steps`` schedule steps, so
    at a point the pending blocks are the releases issued in the last ``lag_steps`` steps. The max-active
    point is taken where the most forward passes are in flight (the activation peak); the count is the
    largest over those steps. All chunks share one allocator. Returns ``(count, step)``.
    """
    if not ops:
        return 0, 0
    last_step = ops[-1].step
    releases = [0] * (last_step + 1)
    in_flight = [0] * (last_step + 1)
    live = 0
    for op in ops:
        if op.releases:
            releases[op.step] += sum(1 for acq in op.releases if acq[0] == buffer)
        if op.layer == 0 and op.name in ("dispatch.fwd", "dispatch.bwd"):
            live += 1 if op.name == "dispatch.fwd" else -1  # a pass starts and ends at layer 0
        in_flight[op.step] = live
    peak = max(in_flight)
    best, where = -1, 0
    for step, n in enumerate(in_flight):
        if n != peak:
            continue
        count = sum(releases[max(0, step - lag_steps + 1) : step + 1])
        if count > best:
            best, where = count, step
    return best, where


def grows_with(depth_of: dict[int, int]) -> bool:
    """Whether a minimum measured at increasing values of one parameter (m or L) still grows at the end."""
    keys = sorted(depth_of)
    return len(keys) >= 2 and depth_of[keys[-1]] > depth_of[keys[-2]]
