"""CPU tests of the pool's state machine: every transition and every error (events are no-ops on CPU)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from bufreuse.pool import (
    SLOT_ALIGN_BYTES,
    BufferPool,
    BufferReuseError,
    BufferRing,
    CaptureStateError,
    DoubleReleaseError,
    EarlyReuseError,
    ForeignTensorError,
    Hold,
    Phase,
    Policy,
    RingConfigError,
    RingStats,
    SavedForBackwardError,
    StaleAliasError,
    StaticShapeError,
    UnknownBufferError,
    Watchdog,
)

BOUND = (8, 4)


def _ring(n: int = 2, *, debug: bool = False) -> BufferRing:
    return BufferRing("dispatch_output", n, BOUND, torch.float32, "cpu", debug=debug)


def _state(ring: BufferRing) -> tuple:
    slots = tuple((s.live is not None, s.generation, s.saved_refs) for s in ring._slots)
    return (ring.cursor, ring.held, ring._generation, slots, ring.stats, ring.phase)


# --- acquire -----------------------------------------------------------------------------------------


def test_acquire_returns_fresh_tensor_views_of_slot_storage():
    ring = _ring(2)
    a = ring.acquire()
    b = ring.acquire()
    assert a.shape == BOUND and a.dtype == torch.float32 and not a.requires_grad
    assert a is not b and a.data_ptr() != b.data_ptr()
    assert ring.is_ring_storage(a) and ring.is_ring_storage(b)
    ring.release(a)
    c = ring.acquire()  # slot 0 again: same storage, new tensor object
    assert c is not a and c.data_ptr() == a.data_ptr()


def test_acquire_fewer_rows_allowed_and_zero_rows():
    ring = _ring(3)
    a = ring.acquire((5, 4))
    b = ring.acquire([0, 4])
    c = ring.acquire(torch.Size(BOUND))
    assert a.shape == (5, 4) and b.shape == (0, 4) and c.shape == BOUND
    assert ring.owns(a) and ring.owns(b) and ring.owns(c)


@pytest.mark.parametrize("shape", [(9, 4), (8, 5), (8,), (8, 4, 1), (-1, 4)])
def test_acquire_beyond_bound_raises_static_shape_error(shape):
    ring = _ring(2)
    before = _state(ring)
    with pytest.raises(StaticShapeError) as info:
        ring.acquire(shape)
    msg = str(info.value)
    assert "dispatch_output" in msg and str(BOUND) in msg and str(tuple(shape)) in msg
    assert _state(ring) == before


def test_acquire_other_dtype_raises_static_shape_error():
    ring = _ring(2)
    with pytest.raises(StaticShapeError, match="bfloat16"):
        ring.acquire(BOUND, dtype=torch.bfloat16)
    assert ring.held == 0


def test_acquire_all_held_raises_early_reuse_with_min_depth():
    ring = _ring(2)
    ring.acquire()
    ring.acquire()
    before = _state(ring)
    with pytest.raises(EarlyReuseError) as info:
        ring.acquire()
    err = info.value
    assert (err.ring, err.slot, err.generation, err.min_depth) == ("dispatch_output", 0, 1, 3)
    assert "slot 0" in str(err) and "generation 1" in str(err) and "at least 3" in str(err)
    assert "raise the slot count" in str(err)
    assert isinstance(err, BufferReuseError)
    assert _state(ring) == before


def test_acquire_skips_held_cursor_slot_when_another_is_free():
    ring = _ring(3)
    a, b, c = ring.acquire(), ring.acquire(), ring.acquire()
    ring.release(b)  # slot 1 free, cursor at slot 0 which is held
    d = ring.acquire()
    assert d.data_ptr() == b.data_ptr() and ring.cursor == 2
    ring.release(a)
    ring.release(c)
    ring.release(d)


def test_generations_increase_per_acquisition():
    ring = _ring(2)
    gens = []
    for _ in range(5):
        t = ring.acquire()
        gens.append(ring._slots[ring.slot_of(t)].generation)
        ring.release(t)
    assert gens == [1, 2, 3, 4, 5]


# --- release -----------------------------------------------------------------------------------------


def test_release_twice_raises_double_release():
    ring = _ring(2)
    a = ring.acquire()
    ring.release(a)
    before = _state(ring)
    with pytest.raises(DoubleReleaseError, match="slot 0"):
        ring.release(a)
    assert _state(ring) == before


def test_release_foreign_tensor_raises():
    ring = _ring(2)
    ring.acquire()
    before = _state(ring)
    with pytest.raises(ForeignTensorError, match="does not own"):
        ring.release(torch.empty(BOUND))
    with pytest.raises(ForeignTensorError):
        ring.release("not a tensor")  # type: ignore[arg-type]
    assert _state(ring) == before


def test_release_of_other_rings_tensor_is_foreign():
    ring, other = _ring(2), BufferRing("expert_fc2_output", 2, BOUND, torch.float32, "cpu")
    t = other.acquire()
    with pytest.raises(ForeignTensorError):
        ring.release(t)
    assert other.owns(t)


def test_release_stale_alias_raises_and_names_generation_in_debug():
    ring = _ring(1, debug=True)
    old = ring.acquire()
    ring.release(old)
    new = ring.acquire()
    before = _state(ring)
    with pytest.raises(StaleAliasError) as info:
        ring.release(old)
    assert "generation 1" in str(info.value) and "generation 2" in str(info.value)
    assert _state(ring) == before
    ring.release(new)


def test_release_view_of_live_acquisition_raises_stale_alias():
    ring = _ring(2)
    a = ring.acquire()
    with pytest.raises(StaleAliasError, match="view derived"):
        ring.release(a.view(-1))
    ring.release(a)


def test_stale_alias_probe_is_pure_and_not_owned():
    """An old alias met after its storage was re-acquired by a later operation (ScheduleNode.free_input)."""
    ring = _ring(2)
    old = ring.acquire()  # slot 0, generation 1
    ring.release(old)
    mid = ring.acquire()  # slot 1
    new = ring.acquire()  # slot 0 again, generation 3
    assert new.data_ptr() == old.data_ptr()
    before = _state(ring)
    for _ in range(3):
        assert ring.is_ring_storage(old)
        assert not ring.owns(old)
        assert ring.is_ring_storage(old.view(-1)[1:])
        assert ring.owns(new) and ring.owns(mid)
        assert not ring.owns(new.view(-1))
        assert not ring.is_ring_storage(torch.empty(BOUND))
    assert _state(ring) == before
    ring.release(new)
    ring.release(mid)


def test_pool_probe_stale_alias_across_buffers():
    pool = BufferPool("cpu")
    pool.register("dispatch_output", policy="ring", num_slots=1, max_shape=BOUND, dtype=torch.float32)
    pool.register("expert_fc2_output", policy="record-stream", max_shape=BOUND, dtype=torch.float32)
    old = pool.acquire("dispatch_output", BOUND)
    pool.release("dispatch_output", old)
    new = pool.acquire("dispatch_output", BOUND)
    plain = pool.acquire("expert_fc2_output", (2, 4))
    before = pool.stats()
    assert pool.is_ring_storage(old) and not pool.owns("dispatch_output", old)
    assert pool.owns("dispatch_output", new) and not pool.owns("expert_fc2_output", new)
    assert not pool.is_ring_storage(plain) and pool.owns("expert_fc2_output", plain)
    assert not pool.owns("nope", new)
    assert pool.stats() == before


# --- configuration and stats -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_slots", "shape", "dtype"),
    [
        (0, BOUND, torch.float32),
        (True, BOUND, torch.float32),
        (2, (), torch.float32),
        (2, (0, 4), torch.float32),
        (2, "ab", torch.float32),
        (2, BOUND, "float32"),
    ],
)
def test_ring_bad_config_raises(num_slots, shape, dtype):
    with pytest.raises(RingConfigError):
        BufferRing("r", num_slots, shape, dtype, "cpu")


def test_stats_and_persistent_bytes_are_slot_aligned():
    ring = BufferRing("r", 3, (5, 3), torch.bfloat16, "cpu")
    assert ring.slot_bytes == SLOT_ALIGN_BYTES and ring.persistent_bytes == 3 * SLOT_ALIGN_BYTES
    a = ring.acquire()
    b = ring.acquire((2, 3))
    ring.release(a)
    ring.release(b)
    ring.acquire()
    assert ring.stats == RingStats(
        acquisitions=3, releases=2, gpu_waits=0, peak_held=2, persistent_bytes=1536, settled_slots=3
    )
    assert (b.data_ptr() - a.data_ptr()) % SLOT_ALIGN_BYTES == 0


def test_pool_register_is_idempotent_and_rejects_conflicts():
    pool = BufferPool("cpu")
    pool.register("dispatch_output", policy=Policy.RING, num_slots=2, max_shape=BOUND, dtype=torch.float32)
    pool.register("dispatch_output", policy="ring", num_slots=2, max_shape=list(BOUND), dtype=torch.float32)
    with pytest.raises(RingConfigError, match="already registered"):
        pool.register("dispatch_output", policy="ring", num_slots=3, max_shape=BOUND, dtype=torch.float32)
    assert pool.names() == ["dispatch_output"] and pool.policy("dispatch_output") is Policy.RING


@pytest.mark.parametrize(
    ("policy", "num_slots"), [("ring", 0), ("record-stream", 2), ("stream-ordered", 1), ("lru", 0)]
)
def test_pool_register_bad_policy_or_slots_raises(policy, num_slots):
    pool = BufferPool("cpu")
    with pytest.raises(RingConfigError):
        pool.register("b", policy=policy, num_slots=num_slots, max_shape=BOUND, dtype=torch.float32)


def test_pool_unknown_buffer_raises():
    pool = BufferPool("cpu")
    with pytest.raises(UnknownBufferError, match="not registered"):
        pool.acquire("dispatch_output", BOUND)
    with pytest.raises(UnknownBufferError):
        pool.release("dispatch_output", torch.empty(BOUND))


def test_pool_stats_and_bytes_per_buffer():
    pool = BufferPool("cpu")
    pool.register("dispatch_output", policy="ring", num_slots=4, max_shape=(128, 8), dtype=torch.float32)
    pool.register("expert_fc2_output", policy="stream-ordered", max_shape=(128, 8), dtype=torch.float32)
    t = pool.acquire("expert_fc2_output", (16, 8))
    pool.release("expert_fc2_output", t)
    assert pool.persistent_bytes() == 4 * 4096
    assert pool.ring_bytes() == {"dispatch_output": 4 * 4096, "expert_fc2_output": 0}
    assert pool.slot_bytes() == {"dispatch_output": 4096, "expert_fc2_output": 0}
    stats = pool.stats()
    assert stats["expert_fc2_output"].acquisitions == 1 and stats["expert_fc2_output"].releases == 1
    assert stats["dispatch_output"].persistent_bytes == 4 * 4096


@pytest.mark.parametrize("policy", ["record-stream", "stream-ordered"])
def test_allocator_policies_state_and_errors(policy):
    pool = BufferPool("cpu")
    pool.register("b", policy=policy, max_shape=BOUND, dtype=torch.float32)
    a = pool.acquire("b", (3, 4))
    b = pool.acquire("b", None)
    assert a.shape == (3, 4) and b.shape == BOUND and pool.owns("b", a) and not pool.is_ring_storage(a)
    with pytest.raises(StaticShapeError):
        pool.acquire("b", (9, 4))
    pool.release("b", a)
    assert not pool.owns("b", a)
    with pytest.raises(DoubleReleaseError):
        pool.release("b", a)
    with pytest.raises(ForeignTensorError):
        pool.release("b", torch.empty(BOUND))
    pool.release("b", b)
    assert pool.stats()["b"] == RingStats(acquisitions=2, releases=2, gpu_waits=0, peak_held=2, persistent_bytes=0)


# --- CUDA-graph phases (state machine; events are no-ops on CPU) ----------------------------------------


def _pool() -> BufferPool:
    pool = BufferPool("cpu")
    pool.register("dispatch_output", policy="ring", num_slots=2, max_shape=BOUND, dtype=torch.float32)
    pool.register("expert_fc2_output", policy="record-stream", max_shape=BOUND, dtype=torch.float32)
    return pool


def test_phases_full_cycle_resets_cursor():
    pool = _pool()
    ring = pool.get("dispatch_output")
    pool.release("dispatch_output", pool.acquire("dispatch_output", BOUND))
    assert ring.cursor == 1
    with pool.graph_capture(None):
        assert pool.phase is Phase.CAPTURING and ring.cursor == 0
        t = pool.acquire("dispatch_output", BOUND)
        assert ring.slot_of(t) == 0
        pool.release("dispatch_output", t)
        pool.release("expert_fc2_output", pool.acquire("expert_fc2_output", BOUND))
    assert pool.phase is Phase.GRAPHED
    with pytest.raises(CaptureStateError, match="after_replay"):
        pool.acquire("dispatch_output", BOUND)
    with pytest.raises(CaptureStateError, match="after_replay"):
        pool.acquire("expert_fc2_output", BOUND)
    pool.after_replay(None)
    assert pool.phase is Phase.EAGER and ring.cursor == 0
    pool.release("dispatch_output", pool.acquire("dispatch_output", BOUND))


def test_prepare_capture_with_held_slot_raises_and_changes_nothing():
    pool = _pool()
    held = pool.acquire("dispatch_output", BOUND)
    with pytest.raises(CaptureStateError, match="slot 0 \\(generation 1\\)"):
        pool.prepare_capture(None)
    assert pool.phase is Phase.EAGER and pool.get("expert_fc2_output").phase is Phase.EAGER
    pool.release("dispatch_output", held)
    other = pool.acquire("expert_fc2_output", BOUND)
    with pytest.raises(CaptureStateError, match="acquisition"):
        pool.prepare_capture(None)
    pool.release("expert_fc2_output", other)


def test_finish_capture_with_held_slot_raises():
    pool = _pool()
    pool.prepare_capture(None)
    t = pool.acquire("dispatch_output", BOUND)
    with pytest.raises(CaptureStateError, match="release every"):
        pool.finish_capture()
    pool.release("dispatch_output", t)
    pool.finish_capture()


@pytest.mark.parametrize(
    "sequence", [["finish"], ["after"], ["prepare", "prepare"], ["prepare", "after"], ["prepare", "finish", "finish"]]
)
def test_wrong_phase_transition_raises(sequence):
    pool = _pool()
    calls = {
        "prepare": lambda: pool.prepare_capture(None),
        "finish": pool.finish_capture,
        "after": lambda: pool.after_replay(None),
    }
    for step in sequence[:-1]:
        calls[step]()
    with pytest.raises(CaptureStateError):
        calls[sequence[-1]]()


def test_second_capture_after_finish_is_allowed():
    pool = _pool()
    for _ in range(2):
        with pool.graph_capture(None):
            pool.release("dispatch_output", pool.acquire("dispatch_output", BOUND))
    pool.after_replay(None)
    assert pool.phase is Phase.EAGER


def test_register_during_capture_raises():
    pool = _pool()
    pool.prepare_capture(None)
    with pytest.raises(CaptureStateError, match="during CUDA-graph capture"):
        pool.register("late", policy="ring", num_slots=1, max_shape=BOUND, dtype=torch.float32)
    pool.finish_capture()


def test_graph_capture_aborts_on_error_and_returns_to_eager():
    pool = _pool()
    with pytest.raises(ValueError, match="boom"), pool.graph_capture(None):
        pool.acquire("dispatch_output", BOUND)
        raise ValueError("boom")
    assert pool.phase is Phase.EAGER and pool.get("dispatch_output").held == 0
    pool.release("dispatch_output", pool.acquire("dispatch_output", BOUND))


# --- autograd guard ----------------------------------------------------------------------------------


def _linear_setup(n_slots: int):
    pool = BufferPool("cpu")
    pool.register("dispatch_output", policy="ring", num_slots=n_slots, max_shape=(4, 3), dtype=torch.float32)
    weight = torch.randn(2, 3, requires_grad=True)
    inputs = [torch.randn(4, 3) for _ in range(3)]
    return pool, weight, inputs


def test_guard_release_after_forward_raises_saved_for_backward():
    pool, weight, inputs = _linear_setup(2)
    with pool.autograd_guard():
        x = pool.acquire("dispatch_output", (4, 3))
        x.copy_(inputs[0])
        y = torch.nn.functional.linear(x, weight)
    ring = pool.get("dispatch_output")
    before = _state(ring)
    with pytest.raises(SavedForBackwardError, match="slot 0 generation 1") as info:
        pool.release("dispatch_output", x)
    assert "saved reference" in str(info.value)
    assert _state(ring) == before and pool.owns("dispatch_output", x)
    y.sum().backward()
    pool.release("dispatch_output", x)  # after the backward: allowed
    assert torch.allclose(weight.grad, torch.ones(4, 2).T @ inputs[0])


def test_guard_release_after_backward_gives_correct_gradients():
    pool, weight, inputs = _linear_setup(3)
    outs, xs = [], []
    with pool.autograd_guard():
        for inp in inputs:
            x = pool.acquire("dispatch_output", (4, 3))
            x.copy_(inp)
            xs.append(x)
            outs.append(torch.nn.functional.linear(x, weight))
    for x, y in zip(xs, outs, strict=True):
        y.sum().backward()
        pool.release("dispatch_output", x)
    expected = sum(torch.ones(4, 2).T @ inp for inp in inputs)
    assert torch.allclose(weight.grad, expected)


def test_guard_dropped_graph_frees_saved_reference():
    pool, weight, _ = _linear_setup(1)
    with pool.autograd_guard():
        x = pool.acquire("dispatch_output", (4, 3))
        y = torch.nn.functional.linear(x, weight)
    del y
    pool.release("dispatch_output", x)


def test_guard_saving_released_alias_raises_at_pack():
    pool, weight, _ = _linear_setup(2)
    x = pool.acquire("dispatch_output", (4, 3))
    pool.release("dispatch_output", x)
    with pytest.raises(SavedForBackwardError, match="released slot"), pool.autograd_guard():
        torch.nn.functional.linear(x, weight)


def test_guard_unpack_detects_reacquired_slot():
    pool, weight, _ = _linear_setup(1)
    with pytest.raises(RuntimeError, match="capture"), pool.graph_capture(None), pool.autograd_guard():
        x = pool.acquire("dispatch_output", (4, 3))
        y = torch.nn.functional.linear(x, weight)
        raise RuntimeError("capture failed")
    pool.acquire("dispatch_output", (4, 3))  # the aborted capture dropped the slot: generation 2
    with pytest.raises(SavedForBackwardError, match="acquired again"):
        y.sum().backward()


def test_guard_ignores_non_ring_tensors():
    pool, weight, inputs = _linear_setup(1)
    with pool.autograd_guard():
        y = torch.nn.functional.linear(inputs[0], weight)
    y.sum().backward()
    assert torch.allclose(weight.grad, torch.ones(4, 2).T @ inputs[0])


def test_torch_inplace_overwrite_of_saved_slot_is_caught_by_version_counter():
    """Without the guard, a torch in-place write into a later acquisition of the SAME slot bumps that
    slot's version counter, so autograd refuses the stale saved alias (pointer writes would not)."""
    pool, weight, inputs = _linear_setup(1)
    x = pool.acquire("dispatch_output", (4, 3))
    x.copy_(inputs[0])
    y = torch.nn.functional.linear(x, weight)
    pool.release("dispatch_output", x)
    pool.acquire("dispatch_output", (4, 3)).copy_(inputs[1])
    with pytest.raises(RuntimeError, match="inplace operation"):
        y.sum().backward()


