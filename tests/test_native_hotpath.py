"""The C hot path (``bufreuse/native/hotpath.c``) against the Python reference it stands in for.

Every fast path is driven side by side with the Python method on two identical rings and must leave the same
state: counters, cursor, each slot's fields, and the same event records and waits on the same streams. The
CUDA side runs on CPU rings given fake device operations (streams and events are plain objects; the C code
calls whatever ``ring._ops`` holds), so the stream logic (same-stream elision, cross-stream record and wait,
the cases left to Python) is exercised here; the H200 runs the real one (tests/test_pool_gpu.py and every
hooked-layer test, in production mode, go through it). The layer tests run a real megatron-core layer with
the C path and with the Python path and compare outputs, gradients and every ring counter.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import random
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator

import pytest
import torch

from bufreuse import native
from bufreuse.integrations.core import Held
from bufreuse.pool import BufferPool, BufferRing, Phase, SavedForBackwardError
from bufreuse.pool._device import DeviceOps
from bufreuse.pool.tracking import _pack_unpack

HOT = native.hotpath()


def test_the_c_hot_path_builds_here() -> None:
    """CI and the H200 have a C compiler and Python's headers: the C path is what production runs there."""
    assert native.status() == "on" and HOT is not None
    assert BufferPool("cpu").hotpath is HOT
    assert BufferPool("cpu", debug=True).hotpath is None  # debug mode: the Python path, with its checks
    assert BufferPool("cpu", native=False).hotpath is None
    # a production pool's rings take the C path in their own acquire / release too (the dispatch path calls them)
    for debug, use_native, want in ((False, None, HOT), (True, None, None), (False, False, None)):
        pool = BufferPool("cpu", debug=debug, native=use_native)
        pool.register("x", policy="ring", num_slots=2, max_shape=(8, 4), dtype=torch.float32)
        assert pool.get("x")._hot is want


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """``native`` with no state: the next ``hotpath()`` builds (or refuses) again; restored afterwards."""
    saved = dict(native._state)
    native._reset()
    monkeypatch.setenv("BUFREUSE_CACHE_DIR", str(tmp_path / "cache"))
    yield tmp_path / "cache"
    native._reset()
    native._state.update(saved)


