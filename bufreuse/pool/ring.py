"""`BufferRing`: persistent slots handed out in rotation, reused after a GPU-side wait.

Lifecycle of a slot (one per acquisition, numbered by a ring-wide *generation*)::

    free --acquire(stream P)--> held --release(stream C)--> free (event recorded on C; none when C is P)
                 ^ P waits on the slot's last release event, on the GPU (no host sync)
    held --release_when_unsaved(C)--> pending --last saved ref freed, every hold done--> free

Storage is allocated in the constructor (and, for ``max_bytes`` growth, once per added slot in eager
warm-up), never under capture. Each slot is its own base tensor over that storage, so each slot has
its **own version counter**: an in-place torch write into a later acquisition of slot *k* makes
autograd reject a stale saved alias of slot *k*, and writes into other slots never disturb it. An
acquisition is a fresh tensor (``detach()`` of the slot base, or a leading-rows view), sharing only its
slot's counter. Kernels that write by pointer (DeepEP, TE ``out=``) bump no counter; releasing at the
true last reader (:mod:`bufreuse.pool.tracking`) is what keeps them safe. Every check runs before any
GPU work.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from bufreuse.pool._config import check_config, resolve_device, storage_ptr
from bufreuse.pool._device import DeviceOps, env_debug, is_capturing
from bufreuse.pool._state import Phase, RingStats, StorageIndex, _Slot
from bufreuse.pool.errors import (
    CaptureStateError,
    DoubleReleaseError,
    ForeignTensorError,
    InvalidStreamError,
    RingConfigError,
    SavedForBackwardError,
    StaleAliasError,
    StaticShapeError,
)
from bufreuse.pool.ring_capacity import RingCapacity
from bufreuse.pool.ring_lifecycle import RingLifecycle
from bufreuse.pool.tracking import Hold, SavedRefCounting

__all__ = ["ON_EXHAUSTED", "SLOT_ALIGN_BYTES", "BufferRing", "Phase", "RingStats", "poison_value"]

SLOT_ALIGN_BYTES = 512
"""Each slot starts on this boundary inside the ring's allocation."""

ON_EXHAUSTED = ("raise", "allocate")
"""What ``acquire`` does when every slot is held (and the ring may not grow)."""