# --- independent slots --------------------------------------------------------------------------------


def test_slots_have_independent_version_counters():
    ring = _ring(2)
    a, b = ring.acquire(), ring.acquire()
    before = a._version
    b.add_(1.0)  # an in-place torch write into slot 1
    assert a._version == before and b._version == before + 1
    assert ring.slot_of(a) == 0 and ring.slot_of(b) == 1 and ring.slot_of(b[3:]) == 1


def test_write_into_other_slot_leaves_saved_alias_valid():
    pool, weight, inputs = _linear_setup(2)
    x = pool.acquire("dispatch_output", (4, 3))
    x.copy_(inputs[0])
    y = F.linear(x, weight)
    pool.acquire("dispatch_output", (4, 3)).copy_(inputs[1])  # slot 1: must not trip slot 0's saved alias
    y.sum().backward()
    assert torch.equal(weight.grad, torch.ones(4, 2).T @ inputs[0])


# --- release by fact: track_saved, release_when_unsaved, hold -----------------------------------------


def _one_slot_pool(*, debug: bool = False) -> tuple[BufferPool, BufferRing]:
    pool = BufferPool("cpu", debug=debug)
    pool.register("dispatch_output", policy="ring", num_slots=1, max_shape=(4, 3), dtype=torch.float32)
    return pool, pool.get("dispatch_output")