def test_without_a_compiler_the_python_path_runs(fresh_native, monkeypatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert native.status().startswith("unavailable: cannot run the C compiler")
    assert BufferPool("cpu").hotpath is None
    assert not list(fresh_native.glob("*.so"))  # nothing half-written


def test_a_failed_compile_leaves_nothing_and_says_why(fresh_native, monkeypatch) -> None:
    monkeypatch.setenv("CC", "cc -DBUFREUSE_BROKEN=1 -include /nonexistent/header.h")
    assert native.status().startswith("unavailable:") and "failed" in native.status()
    assert not list(fresh_native.iterdir()) or not list(fresh_native.glob("*.so"))


def test_bufreuse_native_0_turns_it_off(fresh_native, monkeypatch) -> None:
    monkeypatch.setenv("BUFREUSE_NATIVE", "0")
    assert native.status() == "off (BUFREUSE_NATIVE=0)"
    assert BufferPool("cpu").hotpath is None
    assert BufferPool("cpu", native=True).hotpath is None  # hotpath() itself is off


def test_the_build_is_cached_by_source_and_interpreter(fresh_native) -> None:
    path = native.build()
    assert path.parent == fresh_native and path.exists()
    mtime = path.stat().st_mtime_ns
    assert native.build() == path and path.stat().st_mtime_ns == mtime  # built once


# -- fake CUDA: streams, events, the operations the ring calls -------------------------------------------


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class _FakeOps(DeviceOps):
    """DeviceOps over named streams: its fields (what the C code reads: ``_raw``, ``_index``, ``_by_ptr``,
    ``capturing``, ``record``, ``wait``) set to fakes; its own Python methods (``current_stream``) kept."""

    __slots__ = ("capture", "current", "log")

    def __init__(self, log: list, streams: dict[int, _Named]) -> None:
        self.log, self._index, self.current, self.cuda, self.device = log, 0, 1, True, torch.device("cpu")
        self._by_ptr = streams
        self.capture = False
        self._raw = lambda index: self.current
        self.capturing = lambda: self.capture
        self.record = lambda event, stream: log.append(("record", event.name, stream.name))
        self.wait = lambda event, stream: log.append(("wait", event.name, stream.name))

    def current_stream(self):
        return self._by_ptr[self._raw(self._index)]

    def new_event(self):
        return _Named("spare")


def _fake_cuda_ring(name: str, slots: int = 3) -> tuple[BufferRing, _FakeOps, list]:
    ring = BufferRing(name, slots, (8, 4), torch.float32, "cpu", debug=False)
    log: list = []
    ops = _FakeOps(log, {1: _Named("compute"), 2: _Named("comm"), 3: _Named("side")})
    ring._cuda, ring._ops = True, ops
    for slot in ring._slots:
        slot.eager_event, slot.capture_event = _Named(f"e{slot.index}"), _Named(f"c{slot.index}")
    return ring, ops, log


def _name(x):
    return None if x is None else x.name


def _state(ring: BufferRing) -> dict:
    slots = [
        (
            s.live is None,
            None if s.live is None else tuple(s.live.shape),
            s.generation,
            _name(s.wait_on),
            _name(s.wait_stream),
            s.late,
            _name(s.made_on),
            s.saved_refs,
            s.holds,
            s.pending,
            [(_name(m[0]), _name(m[1]), m[2]) for m in s.marks],
        )
        for s in ring._slots
    ]
    return {"slots": slots, "stats": ring.stats, "cursor": ring.cursor, "held": ring.held, "elide": ring._elide}


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


def _retained(cycle: Callable[[int], None], calls: int, watched: list) -> tuple[int, bool]:
    """Bytes still allocated after ``calls`` more cycles (warm, collected), and whether ``watched``'s counts held."""
    import tracemalloc

    refs = [sys.getrefcount(x) for x in watched]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(calls):
        cycle(i)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return grown, [sys.getrefcount(x) for x in watched] == refs


@pytest.mark.parametrize("seed", range(12))
def test_acquire_and_release_match_the_python_reference(seed: int) -> None:
    """Random programs over three streams: acquisitions (a row prefix or the whole bound, the cursor's slot or
    the next free one), immediate releases, deferred ones (a saved reference counted, freed later), on the
    producer's stream or another: both rings end every step in the same state with the same event log."""
    rng = random.Random(seed)
    rings = {fast: _fake_cuda_ring(f"r{fast}") for fast in (False, True)}
    rings[True][0]._hot = HOT  # as BufferPool sets it in production mode: the saved references' release in C
    held: dict[bool, list] = {False: [], True: []}
    fast_releases = fast_acquires = fast_deferrals = fast_untracks = 0
    for _ in range(80):
        stream, rows, pick, saved = rng.choice([1, 1, 1, 2, 3]), rng.choice([8, 8, 5, 0, 3]), rng.random(), rng.random()
        acquire = rng.random() < 0.5
        for fast, (ring, ops, _log) in rings.items():
            ops.current = stream
            h = held[fast]
            if (acquire or not h) and ring.held < ring.num_slots:
                if fast:
                    t = HOT.acquire(ring, (rows, 4))
                    fast_acquires += t is not None
                    t = t if t is not None else ring.acquire((rows, 4))
                else:
                    t = ring.acquire((rows, 4))
                h.append([t, False])
                continue
            if not h:
                continue
            entry = h[int(pick * len(h))]
            t, deferred = entry
            slot = ring._slot_for(t, ring._storage_ptr)
            if deferred:  # autograd frees the saved reference on this stream: the deferred release completes
                done = HOT.untrack(ring, slot, slot.generation, ring._epoch) if fast else None
                fast_untracks += done is not None
                if done is None:
                    ring._untrack(slot, slot.generation, ring._epoch)
                h[:] = [e for e in h if e is not entry]
                continue
            if saved < 0.25:
                with ring._lock:
                    slot.saved_refs += 1
            if fast:
                now = HOT.release_when_unsaved(ring, t)
                fast_releases += now is not None
                fast_deferrals += now is False
                now = now if now is not None else ring.release_when_unsaved(t)
            else:
                now = ring.release_when_unsaved(t)
            if now:
                h[:] = [e for e in h if e is not entry]
            else:
                entry[1] = True
        a, b = rings[False], rings[True]
        assert _state(a[0]) == _state(b[0])
        assert a[2] == b[2]  # the same records and waits, on the same streams, in the same order
    assert fast_acquires > 5 and fast_releases > 5  # the C path did the work, not only its fallbacks
    assert fast_deferrals > 0 and fast_untracks > 0, (fast_deferrals, fast_untracks)


def test_each_fast_path_declines_what_python_must_do() -> None:
    """The cases the C code leaves to Python answer None and change nothing (state equal before and after)."""
    ring, ops, log = _fake_cuda_ring("r")
    t = HOT.acquire(ring, (8, 4))
    assert t is not None and ring.stats.acquisitions == 1  # positive control: the common case is taken
    before = _state(ring)
    assert HOT.acquire(ring, (9, 4)) is None  # beyond the bound: Python raises StaticShapeError
    for shape in ((8, 5), [8, 4], (8.0, 4)):  # another width, not the tuple form, not an int: Python's checks
        assert HOT.acquire(ring, shape) is None
    ops.capture = True
    assert HOT.acquire(ring, (8, 4)) is None  # a per-layer graph capturing an eager ring: Python raises
    ops.capture = False
    ops.current = 9  # a stream DeviceOps has not cached yet
    assert HOT.acquire(ring, (8, 4)) is None and HOT.release(ring, t) is None
    ops.current = 1
    assert HOT.release(ring, torch.empty(8, 4)) is None  # not an acquisition: Python raises ForeignTensorError
    slot = ring._slots[0]
    slot.saved_refs = 1
    assert HOT.release(ring, t) is None  # a saved reference: Python defers
    slot.saved_refs = 0
    slot.holds = 1
    assert HOT.release(ring, t) is None  # a hold: Python defers
    slot.holds = 0
    slot.marks.append((ops._by_ptr[2], _Named("m"), True))
    assert HOT.release(ring, t) is None  # a reader's mark to join: Python records and waits
    slot.marks.clear()
    assert HOT.acquire(ring, (2**70, 4)) is None  # beyond any integer: Python's StaticShapeError
    ring._phase = Phase.GRAPHED
    assert HOT.acquire(ring, (8, 4)) is None and HOT.release(ring, t) is None
    ring._phase = Phase.EAGER
    ring.debug = True
    assert HOT.acquire(ring, (8, 4)) is None and HOT.release(ring, t) is None
    ring.debug = False
    assert _state(ring) == before and log == []
    assert HOT.release(ring, t) is True and ring.held == 0
    # a producer on another stream must first record the elided release event: Python (_record_late)
    assert ring._slots[0].late and ring._slots[0].wait_stream.name == "compute"
    ring._cursor, ops.current = 0, 2
    state = _state(ring)
    assert HOT.acquire(ring, (8, 4)) is None and _state(ring) == state and log == []
    ring.acquire((8, 4))
    assert log == [("record", "e0", "compute"), ("wait", "e0", "comm")]
    # a wait the debug watchdog must be told of: Python (the slot now waits on a recorded event, not a late one)
    ring.release(ring._slots[0].live)
    ring._cursor, ops.current, ring._watchdog = 0, 1, object()
    log.clear()
    state = _state(ring)
    assert HOT.acquire(ring, (8, 4)) is None and _state(ring) == state and log == []
    ring._watchdog = None
    assert HOT.acquire(ring, (8, 4)) is not None and log == [("wait", "e0", "compute")]  # positive control


def test_peak_held_counts_fallback_allocations_as_python_does() -> None:
    """A full ring serving the allocator (``on_exhausted='allocate'``): the C acquire's peak counts them too. (Only
    parity: allocations happen only with every slot held, so a later slot acquisition cannot raise the peak past
    it; leaving the term out of the C code is an equivalent mutant, not in scripts/mutations.toml.)"""
    rings = []
    for fast in (False, True):
        ring = BufferRing(f"r{fast}", 2, (8, 4), torch.float32, "cpu", debug=False, on_exhausted="allocate")
        ring._warned = True
        held = [ring.acquire((8, 4)) for _ in range(4)]  # two slots, two allocations
        ring.release(held[0])
        t = HOT.acquire(ring, (8, 4)) if fast else ring.acquire((8, 4))
        assert t is not None and ring.stats.fallback_allocations == 2
        rings.append(ring)
    assert rings[0].stats == rings[1].stats and rings[1].stats.peak_held == 4


def test_the_fast_paths_leak_nothing_over_fake_streams() -> None:
    """Thousands of acquire / release pairs taking every stream branch (cross-stream waits, recorded releases):
    no memory retained and no reference kept on the streams (a missing decref of a key, a call's result or a
    stream shows here; positive control: scripts/mutations.toml's native-* entries)."""
    ring, ops, _ = _fake_cuda_ring("r")
    ops.record = lambda event, stream: object()  # a fresh result per call: leaking it would show
    ops.wait = lambda event, stream: object()
    ring._elide = False  # every release records, so every producer on the other stream waits
    streams = [ops._by_ptr[1], ops._by_ptr[2]]

    def cycle(i: int) -> None:
        ops.current = 1 + i % 2
        t = HOT.acquire(ring, (5, 4))
        assert t is not None and HOT.release(ring, t) is True

    for i in range(200):
        cycle(i)
    assert ring.stats.gpu_waits > 100  # the wait branch ran
    grown, refs_kept = _retained(cycle, 5000, streams)
    assert grown < 20_000 and refs_kept


def test_the_deferred_paths_decline_what_python_must_do() -> None:
    """The deferral and the saved reference's release leave to Python (None, nothing changed): a ring whose lock
    another thread holds (Python waits for it), no spare event for the reader's mark (Python makes one), a final
    release with a reader on another stream (Python waits on it), a capture phase, debug mode."""
    ring, ops, log = _fake_cuda_ring("r")
    ring._hot = HOT
    ring._spare_events.append(_Named("s0"))
    t = ring.acquire((8, 4))
    slot = ring._slots[0]
    slot.saved_refs = 1
    before = _state(ring)
    with _lock_held_elsewhere(ring):
        assert HOT.release_when_unsaved(ring, t) is None
        assert HOT.untrack(ring, slot, slot.generation, ring._epoch) is None
    assert _state(ring) == before
    for case in ("phase", "debug", "python pool"):
        if case == "phase":
            ring._phase = Phase.GRAPHED
        elif case == "debug":
            ring.debug = True
        else:
            ring._hot = None  # BufferPool(native=False): its saved references go back through Python's _untrack
        if case != "python pool":
            assert HOT.release_when_unsaved(ring, t) is None
        assert HOT.untrack(ring, slot, slot.generation, ring._epoch) is None
        ring._phase, ring.debug, ring._hot = Phase.EAGER, False, HOT
    assert _state(ring) == before
    spare = ring._spare_events.pop()
    assert HOT.release_when_unsaved(ring, t) is None and _state(ring) == before  # no spare event: Python's
    ring._spare_events.append(spare)
    assert HOT.release_when_unsaved(ring, t) is False  # positive control: deferred in C, an elided mark
    assert slot.pending and slot.marks == [(ops._by_ptr[1], spare, True)] and log == []
    slot.marks.append((ops._by_ptr[2], _Named("m2"), True))  # a reader on another stream
    state = _state(ring)
    assert HOT.untrack(ring, slot, slot.generation, ring._epoch) is None and _state(ring) == state
    slot.marks.pop()
    assert HOT.untrack(ring, slot, slot.generation, ring._epoch) is True  # positive control: released in C
    assert slot.live is None and not slot.pending and ring._spare_events == [spare] and log == []
    assert ring.stats.deferred_releases == 1 and ring.held == 0


def test_autograd_frees_c_saved_references_and_the_slot_with_them() -> None:
    """Real autograd on CPU: a slot saved inside the pool's region is packed by the C pack (a counted reference),
    released by ``release_when_unsaved`` in C (deferred), handed back by the C unpack, and freed with the saved
    variable after the backward that read it, by the C finalizer (Python's ``_untrack`` not called; in debug mode,
    the positive control, it is). A reacquired slot raises at unpack, in Python's words."""
    results = {}
    for mode in ("c", "debug", "native=False"):
        pool = BufferPool("cpu", debug=mode == "debug", native=mode != "native=False")
        pool.register("x", policy="ring", num_slots=3, max_shape=(8, 4), dtype=torch.float32)
        ring = pool.get("x")
        calls: dict[str, int] = {"_track": 0, "_untrack": 0}
        for name in calls:
            reference = getattr(ring, name)
            setattr(ring, name, lambda *a, n=name, f=reference, c=calls: (c.__setitem__(n, c[n] + 1), f(*a))[1])
        w = torch.randn(4, requires_grad=True)
        first = pool.acquire("x", (8, 4))
        slot = pool.acquire("x", (8, 4))  # the storage's second slot: the pack finds it by the offset
        slot.copy_(torch.arange(32.0).view(8, 4))
        with pool.track_saved():
            out = slot[2:] * w  # saves a view of the slot for w's gradient
        assert [s.saved_refs for s in ring._slots] == [0, 1, 0]
        assert pool.release_when_unsaved("x", slot) is False and ring.held == 2
        out.sum().backward()
        assert torch.equal(w.grad, torch.arange(32.0).view(8, 4)[2:].sum(0))
        pool.release_when_unsaved("x", first)
        results[mode] = (ring.held, ring._slots[1].saved_refs, ring.stats.deferred_releases, calls)
    assert results["c"] == (0, 0, 1, {"_track": 0, "_untrack": 0})  # C: counted and released, no Python call
    # positive controls: debug mode, and a pool kept on the Python path, go through Python's
    assert results["debug"] == results["native=False"] == (0, 0, 1, {"_track": 1, "_untrack": 1})

    pool = BufferPool("cpu")
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
    thread holds the ring's lock, the C finalizer leaves the release to Python's ``_untrack``, which waits for the
    lock: the slot stays held until the lock is given back, then is released. Without contention (the positive
    control) the same backward releases it in C, with no Python call."""
    for contended in (False, True):
        pool = BufferPool("cpu")
        pool.register("x", policy="ring", num_slots=2, max_shape=(8, 4), dtype=torch.float32)
        ring = pool.get("x")
        calls = []
        reference = ring._untrack
        ring._untrack = lambda *a, calls=calls, reference=reference: (calls.append(a), reference(*a))[1]
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
                assert backward.is_alive() and ring.held == 1  # waiting for the lock in Python's _untrack
        backward.join(10)
        assert not backward.is_alive() and ring.held == 0 and ring.stats.deferred_releases == 1
        assert len(calls) == (1 if contended else 0), calls


def test_an_error_under_the_lock_is_raised_as_python_raises_it_and_the_lock_given_back() -> None:
    """A failing event record inside the C deferral raises the record's own error (as Python's ``_mark`` does), not
    the lock release's, and leaves the ring's lock free for other threads."""
    errors = {}
    for fast in (False, True):
        ring, ops, _ = _fake_cuda_ring(f"r{fast}")
        ring._spare_events.append(_Named("s0"))
        ring._elide = False  # the mark is recorded now
        t = ring.acquire((8, 4))
        ring._slots[0].saved_refs = 1

        def fail(event, stream):
            raise RuntimeError("record failed")

        ops.record = fail
        with pytest.raises(RuntimeError, match="record failed") as caught:
            HOT.release_when_unsaved(ring, t) if fast else ring.release_when_unsaved(t)
        errors[fast] = type(caught.value)
        free = []
        other = threading.Thread(target=lambda ring=ring, free=free: free.append(ring._lock.acquire(blocking=False)))
        other.start()
        other.join()
        assert free == [True]
    assert errors[True] is errors[False] is RuntimeError


def test_the_deferred_paths_leak_nothing() -> None:
    """Thousands of deferrals and saved-reference releases in C over two streams (marks elided and recorded, final
    releases elided and recorded): no memory retained, no reference kept on the streams or events."""
    ring, ops, _ = _fake_cuda_ring("r")
    ring._hot = HOT
    ops.record = lambda event, stream: object()  # fresh results, kept by nothing (the fake's log would grow)
    ops.wait = lambda event, stream: object()
    ring._spare_events.extend(_Named(f"s{i}") for i in range(2))
    streams = [ops._by_ptr[1], ops._by_ptr[2]]
    done = {"defer": 0, "untrack": 0}

    def cycle(i: int) -> None:
        ops.current = 1 + (i // 2) % 2
        ring._elide = i % 3 != 0
        t = HOT.acquire(ring, (5, 4))
        t = ring.acquire((5, 4)) if t is None else t  # a wait on an elided event: Python's
        slot = ring._slot_for(t, ring._storage_ptr)
        with ring._lock:
            slot.saved_refs += 2
        assert HOT.release_when_unsaved(ring, t) is False
        for _ in range(2):
            assert slot.pending and slot.live is not None  # held while a saved reference is left
            r = HOT.untrack(ring, slot, slot.generation, ring._epoch)
            done["untrack"] += r is True
            if r is None:
                ring._untrack(slot, slot.generation, ring._epoch)
        assert slot.live is None and not slot.pending
        done["defer"] += 1

    for i in range(200):
        cycle(i)
    assert done["untrack"] > 300  # the C release did most of them
    grown, refs_kept = _retained(cycle, 3000, [*streams, *ring._spare_events])
    assert grown < 20_000 and refs_kept


def test_held_release_is_helds() -> None:
    """``held_release``: once; an immediate release and a deferred one in C; ``deferred`` as Python's."""
    pool = BufferPool("cpu")
    pool.register("x", policy="ring", num_slots=2, max_shape=(8, 4), dtype=torch.float32)
    ring = pool.get("x")
    a, b = (Held(pool, "x", ring.acquire((8, 4)), ring) for _ in range(2))
    ring._slots[1].saved_refs = 1
    python_calls = []
    reference = ring.release_when_unsaved
    ring.release_when_unsaved = lambda t, s=None: (python_calls.append(t), reference(t, s))[1]
    HOT.held_release(a)
    assert python_calls == []  # released in C
    HOT.held_release(b)
    assert python_calls == []  # deferred in C too
    del ring.release_when_unsaved
    assert (a.released, a.deferred, b.released, b.deferred) == (True, False, True, True)
    assert ring.stats.deferred_releases == 1 and ring.held == 1
    HOT.held_release(a)  # once
    assert ring.stats.releases == 1
    ring._untrack(ring._slots[1], ring._slots[1].generation, ring._epoch)
    assert ring.held == 0
    other = BufferPool("cpu")
    other.register("y", policy="record-stream", num_slots=0, max_shape=(8, 4), dtype=torch.float32)
    c = Held(other, "y", other.acquire("y", (8, 4)))
    HOT.held_release(c)  # an allocator policy: its own release_when_unsaved
    assert c.released and not c.deferred and other.stats()["y"].releases == 1


