"""GPU tests of debug-mode poisoning (``bash scripts/gpu-tests.sh tests/test_poison_gpu.py`` on the H200).

(a) the fill runs on the releasing stream after the final (slow) reader and before the next producer's
    write: the reader sees its data, a stale reader after the release sees NaN, the next consumer sees
    the next producer's data; production mode leaves the old data (and does no fill at all);
(b) a release deferred by autograd poisons only after the backward that read the slot: a bf16 linear
    fed from a 1-slot ring, slow backward, gradients bit-equal to ``torch.empty`` buffers in debug mode;
(c) under CUDA-graph capture the fill is captured with the release (capture-safe): every replay leaves
    the slot NaN, outputs equal the eager run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bufreuse.pool import BufferPool, BufferRing

pytestmark = pytest.mark.gpu

_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep spins in clock cycles; the H200 runs near 2 GHz


@pytest.fixture
def dev() -> torch.device:
    torch.cuda.synchronize()
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_poison_after_slow_reader_before_next_producer(dev, debug):
    rows, cols = 1024, 1024
    ring = BufferRing("dispatch_output", 1, (rows, cols), torch.float32, dev, debug=debug)
    producer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    buf = ring.acquire(None, producer)
    with torch.cuda.stream(producer):
        buf.fill_(3.0)
    stale = buf.detach()  # a reader that keeps a view past the release
    consumer.wait_stream(producer)
    seen = torch.empty(rows, cols, device=dev)
    with torch.cuda.stream(consumer):
        torch.cuda._sleep(100 * _CYCLES_PER_MS)  # a slow final reader
        seen.copy_(buf)
    ring.release(buf, consumer)  # the fill is enqueued on consumer, after the copy
    torch.cuda.synchronize()
    assert bool((seen == 3.0).all()), "the poison overtook the final reader"
    if debug:
        assert bool(stale.isnan().all()), "a stale read after the release did not see NaN"
    else:
        assert bool((stale == 3.0).all()) and ring.poisoned == 0
    again = ring.acquire(None, producer)  # producer waits on the release event, so after the fill
    with torch.cuda.stream(producer):
        torch.cuda._sleep(1)
        again.fill_(5.0)
    consumer.wait_stream(producer)
    with torch.cuda.stream(consumer):
        seen.copy_(again)
    ring.release(again, consumer)
    torch.cuda.synchronize()
    assert bool((seen == 5.0).all()), "the next producer's data was overwritten by the poison"
    assert ring.poisoned == (2 if debug else 0)


def _grads(dev, pool: BufferPool | None, *, slow_ms: int = 20) -> torch.Tensor:
    """Weight gradient over F0 B0 F1 B1 F2 B2: dispatch written by pointer on comm, a bf16 linear on comp
    saves the slot view, backward runs behind a sleep (a poison at the forward release would be read)."""
    tokens, hidden = 256, 128
    gen = torch.Generator(device=dev).manual_seed(3)
    xs = [torch.randn(tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(3)]
    weight = torch.randn(hidden, hidden, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
    comm, comp = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    comm.wait_stream(torch.cuda.current_stream(dev))
    comp.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(comp):
        for m in range(3):
            if pool is None:
                with torch.cuda.stream(comm):
                    d = torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16)
            else:
                d = pool.acquire("dispatch_output", (tokens, hidden), comm)
            with torch.cuda.stream(comm), torch.autograd._unsafe_preserve_version_counter(d):
                d.copy_(xs[m])
            comp.wait_stream(comm)
            if pool is None:
                y = F.linear(d, weight)
                d.record_stream(comp)
            else:
                with pool.track_saved():
                    y = F.linear(d, weight)
                assert pool.release_when_unsaved("dispatch_output", d, comp) is False
            loss = (y.float() * (m + 1)).sum()
            del y, d
            torch.cuda._sleep(slow_ms * _CYCLES_PER_MS)
            loss.backward()
            del loss
    torch.cuda.synchronize()
    return weight.grad.clone()


def test_debug_poison_after_deferred_release_keeps_gradients_bit_equal(dev, monkeypatch):
    monkeypatch.delenv("BUFREUSE_DEBUG", raising=False)
    expected = _grads(dev, None)
    pool = BufferPool(dev, debug=True)
    pool.register("dispatch_output", policy="ring", num_slots=1, max_shape=(256, 128), dtype=torch.bfloat16)
    got = _grads(dev, pool)
    ring = pool.get("dispatch_output")
    assert not bool(got.isnan().any()), "backward read a poisoned slot"
    assert torch.equal(got, expected)
    assert ring.poisoned == 3 and ring.held == 0
    assert bool(ring._slots[0].base.isnan().all()), "the last release did not poison the slot"
    pool.close()


def test_debug_poison_is_captured_with_the_release(dev, monkeypatch):
    monkeypatch.delenv("BUFREUSE_DEBUG", raising=False)
    tokens, hidden = 512, 256
    pool = BufferPool(dev, debug=True)
    pool.register("dispatch_output", policy="ring", num_slots=2, max_shape=(tokens, hidden), dtype=torch.float32)
    ring = pool.get("dispatch_output")
    gen = torch.Generator(device=dev).manual_seed(4)
    inputs = [torch.randn(tokens, hidden, device=dev, generator=gen) for _ in range(4)]
    w = torch.randn(hidden, hidden, device=dev, generator=gen)
    x, out = torch.empty(tokens, hidden, device=dev), torch.empty(tokens, hidden, device=dev)

    def step() -> None:
        d = pool.acquire("dispatch_output", (tokens, hidden))
        d.copy_(x * 2.0)
        out.copy_(d @ w)
        pool.release("dispatch_output", d)

    expected = []
    for inp in inputs:  # eager reference and warm-up
        x.copy_(inp)
        step()
        expected.append(out.clone())
    torch.cuda.synchronize()
    eager_fills = ring.poisoned
    assert eager_fills == len(inputs)
    graph, capture_stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    with pool.graph_capture(capture_stream), torch.cuda.graph(graph, stream=capture_stream):
        step()
    assert ring.poisoned == eager_fills + 1  # the fill was captured, not skipped
    for r, inp in enumerate(inputs):
        x.copy_(inp)
        ring._slots[0].base.fill_(0.0)  # the graph's slot (cursor 0): must end NaN after each replay
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected[r]), f"replay {r} differs from eager"
        assert bool(ring._slots[0].base.isnan().all()), f"replay {r} did not poison the released slot"
    pool.after_replay(torch.cuda.current_stream())
    pool.close()