@pytest.mark.parametrize("order", ["backward-then-hold", "hold-then-backward"])
def test_release_when_unsaved_releases_when_last_saved_ref_and_hold_are_gone(order):
    pool, ring = _one_slot_pool()
    weight = torch.randn(2, 3, requires_grad=True)
    with pool.track_saved():
        x = pool.acquire("dispatch_output")
        y = F.linear(x, weight)  # saves x (a view of slot 0) for weight's gradient
    hold = pool.hold("dispatch_output", x)  # a deferred wgrad-like reader
    assert pool.release_when_unsaved("dispatch_output", x) is False
    assert ring.held == 1 and not pool.owns("dispatch_output", x)
    with pytest.raises(EarlyReuseError, match=r"release deferred, 1 autograd-saved reference.*1 hold"):
        pool.acquire("dispatch_output")
    first, second = (lambda: y.sum().backward(), hold.done)
    if order == "hold-then-backward":
        first, second = second, first
    first()
    assert ring.held == 1
    with pytest.raises(EarlyReuseError):
        pool.acquire("dispatch_output")
    second()
    assert ring.held == 0 and ring.stats.deferred_releases == 1 and ring.stats.releases == 1
    pool.release("dispatch_output", pool.acquire("dispatch_output"))


def test_release_when_unsaved_with_nothing_saved_releases_now():
    pool, ring = _one_slot_pool()
    with pool.track_saved():
        x = pool.acquire("dispatch_output")
        (x * 2).sum()  # nothing requires grad: nothing saved
    assert pool.release_when_unsaved("dispatch_output", x) is True
    assert ring.held == 0 and ring.stats.deferred_releases == 0
    with pytest.raises(DoubleReleaseError):
        pool.release_when_unsaved("dispatch_output", x)