def test_pack_matches_the_python_pack() -> None:
    """The C pack hook returns what the Python one returns: a counted reference for a view of a held slot (any
    view, any ring), the tensor itself otherwise (other memory, no data pointer, not a tensor)."""
    pool = BufferPool("cpu")
    for name in ("x", "y"):
        pool.register(name, policy="ring", num_slots=2, max_shape=(8, 4), dtype=torch.float32)
    index = pool._rings_by_storage
    packs = {"python": _pack_unpack(index, False)[0], "c": HOT.Pack(index.spans, False)}
    assert type(packs["c"]) is HOT.Pack and pool.track_saved()._push.args[0].__class__ is HOT.Pack
    x, y = pool.acquire("x", (8, 4)), pool.acquire("y", (5, 4))
    cases = [x, x[3:], x.view(-1)[7:], y, y.t(), torch.empty(8, 4), torch.empty(0), 7, "text"]
    kept = []
    for case in cases:
        got = {k: p(case) for k, p in packs.items()}
        kept.append(got)
        if isinstance(case, torch.Tensor) and pool.is_ring_storage(case) and case.numel():
            a, b = got["python"], got["c"]
            assert type(a).__name__ == type(b).__name__ == "_SavedRef" and a.slot is b.slot and b.tensor is case
        else:
            assert got["python"] is case and got["c"] is case
    assert pool.get("x")._slots[0].saved_refs == 2 * 3  # three views of x's slot, packed by each
    kept.clear()  # autograd frees them: counted down
    assert pool.get("x")._slots[0].saved_refs == 0
    pool.get("x")._slots[1].live = None  # strict mode: a released slot's alias is refused by both
    strict = {"python": _pack_unpack(index, True)[0], "c": HOT.Pack(index.spans, True)}
    stale = pool.get("x")._slots[1].base
    for p in strict.values():
        with pytest.raises(SavedForBackwardError, match="released slot"):
            p(stale)


