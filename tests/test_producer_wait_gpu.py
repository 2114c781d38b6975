"""The next producer of a ring slot waits, on the GPU, for the last consumer on another stream (issue 45 item 1).

The one thing a ring must never get wrong: ``BufferRing.acquire`` enqueues ``producer.wait_event(release event)``
(``self._ops.wait(event, stream)``, ``bufreuse/pool/ring.py``; the event was recorded by ``release`` /
``release_when_unsaved`` on the consumer's stream, or by the deferred release when autograd freed the last saved
reference). Without that wait nothing else orders the producer after the consumer in these tests: the producer
stream never joins the consumer stream, and each consumer sleeps (``torch.cuda._sleep``) before it reads, so a
producer that does not wait overwrites the slot first and the consumer reads the next round's value.

- a one-slot ring, producer on ``P``, a slow consumer on ``C`` that releases there: every read is the value its
  own producer wrote (production mode: no guard, no ``BUFREUSE_DEBUG``; debug mode: poisoning and the watchdog);
- the same with autograd as the last reader: a custom Function saves the slot, its backward sleeps on ``C`` and
  then reads it; the release is deferred to the moment autograd frees the saved reference (on ``C``), and the next
  producer on ``P`` waits on that event: every weight gradient is the one its own slot value gives;
- the positive control of the design: the same streams, sleeps and writes into one plain tensor with no wait do
  read a later round's value on this GPU (the race window is real, so the two tests above can fail).

``scripts/mutate.py --only producer-wait`` on a GPU shows the mutations ``ring-skips-producer-wait`` and
``ring-producer-wait-not-enqueued`` killed by this file. Run: ``bash scripts/gpu-tests.sh
tests/test_producer_wait_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from bufreuse.pool import BufferPool

pytestmark = pytest.mark.gpu

_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep spins in clock cycles; H100 and H200 run near 2 GHz
_SLOW_MS = 5  # each consumer's delay before it reads: far above a fill's few microseconds and the host's enqueue
ROUNDS, ROWS, COLS = 8, 256, 256
MODES = ["production", "debug"]


@pytest.fixture
def dev(monkeypatch) -> torch.device:
    monkeypatch.delenv("BUFREUSE_DEBUG", raising=False)  # each test sets its mode on the pool itself
    torch.cuda.synchronize()
    device = torch.device("cuda", torch.cuda.current_device())
    _warm(device)
    return device


def _warm(dev: torch.device) -> None:
    """Load every kernel these tests launch once, so that no lazy load stalls the host inside a timed loop."""
    x = torch.ones(ROWS, COLS, device=dev)
    torch.cuda._sleep(1)
    x.fill_(2.0)
    _ = x.sum() * x.new_ones(())
    torch.cuda.synchronize()


def _pool(dev: torch.device, mode: str) -> BufferPool:
    pool = BufferPool(dev, debug=mode == "debug")
    pool.register("dispatch_output", policy="ring", num_slots=1, max_shape=(ROWS, COLS), dtype=torch.float32)
    assert pool.debug is (mode == "debug") and pool.get("dispatch_output").debug is (mode == "debug")
    return pool


@pytest.mark.parametrize("mode", MODES)
def test_next_producer_waits_for_the_slow_consumer_on_another_stream(dev, mode):
    pool = _pool(dev, mode)
    producer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    sums = torch.zeros(ROUNDS, device=dev)
    written = [torch.cuda.Event() for _ in range(ROUNDS)]
    for i in range(ROUNDS):
        buf = pool.acquire("dispatch_output", (ROWS, COLS), producer)  # P waits on the last release (not on round 0)
        with torch.cuda.stream(producer):
            buf.fill_(float(i + 1))
            written[i].record(producer)
        consumer.wait_event(written[i])  # C reads after its producer wrote; P never joins C
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(_SLOW_MS * _CYCLES_PER_MS)
            sums[i] = buf.sum()
        pool.release("dispatch_output", buf, consumer)  # the release event, on C after the read
    torch.cuda.synchronize()
    want = [float((i + 1) * ROWS * COLS) for i in range(ROUNDS)]  # round i wrote i + 1 everywhere
    assert sums.tolist() == want, "a producer overwrote the slot before the consumer of the round before read it"
    stats = pool.stats()["dispatch_output"]
    assert stats.gpu_waits == ROUNDS - 1 and stats.elided_events == 0 and stats.releases == ROUNDS, stats
    pool.close()


class _SlowReader(torch.autograd.Function):
    """Saves ``slot`` for backward; the backward sleeps, then reads it: ``grad_w = grad * slot.sum()``."""

    @staticmethod
    def forward(ctx, slot: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot)
        return w * 1.0

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (slot,) = ctx.saved_tensors
        torch.cuda._sleep(_SLOW_MS * _CYCLES_PER_MS)
        return None, grad * slot.sum()


@pytest.mark.parametrize("mode", MODES)
def test_next_producer_waits_for_autograds_deferred_release(dev, mode):
    pool = _pool(dev, mode)
    producer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    weights = [torch.zeros((), device=dev, requires_grad=True) for _ in range(ROUNDS)]
    region = pool.autograd_guard() if mode == "debug" else pool.track_saved()
    for i in range(ROUNDS):
        buf = pool.acquire("dispatch_output", (ROWS, COLS), producer)
        with torch.cuda.stream(producer):
            buf.fill_(float(i + 1))
        consumer.wait_stream(producer)
        with torch.cuda.stream(consumer):
            with region:
                y = _SlowReader.apply(buf, weights[i])  # forward on C: autograd runs its backward on C too
            assert pool.release_when_unsaved("dispatch_output", buf, consumer) is False  # deferred: saved
            y.backward(torch.ones((), device=dev))  # sleeps, reads the slot; the saved reference is freed after
        del y
        assert pool.get("dispatch_output").held == 0, "the deferred release did not happen at the backward"
    torch.cuda.synchronize()
    got = [float(w.grad) for w in weights]
    assert got == [float((i + 1) * ROWS * COLS) for i in range(ROUNDS)], (
        "a producer overwrote the slot before the backward that saved it read it"
    )
    stats = pool.stats()["dispatch_output"]
    assert stats.deferred_releases == ROUNDS and stats.gpu_waits >= ROUNDS - 1, stats
    pool.close()


def test_without_a_wait_the_same_streams_read_a_later_rounds_value(dev):
    """Positive control: the tests above can fail. One plain buffer, written on P every round with no wait on C's
    reads: some consumer reads a value a later round wrote (the producer ran ahead during the sleep)."""
    buf = torch.empty(ROWS, COLS, device=dev)
    producer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    sums = torch.zeros(ROUNDS, device=dev)
    written = [torch.cuda.Event() for _ in range(ROUNDS)]
    for i in range(ROUNDS):
        with torch.cuda.stream(producer):
            buf.fill_(float(i + 1))
            written[i].record(producer)
        consumer.wait_event(written[i])
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(_SLOW_MS * _CYCLES_PER_MS)
            sums[i] = buf.sum()
    torch.cuda.synchronize()
    want = [float((i + 1) * ROWS * COLS) for i in range(ROUNDS)]
    wrong = sum(g != w for g, w in zip(sums.tolist(), want, strict=True))
    assert wrong >= ROUNDS // 2, f"only {wrong} of {ROUNDS} reads raced: the delay does not open the window here"