def test_release_when_unsaved_twice_while_deferred_raises_double_release():
    pool, ring = _one_slot_pool()
    weight = torch.randn(2, 3, requires_grad=True)
    with pool.track_saved():
        x = pool.acquire("dispatch_output")
        y = F.linear(x, weight)
    pool.release_when_unsaved("dispatch_output", x)
    with pytest.raises(DoubleReleaseError, match="release deferred"):
        pool.release("dispatch_output", x)
    del y
    assert ring.held == 0


def test_dropped_graph_completes_deferred_release():
    pool, ring = _one_slot_pool()
    weight = torch.randn(2, 3, requires_grad=True)
    with pool.track_saved():
        x = pool.acquire("dispatch_output")
        y = F.linear(x[:2], weight)  # a view of the acquisition is ring storage too
    pool.release_when_unsaved("dispatch_output", x)
    assert ring.held == 1
    del y  # the graph (and its saved reference) is dropped without backward
    assert ring.held == 0


def test_saved_ref_freed_on_another_thread_completes_deferred_release():
    pool, ring = _one_slot_pool()
    weight = torch.randn(2, 3, requires_grad=True)
    with pool.track_saved():
        x = pool.acquire("dispatch_output")
        y = F.linear(x, weight)
    pool.release_when_unsaved("dispatch_output", x)
    worker = threading.Thread(target=lambda: y.sum().backward())
    worker.start()
    worker.join()
    assert ring.held == 0 and ring.stats.releases == 1