def _megatron() -> None:
    pytest.importorskip("megatron.core")  # the layer tests only: the rest of this file needs torch alone


def _layer_run(native: bool, seeds: range):
    _megatron()
    from megatron_cpu import cpu_moe_layer, install_exercising_rings
    from test_hot_path import TOKENS, _knobs, _step

    torch.manual_seed(0)
    layer = cpu_moe_layer(8, "alltoall", 32)
    pool = BufferPool("cpu", native=native, debug=False)
    out = []
    with install_exercising_rings(layer, pool, _knobs(), tokens=TOKENS):
        assert (pool.hotpath is not None) is native
        stage = layer.token_dispatcher.combine_postprocess
        assert (type(stage) is HOT.AfterStage) is native  # the C stage is the one installed, or the Python one
        assert copy.deepcopy(stage) is stage and copy.copy(stage) is stage  # as a function: a copied model shares it
        for seed in seeds:
            out.append(_step(layer, seed))
        regions = pool.track_saved().regions
    return out, pool.stats(), regions


def test_a_hooked_layer_gives_the_same_results_with_either_path(parallel) -> None:
    """Real megatron-core layer, both rings: outputs, input gradients, every ring counter and the saved-tensor
    regions entered are the same with the C path and with the Python one (production mode, both)."""
    (c_out, c_stats, c_regions), (py_out, py_stats, py_regions) = (
        _layer_run(native, range(5)) for native in (True, False)
    )
    for (yc, gc_), (yp, gp) in zip(c_out, py_out, strict=True):
        assert torch.equal(yc, yp) and torch.equal(gc_, gp)
    assert c_stats == py_stats and c_regions == py_regions
    assert c_stats["expert_fc2_output"].acquisitions == 5 and c_stats["expert_fc2_output"].releases == 5


