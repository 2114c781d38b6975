"""CPU tests of the pool's state machine: every transition and every error (events are no-ops on CPU)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
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
    assert ring.stats == RingStats(acquisitions=3, releases=2, gpu_waits=0, peak_held=2, persistent_bytes=1536)
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
    """Without the guard, a torch in-place write into a later acquisition bumps the slot's shared version
    counter, so autograd refuses the stale saved view (pointer writes by kernels would not: see GPU test d)."""
    pool, weight, inputs = _linear_setup(1)
    x = pool.acquire("dispatch_output", (4, 3))
    x.copy_(inputs[0])
    y = torch.nn.functional.linear(x, weight)
    pool.release("dispatch_output", x)
    pool.acquire("dispatch_output", (4, 3)).copy_(inputs[1])
    with pytest.raises(RuntimeError, match="inplace operation"):
        y.sum().backward()


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

    from typer.testing import CliRunner

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
    assert all(row["us_per_pair"] > 0 for row in data["rows"]) and data["rows"][0]["ratio"] == 1.0
    table = runner.invoke(app, args)
    assert table.exit_code == 0 and "BufferRing.acquire + release" in table.stdout and "CPU tensors" in table.stdout
    refused = runner.invoke(app, [*args, "--probe-external-events"])
    assert refused.exit_code == 2 and "needs a CUDA device" in refused.output