def test_plain_release_with_tracked_saved_ref_or_hold_raises_in_production():
    pool, ring = _one_slot_pool()
    weight = torch.randn(2, 3, requires_grad=True)
    with pool.track_saved():
        x = pool.acquire("dispatch_output")
        y = F.linear(x, weight)
    with pytest.raises(SavedForBackwardError, match="release_when_unsaved"):
        pool.release("dispatch_output", x)
    y.sum().backward()
    hold = pool.hold("dispatch_output", x)
    with pytest.raises(SavedForBackwardError, match="1 hold"):
        pool.release("dispatch_output", x)
    with hold:
        pass
    assert not hold.active
    pool.release("dispatch_output", x)
    assert ring.held == 0


def test_hold_done_is_idempotent_and_hold_of_released_slot_raises():
    pool, ring = _one_slot_pool()
    x = pool.acquire("dispatch_output")
    hold = pool.hold("dispatch_output", x)
    assert isinstance(hold, Hold) and hold.active
    pool.release_when_unsaved("dispatch_output", x)
    hold.done()
    hold.done()
    assert ring.held == 0
    with pytest.raises(StaleAliasError, match="hold of a released slot"):
        pool.hold("dispatch_output", x)


def test_track_saved_passes_non_ring_tensors_and_stale_aliases_in_production():
    pool, ring = _one_slot_pool()
    weight = torch.randn(2, 3, requires_grad=True)
    x = pool.acquire("dispatch_output")
    pool.release("dispatch_output", x)
    with pool.track_saved():
        F.linear(torch.randn(4, 3), weight)
        y = F.linear(x, weight)  # a stale alias: not counted (strict mode raises instead)
    assert ring._slots[0].saved_refs == 0
    y.sum().backward()


def test_allocator_policies_take_release_when_unsaved_and_hold():
    pool = BufferPool("cpu")
    pool.register("expert_fc2_output", policy="record-stream", max_shape=(4, 3), dtype=torch.float32)
    weight = torch.randn(2, 3, requires_grad=True)
    with pool.track_saved():
        x = pool.acquire("expert_fc2_output")
        y = F.linear(x, weight)
    hold = pool.hold("expert_fc2_output", x)
    assert pool.release_when_unsaved("expert_fc2_output", x) is True
    y.sum().backward()
    hold.done()
    assert pool.get("expert_fc2_output").held == 0


def test_deferred_releases_from_a_backward_thread_keep_counts_consistent():
    """Backward (freeing saved refs) on a worker thread while the main thread acquires and releases."""
    import queue
    import sys

    pool = BufferPool("cpu")
    pool.register("dispatch_output", policy="ring", num_slots=4, max_shape=(4, 3), dtype=torch.float32)
    ring = pool.get("dispatch_output")
    weight = torch.randn(2, 3, requires_grad=True)
    todo: queue.Queue = queue.Queue()
    worker = threading.Thread(target=lambda: [loss.backward() for loss in iter(todo.get, None)])
    old, n = sys.getswitchinterval(), 300
    sys.setswitchinterval(1e-6)
    try:
        worker.start()
        for _ in range(n):
            while True:
                try:
                    x = pool.acquire("dispatch_output")
                    break
                except EarlyReuseError:
                    time.sleep(1e-4)
            with pool.track_saved():
                loss = F.linear(x, weight).sum()
            if ring.held < 4:  # a plain pair on another slot, racing the worker's deferred releases
                pool.release("dispatch_output", pool.acquire("dispatch_output"))
            pool.release_when_unsaved("dispatch_output", x)
            todo.put(loss)
            del loss
        todo.put(None)
        worker.join()
    finally:
        sys.setswitchinterval(old)
    stats = ring.stats
    assert ring.held == 0 and stats.releases == stats.acquisitions and stats.deferred_releases > 0


