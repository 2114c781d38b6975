"""Same-stream releases record no event; the elided event is recorded late when a producer on another stream
comes (CPU, with recording stand-ins for the CUDA stream and event calls; the real streams:
``tests/test_pool_gpu.py::test_same_stream_release_records_no_event_and_a_producer_on_another_stream_still_waits``)."""

from __future__ import annotations

import pytest
import torch

from bufreuse.pool import BufferRing


class _Ops:
    """DeviceOps' interface, logging every record and wait with the event's slot and the stream's name."""

    cuda = True

    def __init__(self) -> None:
        self.stream = "s"
        self.log: list[tuple[str, object, str]] = []

    def current_stream(self) -> str:
        return self.stream

    def record(self, event: object, stream: str) -> None:
        self.log.append(("record", event, stream))

    def wait(self, event: object, stream: str) -> None:
        self.log.append(("wait", event, stream))

    def capturing(self) -> bool:
        return False

    def stream_is_current(self, stream: str) -> bool:
        return stream == self.stream

    def new_event(self) -> object:
        return object()


def _ring(slots: int = 2) -> tuple[BufferRing, _Ops]:
    ring = BufferRing("expert_fc2_output", slots, (4, 2), torch.float32, "cpu", debug=False)
    ops = _Ops()
    ring._ops, ring._cuda = ops, True
    ring._fence = ops.new_event()
    for slot in ring._slots:
        slot.eager_event, slot.capture_event = ops.new_event(), ops.new_event()
    return ring, ops


def test_same_stream_releases_record_nothing_and_other_streams_record_as_before() -> None:
    ring, ops = _ring()
    for _ in range(6):
        ring.release(ring.acquire((4, 2)))  # produced and released on the current stream "s"
    assert ops.log == [] and ring.stats.elided_events == 6 and ring.stats.gpu_waits == 0
    # positive control: released on another stream than the producer's, the event is recorded there
    x = ring.acquire((4, 2))
    ring.release(x, "t")
    slot = ring._slots[ring.slot_of(x)]
    assert ops.log == [("record", slot.eager_event, "t")] and ring.stats.elided_events == 6


def test_a_producer_on_another_stream_gets_the_event_recorded_first_then_waits() -> None:
    ring, ops = _ring(slots=1)
    ring.release(ring.acquire((4, 2)))  # elided on "s"
    event = ring._slots[0].eager_event
    ops.stream = "t"
    ring.acquire((4, 2))
    assert ops.log == [("record", event, "s"), ("wait", event, "t")], "the late record must precede the wait"
    assert ring.stats.late_records == 1 and ring.stats.gpu_waits == 1
    # from now on every release records (the over-wait of a late record happens once per ring)
    ring.release(ring._slots[0].live)
    assert ops.log[-1] == ("record", event, "t") and ring.stats.elided_events == 1


def test_a_capture_stream_joins_an_elided_release_without_switching_elision_off() -> None:
    ring, ops = _ring(slots=1)
    ring.release(ring.acquire((4, 2)))
    event = ring._slots[0].eager_event
    ring.prepare_capture("cap")
    assert ops.log[:2] == [("record", event, "s"), ("wait", event, "cap")]
    ring.abort_capture()
    ops.log.clear()
    ring.release(ring.acquire((4, 2)))
    assert ring._elide and not [e for e in ops.log if e[1] is event]


@pytest.mark.parametrize("reset", [True, False])
def test_reset_forgets_an_elided_release(reset: bool) -> None:
    ring, ops = _ring(slots=1)
    ring.release(ring.acquire((4, 2)))  # elided on "s"
    if reset:
        ring.reset(synchronize=False)
    ops.log.clear()
    ops.stream = "u"
    ring.acquire((4, 2))
    if reset:
        assert ops.log == [], "after reset nothing is pending: no late record, no wait"
    else:  # positive control: without the reset the producer on "u" gets the late record and waits
        assert [e[0] for e in ops.log] == ["record", "wait"]


def test_row_prefix_acquisitions_are_fresh_tensors_of_the_slot_whatever_the_row_count() -> None:
    """A row-prefix acquisition is a new tensor each time over the slot's storage, sharing its version counter,
    with the rows asked for (also when the row count changes and comes back)."""
    from bufreuse.pool import StaleAliasError

    ring = BufferRing("dispatch_output", 1, (8, 3), torch.float32, "cpu", debug=False)
    seen = []
    for rows in (5, 5, 2, 8, 5):
        x = ring.acquire((rows, 3))
        assert tuple(x.shape) == (rows, 3) and x.is_contiguous() and ring.slot_of(x) == 0
        assert x.data_ptr() == ring._slots[0].base.data_ptr() and all(x is not y for y in seen)
        seen.append(x)
        ring.release(x)
    old, new = seen[0], ring.acquire((5, 3))
    before = old._version
    new.add_(1.0)  # an in-place write into a later acquisition of the slot: the stale alias sees it
    assert old._version == before + 1
    with pytest.raises(StaleAliasError):
        ring.release(old)
    ring.release(new)


