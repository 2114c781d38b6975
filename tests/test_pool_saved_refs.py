"""Release by fact through real autograd on CPU: the pack counts a saved view of a held slot, autograd frees it
after the backward that read it (or with the graph), and the deferred release happens then, on whichever thread
freed it, under the ring's lock. Production mode, with debug mode on top where the path differs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from bufreuse.pool import BufferPool, BufferRing, SavedForBackwardError
from bufreuse.pool.tracking import _pack_unpack


@contextlib.contextmanager
def _lock_held_elsewhere(ring: BufferRing) -> Iterator[None]:
    """Another thread holds ``ring``'s lock for the block (as a Python section preempted inside it would)."""
    taken, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with ring._lock:
            taken.set()
            leave.wait(10)

    other = threading.Thread(target=hold)
    other.start()
    try:
        assert taken.wait(10)
        yield
    finally:
        leave.set()
        other.join()


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_autograd_frees_saved_references_and_the_slot_with_them(debug: bool) -> None:
    """A slot saved inside the pool's region is counted on its own slot (the storage's second slot: found by the
    offset), ``release_when_unsaved`` defers, and the saved variable's release after the backward that read it
    releases the slot (one ``_track``, one ``_untrack``). A reacquired slot raises at unpack."""
    pool = BufferPool("cpu", debug=debug)
    pool.register("x", policy="ring", num_slots=3, max_shape=(8, 4), dtype=torch.float32)
    ring = pool.get("x")
    calls: dict[str, int] = {"_track": 0, "_untrack": 0}
    for name in calls:
        reference = getattr(ring, name)
        setattr(ring, name, lambda *a, n=name, f=reference, c=calls: (c.__setitem__(n, c[n] + 1), f(*a))[1])
    w = torch.randn(4, requires_grad=True)
    first = pool.acquire("x", (8, 4))
    slot = pool.acquire("x", (8, 4))
    slot.copy_(torch.arange(32.0).view(8, 4))
    with pool.track_saved():
        out = slot[2:] * w  # saves a view of the slot for w's gradient
    assert [s.saved_refs for s in ring._slots] == [0, 1, 0]
    assert pool.release_when_unsaved("x", slot) is False and ring.held == 2
    out.sum().backward()
    assert torch.equal(w.grad, torch.arange(32.0).view(8, 4)[2:].sum(0))
    pool.release_when_unsaved("x", first)
    assert (ring.held, ring._slots[1].saved_refs, ring.stats.deferred_releases) == (0, 0, 1)
    assert calls == {"_track": 1, "_untrack": 1}

    pool = BufferPool("cpu", debug=debug)
    pool.register("x", policy="ring", num_slots=1, max_shape=(8, 4), dtype=torch.float32)
    w = torch.randn(4, requires_grad=True)
    slot = pool.acquire("x", (8, 4))
    with pool.track_saved():
        out = slot * w
    pool.get("x")._slots[0].generation += 1  # as if released and acquired again meanwhile
    with pytest.raises(SavedForBackwardError, match="acquired again"):
        out.sum().backward()


def test_a_backward_on_another_thread_waits_for_the_rings_lock_then_releases() -> None:
    """Autograd frees the saved reference on the thread that runs backward (CUDA: its device thread). While another
    thread holds the ring's lock, that release waits for the lock: the slot stays held until the lock is given back,
    then is released. Without contention (the positive control) the same backward releases it at once."""
    for contended in (False, True):
        pool = BufferPool("cpu")
        pool.register("x", policy="ring", num_slots=2, max_shape=(8, 4), dtype=torch.float32)
        ring = pool.get("x")
        w = torch.randn(4, requires_grad=True)
        slot = pool.acquire("x", (8, 4))
        with pool.track_saved():
            out = slot * w
        assert pool.release_when_unsaved("x", slot) is False
        del slot
        backward = threading.Thread(target=lambda out=out: out.sum().backward())
        with _lock_held_elsewhere(ring) if contended else contextlib.nullcontext():
            backward.start()
            if contended:
                backward.join(0.5)
                assert backward.is_alive() and ring.held == 1  # waiting for the lock
        del out
        backward.join(10)
        assert not backward.is_alive() and ring.held == 0 and ring.stats.deferred_releases == 1


def test_an_error_under_the_lock_is_raised_and_the_lock_given_back() -> None:
    """A failing event record inside the deferral (the reader's mark) raises the record's own error and leaves the
    ring's lock free for other threads."""
    from test_release_elision import _ring

    ring, ops = _ring(slots=2)
    ring._elide = False  # the mark is recorded now
    t = ring.acquire((4, 2))
    ring._slots[0].saved_refs = 1

    def fail(event, stream):
        raise RuntimeError("record failed")

    ops.record = fail
    with pytest.raises(RuntimeError, match="record failed"):
        ring.release_when_unsaved(t)
    free: list[bool] = []
    other = threading.Thread(target=lambda: free.append(ring._lock.acquire(blocking=False)))
    other.start()
    other.join()
    assert free == [True]


