"""GPU tests of the pool (run on the H200 with ``bash scripts/gpu-tests.sh tests/test_pool_gpu.py``).

(a) slow consumer / fast producer: every consumer reads what its producer wrote, acquire never syncs;
(b) eager warm-up -> capture of a whole two-ring, two-stream step -> replays == eager -> eager again;
(c) early reuse raises before any kernel is enqueued (a sentinel in the slot stays intact);
(d) K forwards then K backwards through a bf16 linear fed from an N < K ring: the release point matters;
(e) the debug watchdog names the ring and slot of a wait that does not finish;
(f) replay -> eager -> replay -> eager on two streams (two rings, fixed and ``auto`` depth), with slow
    unjoined eager consumers: ``before_replay`` orders every replay; bit-equal to eager every round;
(g) production mode (no guard, no debug): a bf16 linear fed from a 1-2 slot ring over interleaved
    schedules, dispatch writing by pointer, slow backward: ``release_when_unsaved`` gives gradients
    bit-equal to ``torch.empty`` buffers (debug mode too);
(h) a ``Hold`` (wgrad-like reader on a side stream) keeps the next producer off the slot until done.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.nn.functional as F

from bufreuse.pool import BufferPool, BufferRing, EarlyReuseError, SavedForBackwardError

pytestmark = pytest.mark.gpu

_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep spins in clock cycles; the H200 runs near 2 GHz


@pytest.fixture
def dev() -> torch.device:
    torch.cuda.synchronize()
    return torch.device("cuda", torch.cuda.current_device())


def test_slow_consumer_reads_what_its_producer_wrote(dev):
    rounds, rows, cols = 100, 256, 256
    ring = BufferRing("dispatch_output", 2, (rows, cols), torch.float32, dev)
    producer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    sums = torch.zeros(rounds, device=dev)
    written = [torch.cuda.Event() for _ in range(rounds)]
    busy_at_acquire = 0
    for stream in (producer, consumer):  # load the kernels once so the timed loop measures enqueueing only
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1)
            sums[0] = torch.ones(rows, cols, device=dev).fill_(1.0).sum()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(rounds):
        slot = ring._slots[ring.cursor]
        if slot.wait_on is not None and not slot.wait_on.query():
            busy_at_acquire += 1  # the previous consumer of this slot has not finished on the GPU
        buf = ring.acquire((rows, cols), producer)
        with torch.cuda.stream(producer):
            buf.fill_(float(i + 1))  # fast producer
            written[i].record(producer)
        consumer.wait_event(written[i])
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(_CYCLES_PER_MS)  # slow consumer: ~1 ms before it reads
            sums[i] = buf.sum()
        ring.release(buf, consumer)
    host_s = time.perf_counter() - start
    still_busy = not consumer.query()
    torch.cuda.synchronize()
    expected = torch.arange(1, rounds + 1, device=dev, dtype=torch.float32) * rows * cols
    assert torch.equal(sums, expected), "a consumer read a slot its next producer had already overwritten"
    assert still_busy and busy_at_acquire >= rounds // 2, (still_busy, busy_at_acquire)
    assert host_s < rounds * 1e-3 / 2, f"host loop took {host_s:.3f} s: acquire waited on the host"
    assert ring.stats.gpu_waits == rounds - 2 and ring.stats.peak_held == 1


def _step(
    pool: BufferPool, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, comm, comp, *, slow_ms: int = 0,
    join: bool = True,
) -> None:  # fmt: skip
    """One MoE-like step of 4 microbatches: dispatch on comm, experts on comp, combine on comm.

    ``slow_ms`` delays every expert read on comp; ``join=False`` leaves comm/comp unjoined to the current
    stream (what only the pool's release events can then order against a later replay).
    """
    cur = torch.cuda.current_stream()
    comm.wait_stream(cur)
    comp.wait_stream(cur)
    for m in range(x.shape[0]):
        d = pool.acquire("dispatch_output", x.shape[1:], comm)
        with torch.cuda.stream(comm):
            torch.mul(x[m], 0.5, out=d)  # dispatch writes the ring slot
        comp.wait_stream(comm)
        y = pool.acquire("expert_fc2_output", (x.shape[1], w.shape[1]), comp)
        with torch.cuda.stream(comp):
            if slow_ms:
                torch.cuda._sleep(slow_ms * _CYCLES_PER_MS)
            torch.matmul(d, w, out=y)  # experts: final read of d, write y
        pool.release("dispatch_output", d, comp)
        comm.wait_stream(comp)
        with torch.cuda.stream(comm):
            torch.add(y, float(m), out=out[m])  # combine: final read of y
        pool.release("expert_fc2_output", y, comm)
    if join:
        cur.wait_stream(comm)
        cur.wait_stream(comp)


def test_capture_whole_step_replays_equal_eager_then_eager_again(dev):
    micro, tokens, hidden = 4, 512, 256
    pool = BufferPool(dev)
    pool.register("dispatch_output", policy="ring", num_slots=2, max_shape=(tokens, hidden), dtype=torch.float32)
    pool.register("expert_fc2_output", policy="ring", num_slots=2, max_shape=(tokens, hidden), dtype=torch.float32)
    comm, comp = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    inputs = [torch.randn(micro, tokens, hidden, device=dev, generator=gen) for _ in range(8)]
    w = torch.randn(hidden, hidden, device=dev, generator=gen)
    x = torch.empty_like(inputs[0])
    out = torch.empty(micro, tokens, hidden, device=dev)

    expected = []
    for inp in inputs:  # eager reference (and the eager warm-up: 8 >= 2 steps)
        x.copy_(inp)
        _step(pool, x, w, out, comm, comp)
        expected.append(out.clone())
    torch.cuda.synchronize()

    graph, capture_stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    with pool.graph_capture(capture_stream), torch.cuda.graph(graph, stream=capture_stream):
        _step(pool, x, w, out, comm, comp)
    for r in range(5):
        x.copy_(inputs[r])
        graph.replay()
        assert torch.equal(out, expected[r]), f"replay {r} differs from eager"
    pool.after_replay(torch.cuda.current_stream())
    for r in (5, 6):
        x.copy_(inputs[r])
        _step(pool, x, w, out, comm, comp)
        torch.cuda.synchronize()
        assert torch.equal(out, expected[r]), f"eager step {r} after the replays differs"
    stats = pool.stats()
    assert stats["dispatch_output"].peak_held <= 2 and stats["dispatch_output"].gpu_waits > 0


def test_early_reuse_raises_before_any_kernel(dev):
    ring = BufferRing("dispatch_output", 1, (64, 64), torch.float32, dev)
    producer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    held = ring.acquire(None, producer)
    with torch.cuda.stream(producer):
        held.fill_(7.0)  # sentinel
    waits = ring.stats.gpu_waits

    def produce_next() -> None:
        buf = ring.acquire(None, producer)
        with torch.cuda.stream(producer):
            buf.fill_(-1.0)  # must never be enqueued

    with pytest.raises(EarlyReuseError) as info:
        produce_next()
    torch.cuda.synchronize()
    assert bool((held == 7.0).all()), "the slot was overwritten"
    assert (info.value.slot, info.value.generation, info.value.min_depth) == (0, 1, 2)
    assert ring.stats.gpu_waits == waits and ring.held == 1
    ring.release(held, consumer)


def _k_forwards_k_backwards(dev, *, guard: bool, release_after_backward: bool, k: int = 4, n: int = 2):
    """K microbatch forwards through a bf16 linear reading a dispatch slot, then K backwards."""
    tokens, hidden = 256, 128
    gen = torch.Generator(device=dev).manual_seed(1)
    xs = [torch.randn(tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(k)]
    grads = [torch.randn(tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(k)]
    weight = torch.randn(hidden, hidden, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
    pool = BufferPool(dev)
    pool.register("dispatch_output", policy="ring", num_slots=n, max_shape=(tokens, hidden), dtype=torch.bfloat16)
    comm, comp = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)
    comm.wait_stream(comp)
    outs, bufs = [], []
    with pool.autograd_guard() if guard else contextlib.nullcontext():
        for i in range(k):
            d = pool.acquire("dispatch_output", (tokens, hidden), comm)
            # A dispatch kernel writes the slot by pointer (DeepEP, TE out=): no version-counter bump.
            with torch.cuda.stream(comm), torch.autograd._unsafe_preserve_version_counter(d):
                d.copy_(xs[i])
            comp.wait_stream(comm)
            outs.append(F.linear(d, weight))  # saves d (a view of the slot) for grad of weight
            bufs.append(d)
            if not release_after_backward:
                pool.release("dispatch_output", d, comp)  # the wrong release point: right after the forward
    for i in range(k):
        outs[i].backward(grads[i])
        if release_after_backward:
            pool.release("dispatch_output", bufs[i], comp)
    torch.cuda.synchronize()
    reference = sum(g.float().T @ x.float() for g, x in zip(grads, xs, strict=True))
    overwritten = sum(grads[i].float().T @ xs[i + n * ((k - 1 - i) // n)].float() for i in range(k))
    return weight.grad.float(), reference, overwritten


def test_bf16_linear_from_small_ring_release_point_matters(dev):
    """Autograd is a reader: a bf16 linear saves its input (a slot view) for backward. Releasing the slot
    after the forward lets microbatch i + N overwrite what backward i reads. The guard refuses that
    release; without the guard the weight gradient is silently computed from the later microbatches."""
    with pytest.raises(SavedForBackwardError, match="slot 0 generation 1"):
        _k_forwards_k_backwards(dev, guard=True, release_after_backward=False)

    wrong, reference, overwritten = _k_forwards_k_backwards(dev, guard=False, release_after_backward=False)
    tol = {"rtol": 2e-2, "atol": 2.0}
    assert not torch.allclose(wrong, reference, **tol), "gradients survived an overwrite?"
    assert torch.allclose(wrong, overwritten, **tol), "backward i should have read microbatch i + N"

    right, reference, _ = _k_forwards_k_backwards(dev, guard=True, release_after_backward=True, n=4)
    assert torch.allclose(right, reference, **tol)


def test_debug_watchdog_names_ring_and_slot_of_stuck_wait(dev):
    pool = BufferPool(dev, debug=True, watchdog_s=0.05)
    pool.register("expert_fc2_output", policy="ring", num_slots=1, max_shape=(64, 64), dtype=torch.float32)
    producer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    buf = pool.acquire("expert_fc2_output", (64, 64), producer)
    consumer.wait_stream(producer)
    with torch.cuda.stream(consumer):
        torch.cuda._sleep(400 * _CYCLES_PER_MS)  # a consumer that takes ~0.4 s
    pool.release("expert_fc2_output", buf, consumer)
    again = pool.acquire("expert_fc2_output", (64, 64), producer)  # GPU wait on the slow consumer
    deadline = time.monotonic() + 5
    while not pool.watchdog.reports and time.monotonic() < deadline:
        time.sleep(0.01)
    torch.cuda.synchronize()
    pool.release("expert_fc2_output", again, producer)
    pool.close()
    assert pool.watchdog.reports, "the watchdog did not report a 0.4 s wait with a 0.05 s threshold"
    report = pool.watchdog.reports[0]
    assert "ring 'expert_fc2_output'" in report and "slot 0" in report and "generation 1" in report


@pytest.mark.parametrize("depth", ["fixed", "auto"])
def test_replay_eager_replay_eager_two_streams_bit_equal_every_round(dev, depth):
    micro, tokens, hidden = 4, 512, 256
    pool = BufferPool(dev)
    auto = {"num_slots": "auto", "initial_slots": 1, "max_bytes": 1 << 30}
    for name in ("dispatch_output", "expert_fc2_output"):
        slots = {"num_slots": 2} if depth == "fixed" else auto
        pool.register(name, policy="ring", max_shape=(tokens, hidden), dtype=torch.float32, **slots)
        deeper = [pool.acquire(name) for _ in range(2)]  # a warm-up holding two at once: auto grows to 2
        for t in deeper:
            pool.release(name, t)
    comm, comp, cur = torch.cuda.Stream(dev), torch.cuda.Stream(dev), torch.cuda.current_stream(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    inputs = [torch.randn(micro, tokens, hidden, device=dev, generator=gen) for _ in range(8)]
    w = torch.randn(hidden, hidden, device=dev, generator=gen)
    x, out = torch.empty_like(inputs[0]), torch.empty(micro, tokens, hidden, device=dev)
    x_e, out_e = torch.empty_like(x), torch.empty_like(out)

    expected = []
    for inp in inputs:  # eager reference and warm-up (auto depth grows here)
        x.copy_(inp)
        _step(pool, x, w, out, comm, comp)
        expected.append(out.clone())
    torch.cuda.synchronize()
    graph, capture_stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    with pool.graph_capture(capture_stream), torch.cuda.graph(graph, stream=capture_stream):
        _step(pool, x, w, out, comm, comp)
    for rnd in range(3):
        r_in, e_in = (2 * rnd) % 8, (2 * rnd + 1) % 8
        pool.before_replay(cur)  # round 0: right after the capture, a no-op
        x.copy_(inputs[r_in])
        graph.replay()
        pool.after_replay(cur)
        x_e.copy_(inputs[e_in])
        _step(pool, x_e, w, out_e, comm, comp, slow_ms=20, join=False)  # slow readers, not joined to cur
        pool.before_replay(cur)  # the next replay must wait for those readers' release events
        x.copy_(inputs[(r_in + 2) % 8])
        graph.replay()
        pool.after_replay(cur)
        torch.cuda.synchronize()
        assert torch.equal(out_e, expected[e_in]), f"round {rnd}: eager step read a slot the replay overwrote"
        assert torch.equal(out, expected[(r_in + 2) % 8]), f"round {rnd}: replay differs from eager"
    stats = pool.stats()
    if depth == "auto":
        assert {s.settled_slots for s in stats.values()} == {2} and {s.grown for s in stats.values()} == {1}


def _schedule_grads(dev, schedule: str, pool: BufferPool | None, *, slow_ms: int = 20) -> torch.Tensor:
    """Weight gradient of a bf16 linear fed from the dispatch buffer over ``schedule`` ("F0 F1 B0 ...").

    Dispatch writes by pointer on comm (no version-counter bump); forward and backward run on comp, each
    backward behind a ``slow_ms`` sleep, so a slot released at its forward would be overwritten first.
    """
    tokens, hidden = 256, 128
    gen = torch.Generator(device=dev).manual_seed(2)
    xs = [torch.randn(tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(4)]
    weight = torch.randn(hidden, hidden, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
    comm, comp = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    comm.wait_stream(torch.cuda.current_stream(dev))
    comp.wait_stream(torch.cuda.current_stream(dev))
    losses: dict[int, torch.Tensor] = {}
    with torch.cuda.stream(comp):
        for op in schedule.split():
            m = int(op[1:])
            if op[0] == "B":
                torch.cuda._sleep(slow_ms * _CYCLES_PER_MS)
                losses.pop(m).backward()
                continue
            if pool is None:
                with torch.cuda.stream(comm):
                    d = torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16)
            else:
                d = pool.acquire("dispatch_output", (tokens, hidden), comm)
            with torch.cuda.stream(comm), torch.autograd._unsafe_preserve_version_counter(d):
                d.copy_(xs[m])
            comp.wait_stream(comm)
            with pool.track_saved() if pool is not None else contextlib.nullcontext():
                y = F.linear(d, weight)  # saves d for weight's gradient
            if pool is None:
                d.record_stream(comp)
            else:
                pool.release_when_unsaved("dispatch_output", d, comp)
            losses[m] = (y.float() * (m + 1)).sum()
    torch.cuda.synchronize()
    return weight.grad.clone()


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
@pytest.mark.parametrize(
    ("schedule", "slots"), [("F0 B0 F1 B1 F2 B2", 1), ("F0 F1 B0 F2 B1 F3 B2 B3", 2), ("F0 F1 F2 B0 B1 B2", 3)]
)
def test_release_when_unsaved_bf16_schedule_bit_equal_to_torch_empty(dev, schedule, slots, debug, monkeypatch):
    monkeypatch.delenv("BUFREUSE_DEBUG", raising=False)
    expected = _schedule_grads(dev, schedule, None)
    pool = BufferPool(dev, debug=debug)
    pool.register("dispatch_output", policy="ring", num_slots=slots, max_shape=(256, 128), dtype=torch.bfloat16)
    got = _schedule_grads(dev, schedule, pool)
    assert torch.equal(got, expected), "ring gradients differ from torch.empty buffers"
    ring = pool.get("dispatch_output")
    assert ring.held == 0 and ring.stats.deferred_releases == len(schedule.split()) // 2
    assert ring.stats.gpu_waits > 0
    pool.close()


def test_hold_keeps_next_producer_off_the_slot_until_done(dev):
    pool = BufferPool(dev)
    pool.register("dispatch_output", policy="ring", num_slots=1, max_shape=(1024, 1024), dtype=torch.float32)
    comm, side = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    d = pool.acquire("dispatch_output", None, comm)
    with torch.cuda.stream(comm):
        d.fill_(3.0)
    hold = pool.hold("dispatch_output", d)
    assert pool.release_when_unsaved("dispatch_output", d, comm) is False
    side.wait_stream(comm)
    seen = torch.empty(1024, 1024, device=dev)
    with torch.cuda.stream(side):  # a wgrad-like deferred reader, slow, on its own stream
        torch.cuda._sleep(100 * _CYCLES_PER_MS)
        seen.copy_(d)
    with pytest.raises(EarlyReuseError, match="1 hold"):
        pool.acquire("dispatch_output", None, comm)
    hold.done(side)
    again = pool.acquire("dispatch_output", None, comm)  # comm waits on side's release event
    with torch.cuda.stream(comm):
        again.fill_(-1.0)
    torch.cuda.synchronize()
    assert bool((seen == 3.0).all()), "the next producer overwrote the slot before the held reader read it"
    pool.release("dispatch_output", again, comm)


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_acquire_under_an_unprepared_capture_raises_in_both_modes(dev, debug, monkeypatch):
    """A per-layer CUDA graph capturing an eager ring: refused before the slot is handed out."""
    from bufreuse.pool import CaptureStateError

    monkeypatch.delenv("BUFREUSE_DEBUG", raising=False)
    pool = BufferPool(dev, debug=debug)
    pool.register("dispatch_output", policy="ring", num_slots=2, max_shape=(64, 64), dtype=torch.float32)
    pool.release("dispatch_output", pool.acquire("dispatch_output"))  # eager use first (control: works)
    torch.cuda.synchronize()
    g, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    with pytest.raises(CaptureStateError, match="without prepare_capture"), torch.cuda.graph(g, stream=stream):
        pool.acquire("dispatch_output")
    assert pool.get("dispatch_output").held == 0
    with pool.graph_capture(stream), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):  # prepared: fine
        pool.release("dispatch_output", pool.acquire("dispatch_output"))
    pool.close()


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_same_stream_release_records_no_event_and_a_producer_on_another_stream_still_waits(dev, debug):
    """(i) A slot released on the stream that produced it records no event (stream order protects a next
    producer there); a next producer on another stream gets the event recorded late and waits for the slow
    reader. Without the late record it would wait on a never-recorded event (no wait) and overwrite early."""
    rows, cols = 512, 512
    ring = BufferRing("expert_fc2_output", 1, (rows, cols), torch.float32, dev, debug=debug)
    s, t = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    sums = torch.zeros(4, device=dev)
    torch.cuda.synchronize()
    for k in range(2):  # same stream: produced, read slowly and released on s; next producer on s too
        buf = ring.acquire((rows, cols), s)
        with torch.cuda.stream(s):
            buf.fill_(float(k + 1))
            torch.cuda._sleep(_CYCLES_PER_MS // 2)
            sums[k] = buf.sum()
        ring.release(buf, s)
    assert ring.stats.elided_events == 2 and ring.stats.late_records == 0 and ring.stats.gpu_waits == 0
    buf = ring.acquire((rows, cols), t)  # another stream: the elided event is recorded on s now, t waits on it
    with torch.cuda.stream(t):
        buf.fill_(100.0)
        sums[2] = buf.sum()
    ring.release(buf, t)  # produced on t, released on t: elision is off after the late record
    torch.cuda.synchronize()
    per = rows * cols
    assert sums.tolist()[:3] == [1.0 * per, 2.0 * per, 100.0 * per], "a producer overwrote the slot before its reader"
    assert ring.stats.late_records == 1 and ring.stats.gpu_waits == 1 and ring.stats.elided_events == 2
    assert ring._slots[0].wait_on is not None and not ring._slots[0].late  # recorded at release from now on


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_a_deferred_slots_reader_mark_is_recorded_late_when_its_last_reader_is_on_another_stream(dev, debug):
    """(ii) The forward reader of a deferred slot (a hold keeps it) leaves an unrecorded mark on its stream s; the
    hold finishes on t: the mark is recorded on s then (after the slow reader), t waits on it, and a producer on t
    cannot overwrite the slot early. Without the late mark record t would wait on a never-recorded event."""
    rows, cols = 512, 512
    ring = BufferRing("expert_fc2_output", 1, (rows, cols), torch.float32, dev, debug=debug)
    s, t = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    sums = torch.zeros(2, device=dev)
    torch.cuda.synchronize()
    buf = ring.acquire((rows, cols), s)
    hold = ring.hold(buf)
    with torch.cuda.stream(s):
        buf.fill_(1.0)
        torch.cuda._sleep(_CYCLES_PER_MS // 2)  # the slow forward reader
        sums[0] = buf.sum()
    assert not ring.release_when_unsaved(buf, s)  # deferred: the hold; the reader's mark on s is not recorded
    assert ring.stats.elided_events == 1 and ring.stats.late_records == 0
    hold.done(t)  # the last reader finished on t: the mark is recorded on s now, t waits on it
    nxt = ring.acquire((rows, cols), t)
    with torch.cuda.stream(t):
        nxt.fill_(100.0)
        sums[1] = nxt.sum()
    ring.release(nxt, t)
    torch.cuda.synchronize()
    per = rows * cols
    assert sums.tolist() == [1.0 * per, 100.0 * per], "a producer overwrote the slot before its forward reader"
    assert ring.stats.late_records == 1 and ring.stats.gpu_waits == 1