_log = logging.getLogger("bufreuse.pool")


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """What debug mode fills a freed slot with: NaN for floating/complex dtypes, else all bits set
    (-1 for signed integers, the maximum for unsigned ones, True for bool): an index read from a
    stale integer slot is out of range."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype is torch.bool:
        return True
    return -1 if dtype.is_signed else torch.iinfo(dtype).max


class BufferRing(SavedRefCounting, RingCapacity, RingLifecycle):
    """``num_slots`` persistent buffers of at most ``max_shape`` handed out in rotation.

    Args:
        name: buffer name (in every message).
        num_slots: slots allocated now (the initial depth when ``max_bytes`` is set).
        max_shape: static bound; acquisitions may have fewer leading rows.
        dtype: element type.
        device: default: the current CUDA device, else CPU.
        debug: default ``BUFREUSE_DEBUG``: per-call stream/capture/device checks, generations of stale
            aliases named in errors, and every slot *poisoned* when it becomes free (filled with NaN, or
            the all-ones integer pattern, on the releasing stream before the release event).
        watchdog: told about every GPU wait (set by :class:`BufferPool` in debug mode).
        on_exhausted: ``"raise"`` (``EarlyReuseError``) or ``"allocate"`` (serve the acquisition from
            the caching allocator, warn once, count ``fallback_allocations``).
        max_bytes: set for ``num_slots='auto'``: in eager phase, grow by one slot when every slot is
            held, while ``slots x slot_bytes <= max_bytes``; frozen at ``prepare_capture``.
        registry: storage pointer -> ring map the ring adds its storages to (the pool's).

    Raises:
        RingConfigError: bad arguments. CaptureStateError: constructed under CUDA-graph capture.
    """

    def __init__(
        self,
        name: str,
        num_slots: int,
        max_shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        debug: bool | None = None,
        watchdog: Any = None,
        on_exhausted: str = "raise",
        max_bytes: int | None = None,
        registry: dict[int, BufferRing] | None = None,
    ) -> None:
        shape = check_config(name, num_slots, max_shape, dtype)
        if on_exhausted not in ON_EXHAUSTED:
            raise RingConfigError(f"ring '{name}': on_exhausted must be 'raise' or 'allocate', got {on_exhausted!r}")
        dev = resolve_device(device)
        if is_capturing(dev):
            raise CaptureStateError(
                f"ring '{name}': cannot allocate a ring during CUDA-graph capture; register every buffer "
                "before the eager warm-up"
            )
        self.name = name
        self.num_slots = num_slots
        self.max_shape: tuple[int, ...] = shape
        self.dtype = dtype
        self.device = dev
        self.debug = env_debug() if debug is None else bool(debug)
        self.on_exhausted = on_exhausted
        self._ops = DeviceOps(dev)
        self._cuda = self._ops.cuda
        self._watchdog = watchdog
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        self._stride = -(-max(numel * itemsize, 1) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES // itemsize
        self._strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        self.slot_bytes: int = self._stride * itemsize
        self.persistent_bytes: int = self.slot_bytes * num_slots
        if max_bytes is not None and (
            not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < self.persistent_bytes
        ):
            raise RingConfigError(
                f"ring '{name}': max_bytes must be an integer >= the initial {num_slots} slot(s) x "
                f"{self.slot_bytes} bytes = {self.persistent_bytes}, got {max_bytes!r}"
            )
        self.max_bytes = max_bytes
        self._frozen = max_bytes is None
        self._grown = 0
        self._storage = torch.empty(self._stride * num_slots, dtype=dtype, device=dev)
        self._storage_ptr = self._storage.untyped_storage().data_ptr()
        self._storages: list[torch.Tensor] = [self._storage]
        self._slot_map: dict[int, tuple[int, int]] = {self._storage_ptr: (0, num_slots)}
        self._registry: StorageIndex = StorageIndex() if registry is None else registry
        self._registry.add(self._storage_ptr, self._storage.untyped_storage().nbytes(), self)
        self._slots = [self._new_slot(i, self._storage, i * self._stride) for i in range(num_slots)]
        self._fence = self._ops.new_event()
        self._lock = threading.RLock()  # saved-ref counts and deferral; reentrant: a holder may be freed by GC inside
        self._by_id: dict[int, _Slot] = {}
        self._gen_tags: dict[int, tuple[weakref.ref, int]] = {}
        self._fallback: dict[int, tuple[torch.Tensor, Any]] = {}
        self._fallback_done: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._spare_events: list[Any] = []
        self._warned = False
        self._epoch = 0
        self._cursor = 0
        self._generation = 0
        self._held = 0  # acquisitions minus releases made by the caller's thread (hot path, no lock)
        self._deferred_freed = 0  # deferred releases completed (by whichever thread freed the last reader)
        self._deferred_waits = 0
        self._phase = Phase.EAGER
        self._acquisitions = 0
        self._empty = 0  # zero-row acquisitions
        self._releases = 0
        self._gpu_waits = 0
        self._peak_held = 0
        self._deferred = 0
        self._fallbacks = 0
        self._elide = True  # same-stream releases record no event until a second producer stream appears
        self._elided = 0
        self._deferred_elided = 0  # written under the lock by the thread that frees a deferred slot's last reader
        self._late_records = 0
        self._marks_elided = 0  # reader marks of deferred slots not recorded (written under the lock)
        self._marks_late = 0  # ... recorded late after all: the final release came on another stream
        self._poison_value = poison_value(dtype)
        self.poisoned = 0
        """Slot fills done by debug-mode poisoning (0 in production mode: it does no extra work)."""

    def __repr__(self) -> str:
        return (
            f"BufferRing(name={self.name!r}, num_slots={self.num_slots}, max_shape={self.max_shape}, "
            f"dtype={self.dtype}, device='{self.device}', held={self.held}, phase={self._phase.value})"
        )

    # --- hot path -------------------------------------------------------------------------------------

    def acquire(self, shape: Sequence[int] | None = None, stream: Any = None, *, dtype: torch.dtype | None = None):
        """Hand out the next free slot as a new tensor of ``shape`` (default: the full bound).

        Args:
            shape: the bound, or fewer leading rows.
            stream: the producing stream (default: current; hot paths pass it). It waits on the slot's
                last release event on the GPU.
            dtype: if given, must be the ring's.

        Raises:
            StaticShapeError: beyond the bound or another dtype.
            EarlyReuseError: every slot held (and no growth or fallback allowed); names the depth needed.
            CaptureStateError: after a capture until ``after_replay``; growth/fallback under capture; an
                eager ring acquired under a capture it was not prepared for (a per-layer graph; checked in
                production mode too, one C call per acquisition).
        """
        if self._phase is Phase.GRAPHED:
            raise CaptureStateError(
                f"ring '{self.name}': acquire after a CUDA-graph capture; call after_replay(stream) once the "
                "replays are enqueued (eager use is then ordered after that stream)"
            )
        if dtype is not None and dtype != self.dtype:
            raise StaticShapeError(
                f"ring '{self.name}': requested dtype {dtype}, ring holds {self.dtype} (bound {self.max_shape})"
            )
        slot = self._slots[self._cursor]
        if slot.live is not None:
            slot = self._next_free()
            if slot is None:
                return self._fallback_acquire(shape, stream)
        # A fresh TensorImpl sharing only this slot's version counter: detach() of its base.
        if shape is None or shape == self.max_shape:
            view, rows = slot.base.detach(), -1
        else:
            rows = self._rows(shape)
            view = slot.base[:rows]
        if self._cuda:
            if stream is None:
                stream = self._ops.current_stream()
            elif self.debug:
                self._check_stream(stream)
            if self.debug:
                self._check_capture_state()
            elif self._phase is Phase.EAGER and self._ops.capturing():
                self._check_capture_state()  # a per-layer graph capturing an eager ring: raises before any change
            event = slot.wait_on
            if event is not None and slot.wait_stream is not stream:
                if slot.late:
                    self._record_late(slot)
                self._ops.wait(event, stream)
                self._gpu_waits += 1
                if self._watchdog is not None and self._phase is Phase.EAGER:
                    self._watchdog.track(self.name, slot.index, slot.generation, event)
            slot.wait_on = None
            slot.late = False
            slot.made_on = stream
        self._generation += 1
        slot.generation = self._generation
        slot.live = view
        self._by_id[id(view)] = slot
        if self.debug:
            tags, key = self._gen_tags, id(view)
            tags[key] = (weakref.ref(view, lambda _r, _k=key, _t=tags: _t.pop(_k, None)), self._generation)
        self._cursor = slot.index + 1 if slot.index + 1 < self.num_slots else 0
        self._acquisitions += 1
        if not rows:
            self._empty += 1
        self._held += 1
        held = self._held - self._deferred_freed
        if self._fallback:
            held += len(self._fallback)
        if held > self._peak_held:
            self._peak_held = held
        return view

    def release(self, tensor: torch.Tensor, stream: Any = None) -> None:
        """Mark ``tensor`` (the object ``acquire`` returned) read for the last time on ``stream``.

        Records the slot's reusable event on the consumer ``stream`` (default: current stream); the next
        producer of the slot waits on it.

        Raises:
            DoubleReleaseError, ForeignTensorError, StaleAliasError: wrong tensor (before any GPU work).
            SavedForBackwardError: autograd still holds a tracked saved reference to the slot, or a
                :class:`Hold` is active (use ``release_when_unsaved``).
        """
        slot = self._by_id.pop(id(tensor), None)
        if slot is None:
            self._release_other(tensor, stream)
            return
        if slot.saved_refs or slot.holds:
            self._by_id[id(tensor)] = slot
            raise SavedForBackwardError(
                f"ring '{self.name}' slot {slot.index} generation {slot.generation}: released while it is "
                f"{slot.state()}; the next acquisition would overwrite what backward (or the deferred "
                "reader) still reads. Use release_when_unsaved() to release at the true last reader"
            )
        if self._cuda:
            stream = self._consumer_stream(tensor, stream, slot)
            self._gpu_waits += self._record_release(slot, stream)
        elif self.debug:
            self._poison(slot, None)
        slot.live = None
        self._held -= 1
        self._releases += 1

    def release_when_unsaved(self, tensor: torch.Tensor, stream: Any = None) -> bool:
        """Release ``tensor`` now if nothing else reads it, else when the last reader is done.

        The forward's final reader on ``stream`` is done. With no tracked autograd-saved reference and no
        active :class:`Hold` the release happens now (as ``release``). Otherwise it is deferred: the
        slot stays held until the last saved reference is freed and every hold is done, and the release
        event is then recorded on the stream current at that moment, after that stream waited on the
        events marked by the earlier readers (this forward reader included). Autograd runs a node's
        backward with the node's stream current and frees the node's saved variables after enqueuing it,
        so the event follows the backward that read the slot. Limits: a backward that reads the slot on
        a side stream it does not join back, or a saved tensor made outside ``track_saved``, is not
        covered; ``retain_graph=True`` keeps the slot until the graph is dropped.

        Returns:
            True if released now, False if deferred.

        Raises:
            DoubleReleaseError, ForeignTensorError, StaleAliasError: wrong tensor (before any GPU work).
        """
        slot = self._by_id.pop(id(tensor), None)
        if slot is None:
            self._release_other(tensor, stream)
            return True
        if self._cuda:
            stream = self._ops.current_stream() if stream is None else self._consumer_stream(tensor, stream, slot)
        if slot.saved_refs or slot.holds:
            with self._lock:  # re-checked under the lock the readers' completions take: no lost release
                if slot.saved_refs or slot.holds:
                    slot.pending = True
                    self._deferred += 1
                    if self._cuda:
                        self._mark(slot, stream)
                    return False
        if self._cuda:
            self._gpu_waits += self._record_release(slot, stream)
        elif self.debug:
            self._poison(slot, None)
        slot.live = None
        self._held -= 1
        self._releases += 1
        return True

    def hold(self, tensor: torch.Tensor) -> Hold:
        """A :class:`Hold` on the slot ``tensor`` aliases: its release waits for ``hold.done(stream)``.

        For a tensor that is not ring storage (a fallback allocation) the hold keeps the tensor alive
        and ``done(stream)`` records ``stream`` on it.

        Raises:
            StaleAliasError: ``tensor`` aliases a slot that is not held.
        """
        ptr = storage_ptr(tensor)
        if ptr not in self._slot_map:
            if not isinstance(tensor, torch.Tensor):
                raise ForeignTensorError(f"ring '{self.name}': hold of a {type(tensor).__name__}, not a tensor")
            return Hold(tensor=tensor)
        with self._lock:
            slot = self._slot_for(tensor, ptr)
            if slot.live is None:
                raise StaleAliasError(
                    f"ring '{self.name}' slot {slot.index}: hold of a released slot (last generation "
                    f"{slot.generation}); take the hold while the buffer is acquired, before releasing it"
                )
            slot.holds += 1
            return Hold(ring=self, slot=slot, epoch=self._epoch)

    # --- pure probes ----------------------------------------------------------------------------------

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a live, unreleased acquisition of this ring. Pure."""
        slot = self._by_id.get(id(tensor))
        if slot is not None:
            return slot.live is tensor
        entry = self._fallback.get(id(tensor))
        return entry is not None and entry[0] is tensor

    def is_ring_storage(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` aliases any of this ring's slot storage, live or stale (storage pointer). Pure.

        The probe for paths that free or offload their inputs (``ScheduleNode.free_input``): they must
        skip ring storage, whatever the alias's generation. Fallback allocations are not ring storage.
        """
        return storage_ptr(tensor) in self._slot_map

    def slot_of(self, tensor: torch.Tensor) -> int | None:
        """Index of the slot ``tensor``'s first element lies in, or ``None`` if not ring storage. Pure.

        Uses the storage offset, not ``data_ptr()`` (which is 0 for a zero-row view).
        """
        ptr = storage_ptr(tensor)
        if ptr not in self._slot_map:
            return None
        return self._slot_for(tensor, ptr).index

    def saved_references(self, tensor: torch.Tensor) -> int:
        """Autograd-saved references counted on the live slot ``tensor`` views (0 if none or not held). Pure."""
        ptr = storage_ptr(tensor)
        if ptr not in self._slot_map:
            return 0
        with self._lock:
            slot = self._slot_for(tensor, ptr)
            return slot.saved_refs if slot.live is not None else 0

    # --- state ----------------------------------------------------------------------------------------

    @property
    def stats(self) -> RingStats:
        """A snapshot of this ring's counters."""
        return RingStats(
            acquisitions=self._acquisitions,
            empty_acquisitions=self._empty,
            releases=self._releases + self._deferred_freed,
            gpu_waits=self._gpu_waits + self._deferred_waits,
            peak_held=self._peak_held,
            persistent_bytes=self.persistent_bytes,
            deferred_releases=self._deferred,
            fallback_allocations=self._fallbacks,
            settled_slots=self.num_slots,
            grown=self._grown,
            elided_events=self._elided + self._deferred_elided + self._marks_elided,
            late_records=self._late_records + self._marks_late,
        )

    @property
    def held(self) -> int:
        """Acquisitions not yet released (deferred ones and fallback allocations included)."""
        return self._held - self._deferred_freed + len(self._fallback)

    @property
    def phase(self) -> Phase:
        """The ring's phase in the eager -> capture -> replay cycle."""
        return self._phase

    @property
    def cursor(self) -> int:
        """Slot the next ``acquire`` tries first."""
        return self._cursor

    # --- internals ------------------------------------------------------------------------------------

    def _record_release(self, slot: _Slot, stream: Any, *, deferred: bool = False) -> int:
        """Record the slot's release event on ``stream`` after joining earlier readers; the waits added.

        ``deferred``: called by whichever thread freed the last reader (under the lock), so it counts an elided
        event in its own counter: the hot path's counters are written by the caller's thread only.
        """
        waits = 0
        if slot.marks:
            for mark_stream, event, late in slot.marks:
                if mark_stream is not stream:
                    if late:  # an unrecorded reader mark (``_mark``): recorded now on the reader's stream
                        self._record_late_mark(event, mark_stream)
                    self._ops.wait(event, stream)
                    waits += 1
                self._spare_events.append(event)
            slot.marks.clear()
        if self.debug:
            self._poison(slot, stream)  # after every final reader, before the event the next producer waits on
        if slot.made_on is stream and self._elide and self._phase is Phase.EAGER:
            # Released on the stream that produced it: a next producer on that stream is ordered after this
            # point by the stream itself (the caching allocator's same-stream free records nothing either).
            # The event is recorded only if a producer on another stream comes first (_record_late).
            slot.wait_on = slot.eager_event
            slot.wait_stream = stream
            slot.late = True
            if deferred:
                self._deferred_elided += 1
            else:
                self._elided += 1
            return waits
        event = slot.capture_event if self._phase is Phase.CAPTURING else slot.eager_event
        self._ops.record(event, stream)
        slot.wait_on = event
        slot.wait_stream = stream
        slot.late = False
        return waits

    def _record_late(self, slot: _Slot, *, switch: bool = True) -> None:
        """Record an elided release event now, on the stream that released the slot.

        The event then follows everything enqueued there so far: the release point and maybe later work
        (a conservative wait, never an early one). A ring that meets a second producer stream records at every
        release from then on (``switch``; a capture stream joining before capture does not switch), so the
        over-wait happens at most once per slot already elided at the switch. The releasing stream must still
        exist then (streams that live as long as the training process, as Megatron's and NCCL's do).
        """
        self._ops.record(slot.wait_on, slot.wait_stream)
        slot.late = False
        if switch:
            self._elide = False
        self._late_records += 1

    def _record_late_mark(self, event: Any, stream: Any) -> None:
        """Record a reader's elided mark on its ``stream`` now (the final release came on another stream).

        Like :meth:`_record_late`: conservative, and the ring records its marks (and releases) from then on.
        """
        self._ops.record(event, stream)
        with self._lock:  # the deferred path holds it already (reentrant); release() may not
            self._marks_late += 1
            self._elide = False

    def _poison(self, slot: _Slot, stream: Any) -> None:
        """Debug mode: fill the freed slot so a stale reader sees NaN (or all-ones integers), not old data.

        Enqueued on the releasing ``stream`` (CPU: at once); under CUDA-graph capture the fill is captured
        with the release and runs at every replay. The slot's version counter is left as it was, so
        debug mode changes only what a stale reader sees, never which autograd checks fire.
        """
        base = slot.base
        with torch.autograd._unsafe_preserve_version_counter(base):
            if stream is None or self._ops.stream_is_current(stream):
                base.fill_(self._poison_value)
            else:
                with torch.cuda.stream(stream):
                    base.fill_(self._poison_value)
        self.poisoned += 1

    def _consumer_stream(self, tensor: torch.Tensor, stream: Any, slot: _Slot) -> Any:
        if stream is None:
            return self._ops.current_stream()
        if self.debug:
            try:
                self._check_stream(stream)
                if tensor.device != self.device:
                    raise ForeignTensorError(f"ring '{self.name}': tensor on {tensor.device}, ring on {self.device}")
            except (InvalidStreamError, ForeignTensorError):
                self._by_id[id(tensor)] = slot  # the release did not happen: still the caller's
                raise
        return stream

    def _new_slot(self, index: int, storage: torch.Tensor, offset: int) -> _Slot:
        base = torch.empty(0, dtype=self.dtype, device=self.device)
        base.set_(storage.untyped_storage(), offset, self.max_shape, self._strides)
        return _Slot(index, base, self._ops.new_event(), self._ops.new_event())

    def _slot_for(self, tensor: torch.Tensor, ptr: int) -> _Slot:
        first, count = self._slot_map[ptr]
        if count == 1:
            return self._slots[first]
        offset = max(tensor.storage_offset(), 0) * tensor.element_size()
        return self._slots[first + min(offset // self.slot_bytes, count - 1)]

    def _rows(self, shape: Sequence[int]) -> int:
        bound = self.max_shape
        if type(shape) is tuple and len(shape) == len(bound) and shape[1:] == bound[1:]:  # the hot path's form
            rows = shape[0]
            if type(rows) is int and 0 <= rows <= bound[0]:
                return rows
        try:
            req = tuple(int(d) for d in shape)
        except TypeError:
            req = None
        if req is None or len(req) != len(bound) or req[1:] != bound[1:] or not 0 <= req[0] <= bound[0]:
            raise StaticShapeError(
                f"ring '{self.name}': requested shape {tuple(shape) if req is not None else shape!r} does not fit "
                f"the static bound {bound} ({self.dtype}); only the leading dimension may be smaller. Raise "
                "the bound (capacity factor / pad-to-capacity) or keep this buffer off the ring"
            )
        return req[0]

    def _bad_release(self, tensor: Any) -> Exception:
        if isinstance(tensor, torch.Tensor) and self._fallback_done.get(id(tensor)) is tensor:
            return DoubleReleaseError(f"ring '{self.name}': fallback allocation already released")
        if not isinstance(tensor, torch.Tensor) or not self.is_ring_storage(tensor):
            what = (
                f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
                if isinstance(tensor, torch.Tensor)
                else type(tensor).__name__
            )
            return ForeignTensorError(
                f"ring '{self.name}': release of a tensor it does not own ({what}); "
                "release only what acquire() returned"
            )
        slot = self._slot_for(tensor, storage_ptr(tensor))
        tag = self._gen_tags.get(id(tensor))
        alias_gen = f" of generation {tag[1]}" if tag is not None and tag[0]() is tensor else ""
        if slot.live is None or (slot.pending and slot.live is tensor):
            return DoubleReleaseError(
                f"ring '{self.name}' slot {slot.index}: already released (generation {slot.generation}, "
                f"{slot.state()}); each acquisition is released exactly once, by its final reader"
            )
        return StaleAliasError(
            f"ring '{self.name}' slot {slot.index}: tensor{alias_gen} aliases the slot but is not its live "
            f"acquisition (generation {slot.generation}); it is an older alias of a slot acquired again since, "
            "or a view derived from the live tensor. Release the tensor object acquire() returned; probe with "
            "is_ring_storage()/owns(), which never change state"
        )

    def _check_stream(self, stream: Any) -> None:
        if not isinstance(stream, torch.cuda.Stream) or stream.device != self.device:
            raise InvalidStreamError(f"ring '{self.name}': stream {stream!r} is not a CUDA stream of {self.device}")

    def _check_capture_state(self) -> None:
        capturing = is_capturing(self.device)
        if capturing and self._phase is not Phase.CAPTURING:
            raise CaptureStateError(
                f"ring '{self.name}': acquire under CUDA-graph capture without prepare_capture(); wrap the "
                "capture in pool.graph_capture(stream)"
            )
        if not capturing and self._phase is Phase.CAPTURING:
            raise CaptureStateError(
                f"ring '{self.name}': eager acquire between prepare_capture() and the capture; the captured "
                "step must start with the cursor at slot 0"
            )