def test_a_deferred_release_is_elided_and_counted_apart_from_the_hot_path() -> None:
    """A release deferred until autograd frees its saved reference (done by whichever thread frees it) is elided on
    the producer's stream too, counted in its own counter (the hot path's counters stay the caller thread's); the
    forward reader's mark on that stream records nothing either."""
    from bufreuse.pool.tracking import track_saved

    ring, ops = _ring(slots=1)
    x = ring.acquire((4, 2))
    w = torch.ones(4, 2, requires_grad=True)
    with track_saved(ring._registry):
        y = x * w  # saves x (a view of the slot) for w's gradient
    assert not ring.release_when_unsaved(x)  # deferred: autograd still holds it (the forward reader's mark on "s")
    assert ops.log == [] and ring.held == 1 and ring.stats.elided_events == 1, "the mark on 's' is not recorded"
    assert ring._marks_elided == 1 and ring._elided == 0
    del y  # the graph and its saved reference go: the deferred release happens now, on "s"
    assert ring.held == 0 and ops.log == [], "same stream as the mark and the producer: nothing recorded, no wait"
    assert ring.stats.elided_events == 2 and ring._deferred_elided == 1 and ring._elided == 0
    assert ring.stats.gpu_waits == 0 and ring.stats.late_records == 0


def test_a_reader_mark_is_recorded_late_when_the_final_release_comes_on_another_stream() -> None:
    """The forward reader on "s" leaves an unrecorded mark; the last reader (a hold) finishes on "t": the mark's
    event is recorded on "s" first, "t" waits on it, then the release event goes on "t" (the producer's stream
    is "s", so it is not elided). From then on the ring records its marks and releases."""
    ring, ops = _ring(slots=1)
    x = ring.acquire((4, 2))
    hold = ring.hold(x)
    assert not ring.release_when_unsaved(x)  # the hold keeps it: deferred, the reader's mark on "s"
    assert ops.log == []
    mark = ring._slots[0].marks[0][1]
    hold.done("t")
    slot_event = ring._slots[0].eager_event
    assert ops.log == [("record", mark, "s"), ("wait", mark, "t"), ("record", slot_event, "t")], (
        "the late mark record must precede the wait, and the release follow it"
    )
    assert ring.stats.late_records == 1 and ring.stats.gpu_waits == 1 and not ring._elide
    # positive control of the switch: the next deferred slot's mark is recorded when it is made
    ops.log.clear()
    ops.stream = "s"
    y = ring.acquire((4, 2))
    hold = ring.hold(y)
    ring.release_when_unsaved(y)
    assert [e[0] for e in ops.log] == ["wait", "record"], "producer waits on the release; the mark is recorded now"
    hold.done("s")


def test_a_hold_finishing_on_the_readers_stream_joins_nothing() -> None:
    """Reader mark and final release on one stream (not the producer's): no mark event, no wait; only the
    release event is recorded (the producer is on another stream)."""
    ring, ops = _ring(slots=1)
    x = ring.acquire((4, 2))  # produced on "s"
    hold = ring.hold(x)
    ring.release_when_unsaved(x, "t")  # the forward reader on "t": an unrecorded mark
    hold.done("t")
    assert ops.log == [("record", ring._slots[0].eager_event, "t")] and ring.stats.gpu_waits == 0
    assert ring._elide and ring.stats.late_records == 0


def test_a_non_last_readers_stream_is_joined_by_the_final_release_on_another_stream() -> None:
    """A deferred slot with two readers after the forward's: a saved reference autograd frees on "u" (not the last
    reader) and a delayed-wgrad hold finished on "t" (the last). The final release on "t" must wait for every earlier
    reader: the forward's mark on "s" and the saved reference's on "u", each recorded late on its own stream first,
    then the release event on "t"."""
    from bufreuse.pool.tracking import track_saved

    ring, ops = _ring(slots=1)
    x = ring.acquire((4, 2))  # produced on "s"
    w = torch.ones(4, 2, requires_grad=True)
    with track_saved(ring._registry):
        y = x * w  # a saved reference to the slot
    hold = ring.hold(x)  # the delayed-wgrad reader
    assert not ring.release_when_unsaved(x)  # deferred; the forward reader's mark on "s"
    ops.stream = "u"
    del y  # autograd frees the saved reference on "u": not the last reader (the hold is left)
    slot = ring._slots[0]
    assert ring.held == 1 and [m[0] for m in slot.marks] == ["s", "u"], slot.marks
    mark_s, mark_u = (m[1] for m in slot.marks)
    hold.done("t")  # the last reader: the release, on "t"
    assert ops.log == [
        ("record", mark_s, "s"),
        ("wait", mark_s, "t"),
        ("record", mark_u, "u"),
        ("wait", mark_u, "t"),
        ("record", slot.eager_event, "t"),
    ]
    assert ring.held == 0 and ring.stats.gpu_waits == 2