# --- a bf16-like expert linear over interleaved schedules ---------------------------------------------

_W0 = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
_INPUTS = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + m)) for m in range(4)]
SCHEDULES = {
    "F0 B0 F1 B1 F2 B2": 1,
    "F0 F1 B0 F2 B1 F3 B2 B3": 2,
    "F0 F1 F2 B0 B1 B2": 3,
}


def _run_schedule(schedule: str, pool: BufferPool | None, *, release: str = "unsaved") -> torch.Tensor:
    """Weight gradient of a linear fed from the dispatch buffer (a pool ring, or torch.empty if None).

    The buffer is written by pointer (``.data``: no version-counter bump, like a DeepEP dispatch), so only
    the release point keeps backward from reading another microbatch's data.
    """
    weight = _W0.clone().requires_grad_()
    losses: dict[int, torch.Tensor] = {}
    for op in schedule.split():
        m = int(op[1:])
        if op[0] == "B":
            losses.pop(m).backward()
            continue
        d = torch.empty(4, 3) if pool is None else pool.acquire("dispatch_output", (4, 3))
        d.data.copy_(_INPUTS[m])
        with pool.track_saved() if pool is not None else contextlib.nullcontext():
            y = F.linear(d, weight)  # saves d for weight's gradient, as the bf16 expert GEMM does
        if pool is not None:
            if release == "unsaved":
                pool.release_when_unsaved("dispatch_output", d)
            else:
                pool.release("dispatch_output", d)
        losses[m] = (y * (m + 1)).sum()
    assert weight.grad is not None
    return weight.grad


def _schedule_pool(slots: int | str, *, debug: bool, **kw) -> BufferPool:
    pool = BufferPool("cpu", debug=debug)
    pool.register("dispatch_output", policy="ring", num_slots=slots, max_shape=(4, 3), dtype=torch.float32, **kw)
    return pool


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_release_when_unsaved_schedule_gradients_bit_equal_to_torch_empty(schedule, debug, monkeypatch):
    monkeypatch.delenv("BUFREUSE_DEBUG", raising=False)
    expected = _run_schedule(schedule, None)
    pool = _schedule_pool(SCHEDULES[schedule], debug=debug)
    assert torch.equal(_run_schedule(schedule, pool), expected)
    ring = pool.get("dispatch_output")
    assert ring.held == 0 and ring.stats.deferred_releases == len(schedule.split()) // 2


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_release_when_unsaved_schedule_one_slot_short_raises_early_reuse(debug):
    pool = _schedule_pool(1, debug=debug)
    with pytest.raises(EarlyReuseError, match="at least 2 slots") as info:
        _run_schedule("F0 F1 B0 F2 B1 F3 B2 B3", pool)
    assert info.value.min_depth == 2


def test_plain_release_after_forward_with_pointer_writes_corrupts_gradients_silently():
    """The hazard release_when_unsaved removes: no error, wrong gradients (why the count must be a fact)."""
    expected = _run_schedule("F0 F1 B0 F2 B1 F3 B2 B3", None)
    pool = _schedule_pool(1, debug=False)
    pool.track_saved = contextlib.nullcontext  # type: ignore[method-assign]  # untracked, as before issue 13
    assert not torch.equal(_run_schedule("F0 F1 B0 F2 B1 F3 B2 B3", pool, release="plain"), expected)


# --- recovery ----------------------------------------------------------------------------------------


def test_reset_after_early_reuse_mid_step_recovers_and_keeps_storage():
    pool, ring = _one_slot_pool()
    weight = torch.randn(2, 3, requires_grad=True)
    ptr = ring._storage_ptr
    with pool.track_saved():
        x = pool.acquire("dispatch_output")
        y = F.linear(x, weight)
    pool.release_when_unsaved("dispatch_output", x)
    hold = pool.hold("dispatch_output", x)
    with pytest.raises(EarlyReuseError):
        pool.acquire("dispatch_output")  # the step dies here, slot stranded
    pool.reset()
    assert ring.held == 0 and ring.cursor == 0 and ring.phase is Phase.EAGER and ring._storage_ptr == ptr
    z = pool.acquire("dispatch_output")  # a new generation of the same storage
    del y  # the old graph's saved reference and hold are forgotten: they must not release z
    hold.done()
    assert ring.held == 1 and pool.owns("dispatch_output", z)
    pool.release("dispatch_output", z)


def test_reset_returns_pool_to_eager_after_a_graphed_phase():
    pool = _pool()
    with pool.graph_capture(None):
        pool.release("dispatch_output", pool.acquire("dispatch_output", BOUND))
    assert pool.phase is Phase.GRAPHED
    pool.reset()
    assert pool.phase is Phase.EAGER
    pool.release("dispatch_output", pool.acquire("dispatch_output", BOUND))


# --- on_exhausted='allocate' ---------------------------------------------------------------------------