def test_peak_held_counts_fallback_allocations() -> None:
    """A full ring serving the allocator (``on_exhausted='allocate'``): the peak counts the allocations too."""
    ring = BufferRing("r", 2, (8, 4), torch.float32, "cpu", debug=False, on_exhausted="allocate")
    ring._warned = True
    held = [ring.acquire((8, 4)) for _ in range(4)]  # two slots, two allocations
    ring.release(held[0])
    assert ring.acquire((8, 4)) is not None and ring.stats.fallback_allocations == 2
    assert ring.stats.peak_held == 4


@pytest.mark.parametrize("strict", [False, True], ids=["counting", "strict"])
def test_pack_counts_views_of_held_slots_and_passes_everything_else(strict: bool) -> None:
    """The pack hook returns a counted reference for a view of a held slot (any view, any ring), the tensor itself
    otherwise (other memory, no data pointer, not a tensor); strict mode refuses a released slot's alias."""
    pool = BufferPool("cpu")
    for name in ("x", "y"):
        pool.register(name, policy="ring", num_slots=2, max_shape=(8, 4), dtype=torch.float32)
    pack = _pack_unpack(pool._rings_by_storage, strict)[0]
    x, y = pool.acquire("x", (8, 4)), pool.acquire("y", (5, 4))
    sx, sy = pool.get("x")._slots[0], pool.get("y")._slots[0]
    cases = [(x, sx), (x[3:], sx), (x.view(-1)[7:], sx), (y, sy), (y.t(), sy)]
    cases += [(torch.empty(8, 4), None), (torch.empty(0), None), (7, None), ("text", None)]
    kept = []
    for case, slot in cases:
        got = pack(case)
        kept.append(got)
        if slot is not None:
            assert type(got).__name__ == "_SavedRef" and got.tensor is case and got.slot is slot
        else:
            assert got is case
    assert pool.get("x")._slots[0].saved_refs == 3 and pool.get("y")._slots[0].saved_refs == 2
    kept.clear()  # autograd frees them: counted down
    assert pool.get("x")._slots[0].saved_refs == 0 and pool.get("y")._slots[0].saved_refs == 0
    pool.get("x")._slots[1].live = None  # a released slot: its alias passes through, or is refused (strict)
    stale = pool.get("x")._slots[1].base
    if strict:
        with pytest.raises(SavedForBackwardError, match="released slot"):
            pack(stale)
    else:
        assert pack(stale) is stale


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_empty_acquisitions_are_counted_and_never_deferred(debug: bool) -> None:
    """A zero-row acquisition (an all-to-all that sent this rank nothing) is counted in ``empty_acquisitions`` (ring,
    fallback allocation, allocator policy); a save of it inside the region is not counted (torch gives a zero-element
    tensor a null data pointer), so its release is never deferred and backward reads it after the slot was reused.
    Positive control: a one-row acquisition saved the same way is deferred."""
    pool = BufferPool("cpu", debug=debug)
    pool.register("r", policy="ring", num_slots=2, max_shape=(4, 3), dtype=torch.float32)
    w = torch.ones(3, requires_grad=True)
    outs = []
    for rows in (0, 1, 0):
        slot = pool.acquire("r", (rows, 3)).fill_(2.0)
        with pool.track_saved():
            outs.append((slot * w).sum())  # saves the slot for w's gradient
        released = pool.get("r").release_when_unsaved(slot)
        assert released is (rows == 0), rows
    assert pool.get("r").held == 1  # the one-row acquisition, deferred
    for _ in range(2):  # the empties' slot is handed out again (and overwritten) before their backward
        pool.release("r", pool.acquire("r", (4, 3)).fill_(9.0))
    for y in outs:
        y.backward()
    s = pool.stats()["r"]
    assert (s.acquisitions, s.empty_acquisitions, s.deferred_releases) == (5, 2, 1)
    assert pool.get("r").held == 0 and torch.equal(w.grad, torch.full((3,), 2.0))  # the saved row, not a 9
    other = BufferPool("cpu", debug=debug)
    other.register("f", policy="ring", num_slots=1, max_shape=(4, 3), dtype=torch.float32, on_exhausted="allocate")
    held = other.acquire("f", (2, 3))
    with pytest.warns(RuntimeWarning, match="caching allocator"):
        fallback = other.acquire("f", (0, 3))  # every slot held: the caching allocator serves it
    other.release("f", fallback)
    other.release("f", held)
    other.register("a", policy="stream-ordered", max_shape=(4, 3), dtype=torch.float32)
    other.release("a", other.acquire("a", (0, 3)))
    other.release("a", other.acquire("a", (4, 3)))
    stats = other.stats()
    assert (stats["f"].acquisitions, stats["f"].empty_acquisitions) == (2, 1)
    assert (stats["a"].acquisitions, stats["a"].empty_acquisitions) == (2, 1)