@pytest.mark.filterwarnings("ignore")  # pytest keeps every warning megatron emits: objects that would grow here
def test_the_c_path_leaks_no_reference(parallel) -> None:
    """Reference counts of what the C code touches are the same before and after many layer calls, and no
    object accumulates (a missing decref in the C code shows here: scripts/mutations.toml's native-* entries)."""
    _megatron()
    from megatron_cpu import cpu_moe_layer, install_exercising_rings
    from test_hot_path import TOKENS, _knobs, _step

    layer = cpu_moe_layer(8, "alltoall", 32)
    pool = BufferPool("cpu", debug=False)
    with install_exercising_rings(layer, pool, _knobs(), tokens=TOKENS):
        ring = pool.get("expert_fc2_output")
        watched = [ring, pool, ring._slots[0], ring._slots[1], pool.track_saved(), ring._ops]
        for seed in range(40):  # warm: megatron's and torch's own caches fill on the first pass
            _step(layer, seed)
        gc.collect()
        before = [sys.getrefcount(o) for o in watched]
        objects = len(gc.get_objects())
        for seed in range(40):
            _step(layer, seed)
        gc.collect()
        after = [sys.getrefcount(o) for o in watched]
        grown = len(gc.get_objects()) - objects
    assert after == before and grown < 40


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_the_te_module_route_is_the_same_in_c(native: bool) -> None:
    """The FC2 route (fake TE ``GroupedLinear`` with upstream's signature plus ``out=``): the slot is TE's output,
    queued with its byte span, the refusals as in Python, and the C route leaks nothing over many calls."""
    from fakes import te_grouped_linear as te
    from test_integrations_adapters import TOKENS, _fc2_case

    from bufreuse.config import BufReuseConfig
    from bufreuse.errors import ConfigError
    from bufreuse.integrations.core import Installation
    from bufreuse.integrations.te.out_route import ROUTE, Fc2Route, route_into_ring
    from bufreuse.pool import StaticShapeError

    hidden, splits, name, _, fc2, ref = _fc2_case()
    pool = BufferPool("cpu", native=native)
    pool.register(name, policy="ring", num_slots=2, max_shape=(32, 8), dtype=torch.float32)
    got: deque = deque()
    inst = Installation(pool=pool, knobs=BufReuseConfig(), tokens=TOKENS)
    route = Fc2Route(pool, name, 8, got, te.GroupedLinear.forward)
    route_into_ring(inst, fc2, route)
    forward = vars(fc2._bufreuse_shim)["forward"]
    assert (type(forward) is HOT.IntoRing) is native
    y, _ = fc2(hidden, splits)
    held = got[0]
    assert torch.equal(y, ref) and y.data_ptr() == held.tensor.data_ptr() == held.lo and pool.owns(name, held.tensor)
    assert held.hi == held.lo + y.nbytes and not held.released and held.entry is pool.get(name)
    HOT.held_release(got.popleft())
    with pytest.raises(StaticShapeError, match=r"holds torch\.float32"):  # a dtype refusal: Python's words
        fc2(hidden.double(), splits)
    with pytest.raises(ConfigError, match="out="):
        fc2._bufreuse_shim.forward(fc2, hidden, splits, out=torch.empty(TOKENS, 8))
    with pytest.raises(IndexError):  # a 0-d input: its shape[0] raises, in C as in Python, before any acquisition
        fc2._bufreuse_shim.forward(fc2, torch.tensor(1.0), splits)
    assert pool.get(name).held == 0 and not got
    if native:  # rows that are not a plain int (a symbolic size): the C shim hands the call to Python untouched

        class _Rows(int):
            pass

        class _Sym:
            dtype, shape = torch.float32, (_Rows(TOKENS), 8)

        fallen = []
        shim = HOT.IntoRing(ROUTE, lambda *a, **k: fallen.append(a) or "python", Held, lambda: None)
        assert shim(fc2, _Sym(), splits) == "python" and len(fallen) == 1 and pool.get(name).held == 0
        assert shim(fc2, hidden, splits) is not None and got and not fallen[1:]  # positive control: C took it
        got.popleft().release()
    ring = pool.get(name)
    for _ in range(3):
        fc2(hidden, splits)
        got.popleft().release()
    gc.collect()
    watched = [ring, route, fc2, hidden, splits, te.GroupedLinear.forward, Held, ring._slots[0]]
    before, objects = [sys.getrefcount(o) for o in watched], len(gc.get_objects())
    for _ in range(200):
        fc2(hidden, splits)
        got.popleft().release()
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before and len(gc.get_objects()) - objects < 40
    assert ring.stats.acquisitions == 204 + native and ring.held == 0  # the C path's own positive control: one more
    inst.uninstall()