def test_on_exhausted_allocate_warns_once_counts_and_releases():
    pool = BufferPool("cpu")
    pool.register(
        "dispatch_output", policy="ring", num_slots=1, max_shape=BOUND, dtype=torch.float32, on_exhausted="allocate"
    )
    ring = pool.get("dispatch_output")
    a = pool.acquire("dispatch_output")
    with pytest.warns(RuntimeWarning, match="on_exhausted='allocate'"):
        b = pool.acquire("dispatch_output", (3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = pool.acquire("dispatch_output")
    assert b.shape == (3, 4) and not pool.is_ring_storage(b) and not pool.is_ring_storage(c)
    assert pool.owns("dispatch_output", b) and ring.held == 3
    hold = pool.hold("dispatch_output", b)
    assert pool.release_when_unsaved("dispatch_output", b) is True
    hold.done()
    pool.release("dispatch_output", c)
    pool.release("dispatch_output", a)
    with pytest.raises(DoubleReleaseError):
        pool.release("dispatch_output", c)
    stats = ring.stats
    assert (stats.fallback_allocations, stats.acquisitions, stats.releases, stats.peak_held) == (2, 3, 3, 3)
    assert ring.held == 0


def test_on_exhausted_allocate_under_capture_raises_capture_state():
    pool = BufferPool("cpu")
    pool.register(
        "dispatch_output", policy="ring", num_slots=1, max_shape=BOUND, dtype=torch.float32, on_exhausted="allocate"
    )
    with pytest.raises(CaptureStateError, match="at least 2 slots"), pool.graph_capture(None):
        pool.acquire("dispatch_output")
        pool.acquire("dispatch_output")


@pytest.mark.parametrize(
    "kw",
    [
        {"on_exhausted": "grow"},
        {"num_slots": 2, "max_bytes": 4096},
        {"num_slots": "auto"},
        {"num_slots": "auto", "max_bytes": 100},
        {"num_slots": "auto", "initial_slots": 0, "max_bytes": 4096},
    ],
)
def test_register_bad_exhaustion_or_auto_arguments_raise(kw):
    args = {"num_slots": 1, **kw}
    with pytest.raises(RingConfigError):
        BufferPool("cpu").register("dispatch_output", policy="ring", max_shape=BOUND, dtype=torch.float32, **args)


# --- num_slots='auto' ---------------------------------------------------------------------------------


def test_auto_depth_grows_in_eager_up_to_cap_then_names_it(caplog):
    pool = _schedule_pool("auto", debug=False, initial_slots=1, max_bytes=3 * 512)
    ring = pool.get("dispatch_output")
    with caplog.at_level(logging.INFO, logger="bufreuse.pool"):
        held = [pool.acquire("dispatch_output") for _ in range(3)]
    assert [r.getMessage().split(" grew to ")[1][:7] for r in caplog.records] == ["2 slots", "3 slots"]
    assert ring.stats.grown == 2 and ring.stats.settled_slots == 3 and ring.persistent_bytes == 3 * 512
    assert [ring.slot_of(t) for t in held] == [0, 1, 2] and all(pool.is_ring_storage(t) for t in held)
    with pytest.raises(EarlyReuseError, match=r"max_bytes=1536.*at least 4 slots") as info:
        pool.acquire("dispatch_output")
    assert info.value.min_depth == 4
    for t in held:
        pool.release("dispatch_output", t)


def test_auto_depth_grown_slots_are_tracked_and_independent():
    pool = _schedule_pool("auto", debug=False, initial_slots=1, max_bytes=4096)
    weight = torch.randn(2, 3, requires_grad=True)
    a = pool.acquire("dispatch_output")
    with pool.track_saved():
        b = pool.acquire("dispatch_output")  # grown: its own storage
        y = F.linear(b, weight)
    a.add_(1.0)
    pool.release("dispatch_output", a)
    assert pool.release_when_unsaved("dispatch_output", b) is False
    y.sum().backward()
    assert pool.get("dispatch_output").held == 0


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_auto_depth_settles_on_schedule_depth_with_bit_equal_gradients(debug, caplog):
    schedule = "F0 F1 F2 B0 B1 B2"
    pool = _schedule_pool("auto", debug=debug, initial_slots=1, max_bytes=8 * 512)
    assert torch.equal(_run_schedule(schedule, pool), _run_schedule(schedule, None))
    ring = pool.get("dispatch_output")
    with caplog.at_level(logging.INFO, logger="bufreuse.pool"):
        pool.prepare_capture()
    assert ring.stats.settled_slots == SCHEDULES[schedule] and "settled at 3 slots" in caplog.text
    with pytest.raises(CaptureStateError, match="cannot grow"):
        for _ in range(4):
            pool.acquire("dispatch_output")
    pool.reset()
    with pool.graph_capture(None):
        pool.release("dispatch_output", pool.acquire("dispatch_output"))
    pool.after_replay()
    held = [pool.acquire("dispatch_output") for _ in range(3)]
    with pytest.raises(EarlyReuseError, match="settled at 3 slot"):
        pool.acquire("dispatch_output")
    assert len(held) == 3 and ring.stats.settled_slots == 3


# --- before_replay -------------------------------------------------------------------------------------


def test_before_replay_orders_replays_after_eager_use():
    pool = _pool()
    with pool.graph_capture(None):
        pool.release("dispatch_output", pool.acquire("dispatch_output", BOUND))
    pool.before_replay()  # right after capture: a no-op
    pool.after_replay()
    for _ in range(3):  # eager: moves the cursor
        pool.release("dispatch_output", pool.acquire("dispatch_output", BOUND))
    held = pool.acquire("dispatch_output", BOUND)
    with pytest.raises(CaptureStateError, match="before_replay"):
        pool.before_replay()
    pool.release("dispatch_output", held)
    pool.before_replay()
    assert pool.phase is Phase.GRAPHED and pool.get("dispatch_output").cursor == 0
    with pytest.raises(CaptureStateError, match="after_replay"):
        pool.acquire("dispatch_output", BOUND)
    pool.after_replay()
    pool.release("dispatch_output", pool.acquire("dispatch_output", BOUND))


def test_before_replay_during_capture_raises():
    pool = _pool()
    pool.prepare_capture()
    with pytest.raises(CaptureStateError, match="during a capture"):
        pool.before_replay()


# --- debug mode and watchdog -------------------------------------------------------------------------


def test_debug_mode_from_environment(monkeypatch):
    monkeypatch.setenv("BUFREUSE_DEBUG", "1")
    pool = _pool()
    assert pool.debug and pool.get("dispatch_output").debug
    with pool.autograd_guard_if_debug():
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    monkeypatch.setenv("BUFREUSE_DEBUG", "0")
    quiet = _pool()
    assert not quiet.debug and not quiet.get("dispatch_output").debug
    with quiet.autograd_guard_if_debug():
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class _FlagEvent:
    """A stand-in for a CUDA event on CPU: ``query()`` is True once the consumer has finished."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def __repr__(self) -> str:
        return "<release event>"


def test_watchdog_reports_stuck_wait_once_and_ignores_finished(monkeypatch):
    monkeypatch.setenv("BUFREUSE_WATCHDOG_S", "0.05")
    seen: list[str] = []
    dog = Watchdog(poll_s=0.01, on_report=seen.append)
    assert dog.threshold_s == 0.05
    stuck, finished = _FlagEvent(), _FlagEvent()
    finished.done.set()
    dog.track("dispatch_output", 1, 7, stuck)
    dog.track("expert_fc2_output", 0, 3, finished)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    stuck.done.set()
    dog.close()
    assert len(seen) == 1 and dog.reports == seen
    assert "ring 'dispatch_output'" in seen[0] and "slot 1" in seen[0] and "generation 7" in seen[0]
    assert "<release event>" in seen[0] and "BUFREUSE_WATCHDOG_S" in seen[0]


# --- random sequences against a model ----------------------------------------------------------------

_op = st.one_of(
    st.tuples(st.just("acquire"), st.integers(0, 8)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("probe"), st.integers(0, 50)),
)


@given(num_slots=st.integers(1, 4), ops=st.lists(_op, max_size=40))
def test_random_sequences_match_model(num_slots, ops):
    ring = _ring(num_slots)
    model_live: list[int | None] = [None] * num_slots  # index into `handed` of the holder, per slot
    cursor = 0
    handed: list[tuple[torch.Tensor, int, int]] = []  # (tensor, slot, generation)
    released: set[int] = set()
    for kind, arg in ops:
        if kind == "acquire":
            free = [(cursor + k) % num_slots for k in range(num_slots) if model_live[(cursor + k) % num_slots] is None]
            if not free:
                with pytest.raises(EarlyReuseError) as info:
                    ring.acquire((arg, 4))
                assert info.value.min_depth == num_slots + 1
                continue
            t = ring.acquire((arg, 4))
            slot = free[0]
            assert ring.slot_of(t) == slot and t.shape == (arg, 4)
            model_live[slot] = len(handed)
            handed.append((t, slot, len(handed) + 1))
            cursor = (slot + 1) % num_slots
        elif handed:
            i = arg % len(handed)
            t, slot, _gen = handed[i]
            if kind == "probe":
                assert ring.is_ring_storage(t)
                assert ring.owns(t) == (model_live[slot] == i)
                continue
            if model_live[slot] == i:
                ring.release(t)
                model_live[slot] = None
                released.add(i)
            elif model_live[slot] is None:
                with pytest.raises(DoubleReleaseError):
                    ring.release(t)
            else:
                with pytest.raises(StaleAliasError):
                    ring.release(t)
        assert ring.held == sum(x is not None for x in model_live)
        assert ring.cursor == cursor
    assert ring.stats.releases == len(released)
    assert ring.stats.acquisitions == len(handed)


def test_watchdog_pause_holds_reports_until_resume():
    dog = Watchdog(0.02, poll_s=0.01)
    stuck = _FlagEvent()
    dog.pause()
    dog.track("dispatch_output", 0, 1, stuck)
    time.sleep(0.15)
    assert dog.reports == []
    dog.resume()
    deadline = time.monotonic() + 5
    while not dog.reports and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.close()
    assert len(dog.reports) == 1 and "slot 0" in dog.reports[0]


# --- `bufreuse bench pool` on CPU tensors --------------------------------------------------------------


def test_bench_pool_cli_cpu_json_and_table(tmp_path):
    import json
    import math

    from typer.testing import CliRunner

    from bufreuse.bench.pool_bench import HOOK_ROWS
    from bufreuse.cli import app

    runner = CliRunner()
    out = tmp_path / "bench.json"
    args = ["bench", "pool", "--device", "cpu", "--tokens", "64", "--hidden", "32", "--iters", "50", "--repeats", "1"]
    result = runner.invoke(app, [*args, "--json", "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data == json.loads(out.read_text())
    assert data["cpu_tensors"] and "CPU tensors" in data["note"] and data["shape"] == [64, 32]
    names = [row["name"] for row in data["rows"]]
    assert names[0] == "torch.empty + free (CPU)" and "BufferPool ring" in names
    # timed rows are positive; the saved-tensor hook rows are differences of two timings (hooked minus bare
    # forward), which noise on a loaded box can push to or below 0: finite is what can be asserted there
    hook_rows = set(HOOK_ROWS)
    assert all(row["us_per_pair"] > 0 for row in data["rows"] if row["name"] not in hook_rows)
    assert all(math.isfinite(row["us_per_pair"]) for row in data["rows"]) and data["rows"][0]["ratio"] == 1.0
    assert hook_rows <= set(names)
    table = runner.invoke(app, args)
    assert table.exit_code == 0 and "BufferRing.acquire + release" in table.stdout and "CPU tensors" in table.stdout
    refused = runner.invoke(app, [*args, "--probe-external-events"])
    assert refused.exit_code == 2 and "needs a CUDA device" in refused.output
