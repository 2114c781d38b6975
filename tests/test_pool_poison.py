"""CPU tests of debug-mode poisoning: a slot that becomes free is filled, a stale reader sees it.

Production mode must do no extra work: the fill is counted by patching ``torch.Tensor.fill_`` (every
call on ring storage), with debug mode as the positive control in the same test.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from bufreuse.pool import BufferPool, BufferRing

BOUND = (8, 4)


@contextlib.contextmanager
def _count_ring_fills(monkeypatch, ring: BufferRing):
    """Count ``fill_`` calls whose target is storage of ``ring`` (what poisoning does, nothing else)."""
    calls: list[float] = []
    real = torch.Tensor.fill_
    ptrs = {s.untyped_storage().data_ptr() for s in ring._storages}

    def counting(self, value):
        if self.untyped_storage().data_ptr() in ptrs:
            calls.append(value)
        return real(self, value)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "fill_", counting)
        yield calls


def _expected_all_ones(dtype: torch.dtype, n: int) -> torch.Tensor:
    """The integer sentinel derived from its bytes: every byte 0xFF."""
    return torch.full((n * torch.empty((), dtype=dtype).element_size(),), 255, dtype=torch.uint8)


def test_debug_stale_read_after_release_shows_nan():
    ring = BufferRing("dispatch_output", 2, BOUND, torch.float32, "cpu", debug=True)
    buf = ring.acquire()
    buf.fill_(3.0)
    stale = buf[:4]  # a reader that keeps a view past the release
    ring.release(buf)
    assert torch.isnan(stale).all()


def test_production_stale_read_after_release_sees_old_data():
    ring = BufferRing("dispatch_output", 2, BOUND, torch.float32, "cpu", debug=False)
    buf = ring.acquire()
    buf.fill_(3.0)
    stale = buf[:4]
    ring.release(buf)
    assert torch.equal(stale, torch.full((4, 4), 3.0))  # plausible numbers: what poisoning is for
    assert ring.poisoned == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_debug_poison_is_nan_for_floating_dtypes(dtype):
    ring = BufferRing("expert_output", 1, BOUND, dtype, "cpu", debug=True)
    buf = ring.acquire()
    buf.zero_()
    stale = buf.detach()
    ring.release_when_unsaved(buf)
    assert torch.isnan(stale.float()).all()


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool])
def test_debug_poison_sets_every_bit_for_integer_dtypes(dtype):
    ring = BufferRing("routing_map", 1, BOUND, dtype, "cpu", debug=True)
    buf = ring.acquire()
    buf.zero_()
    stale = buf.detach()
    ring.release(buf)
    raw = stale.contiguous().view(torch.uint8).flatten() if dtype is not torch.bool else stale.to(torch.uint8) * 255
    assert torch.equal(raw.flatten(), _expected_all_ones(dtype, stale.numel()))


@pytest.mark.parametrize("debug", [False, True])
def test_poison_fills_once_per_release_in_debug_and_never_in_production(monkeypatch, debug):
    ring = BufferRing("dispatch_output", 2, BOUND, torch.float32, "cpu", debug=debug)
    rounds = 5
    with _count_ring_fills(monkeypatch, ring) as calls:
        for _ in range(rounds):
            a = ring.acquire()
            b = ring.acquire((3, 4))
            ring.release(a)
            ring.release_when_unsaved(b)
    releases = 2 * rounds
    assert len(calls) == (releases if debug else 0)
    assert ring.poisoned == len(calls)
    assert ring.stats.releases == releases


@pytest.mark.parametrize("debug", [False, True])
def test_poison_waits_for_the_last_saved_reader(monkeypatch, debug):
    """A release deferred by an autograd-saved reference poisons when the reference is freed, after
    the backward that read it: gradients equal the control, the slot is poisoned only then."""
    pool = BufferPool("cpu", debug=debug)
    pool.register("dispatch_output", policy="ring", num_slots=1, max_shape=BOUND, dtype=torch.float32)
    ring = pool.get("dispatch_output")
    weight = torch.randn(4, 5, requires_grad=True)
    src = torch.randn(*BOUND)
    with _count_ring_fills(monkeypatch, ring) as calls:
        buf = pool.acquire("dispatch_output")
        buf.copy_(src)
        with pool.track_saved():
            out = (buf @ weight).sum()  # matmul saves x (ring storage) for weight's gradient
        assert pool.release_when_unsaved("dispatch_output", buf) is False
        stale = buf.detach()
        assert torch.equal(stale, src) and calls == []  # deferred: nothing poisoned yet
        out.backward()
        del out
    assert torch.allclose(weight.grad, src.sum(0)[:, None].expand(4, 5))
    assert len(calls) == (1 if debug else 0)
    assert torch.isnan(stale).all() if debug else torch.equal(stale, src)


def test_debug_poison_waits_for_hold_done(monkeypatch):
    pool = BufferPool("cpu", debug=True)
    pool.register("dispatch_output", policy="ring", num_slots=2, max_shape=BOUND, dtype=torch.float32)
    buf = pool.acquire("dispatch_output")
    buf.fill_(2.0)
    hold = pool.hold("dispatch_output", buf)
    stale = buf.detach()
    assert pool.release_when_unsaved("dispatch_output", buf) is False
    assert torch.equal(stale, torch.full(BOUND, 2.0))  # the deferred reader still sees its data
    hold.done()
    assert torch.isnan(stale).all()


def test_debug_poison_keeps_the_version_counter():
    ring = BufferRing("dispatch_output", 1, BOUND, torch.float32, "cpu", debug=True)
    buf = ring.acquire()
    before = buf._version
    ring.release(buf)
    assert ring.poisoned == 1 and buf._version == before