def test_cycles_through_the_c_hooks_and_structs_are_collected() -> None:
    """The hook objects and the struct-backed classes take part in garbage collection: a cycle through their fields
    or their ``__dict__`` (``functools.wraps`` fills it) is freed, as it is for the Python functions they replace."""
    import weakref

    class Box:
        pass

    pool = BufferPool("cpu")

    def via_dict(hook, box):  # through the hook's __dict__
        hook.box = box

    def via_field(held, box):  # through a struct field
        held.entry = box

    def pack_with_spans():  # through the list a Pack field holds (only the Pack keeps it)
        spans: list = []
        pack = HOT.Pack(spans, False)
        pack_spans[id(pack)] = spans
        return pack

    def via_spans(pack, box):
        pack_spans.pop(id(pack)).append((0, 0, box, 0))

    pack_spans: dict = {}
    cases = [
        (lambda: HOT.AfterStage(lambda x: x, deque(), pool.track_saved()), via_dict),
        (lambda: HOT.IntoRing("_route", lambda *a: None, Held, lambda: None), via_dict),
        (pack_with_spans, via_spans),
        (lambda: Held(pool, "x", torch.empty(1), object(), (0, 1)), via_field),
    ]
    for make, attach in cases:
        box, hook = Box(), make()
        box.hook = hook
        attach(hook, box)
        alive = weakref.ref(box)
        del box, hook
        gc.collect()
        assert alive() is None, make
