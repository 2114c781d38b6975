"""`BufferRing`: N persistent slots handed out in rotation, reused after a GPU-side wait.

Lifecycle of a slot (one per acquisition, numbered by a ring-wide *generation*)::

    free --acquire(stream P)--> held --release(stream C)--> free (event recorded on C)
                 ^ P waits on the slot's last release event, on the GPU (no host sync)

Storage for all slots is one allocation made in the constructor and never again, so nothing is
allocated during CUDA-graph capture. ``acquire`` returns a fresh tensor object (``detach()`` of the
slot's base view, about 1 us; a narrowed view for fewer rows), ``requires_grad=False``. All views of a
slot share the slot's version counter, so an in-place *torch* write into a later acquisition makes
autograd reject a stale saved view; kernels that write by pointer (DeepEP, TE ``out=``) do not bump
it, which is what :meth:`BufferPool.autograd_guard` is for. Every check runs before any GPU work.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bufreuse.pool._config import check_config, resolve_device, storage_ptr
from bufreuse.pool._device import DeviceOps, env_debug, is_capturing
from bufreuse.pool.errors import (
    CaptureStateError,
    DoubleReleaseError,
    EarlyReuseError,
    ForeignTensorError,
    InvalidStreamError,
    SavedForBackwardError,
    StaleAliasError,
    StaticShapeError,
)

__all__ = ["SLOT_ALIGN_BYTES", "BufferRing", "Phase", "RingStats"]

SLOT_ALIGN_BYTES = 512
"""Each slot starts on this boundary inside the ring's single allocation."""


class Phase(enum.Enum):
    """Where a ring (or pool) stands in the eager -> capture -> replay -> eager cycle."""

    EAGER = "eager"
    CAPTURING = "capturing"
    GRAPHED = "graphed"  # capture finished; replays may run; eager use needs after_replay()


@dataclass(kw_only=True, slots=True)
class RingStats:
    """Counters of one buffer (a snapshot; the ring keeps counting)."""

    acquisitions: int = 0
    """Successful ``acquire`` calls."""
    releases: int = 0
    """Successful ``release`` calls."""
    gpu_waits: int = 0
    """GPU-side waits inserted (producer stream waited on a release event or a replay fence)."""
    peak_held: int = 0
    """Most acquisitions held at once."""
    persistent_bytes: int = 0
    """Bytes allocated once for the slots (0 for the allocator policies)."""


class _Slot:
    __slots__ = (
        "base",
        "capture_event",
        "eager_event",
        "generation",
        "index",
        "live",
        "saved_refs",
        "wait_on",
        "wait_stream",
    )

    def __init__(self, index: int, base: torch.Tensor, eager_event: Any, capture_event: Any) -> None:
        self.index = index
        self.base = base
        self.live: torch.Tensor | None = None
        self.generation = 0
        self.eager_event = eager_event
        self.capture_event = capture_event
        self.wait_on: Any = None  # event the next producer must wait on (None: nothing pending)
        self.wait_stream: Any = None  # stream that event was recorded on (same stream: no wait)
        self.saved_refs = 0  # live autograd saved references (autograd guard)


class BufferRing:
    """``num_slots`` persistent buffers of at most ``max_shape`` handed out in rotation.

    ``debug`` (default: ``BUFREUSE_DEBUG``) adds per-call stream/capture/device checks and names the
    generation of stale aliases. ``watchdog`` (set by :class:`BufferPool` in debug mode) is told about
    every GPU wait so it can report one that does not finish.
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
    ) -> None:
        shape = check_config(name, num_slots, max_shape, dtype)
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
        self._ops = DeviceOps(dev)
        self._cuda = self._ops.cuda
        self._watchdog = watchdog
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        stride = -(-max(numel * itemsize, 1) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES // itemsize
        self.slot_bytes: int = stride * itemsize
        self.persistent_bytes: int = self.slot_bytes * num_slots
        self._storage = torch.empty(stride * num_slots, dtype=dtype, device=dev)
        self._storage_ptr = self._storage.untyped_storage().data_ptr()
        self._slots = [
            _Slot(
                i,
                self._storage.narrow(0, i * stride, numel).view(shape),
                self._ops.new_event(),
                self._ops.new_event(),
            )
            for i in range(num_slots)
        ]
        self._fence = self._ops.new_event()
        self._by_id: dict[int, _Slot] = {}
        self._gen_tags: dict[int, tuple[weakref.ref, int]] = {}
        self._cursor = 0
        self._generation = 0
        self._held = 0
        self._phase = Phase.EAGER
        self._acquisitions = 0
        self._releases = 0
        self._gpu_waits = 0
        self._peak_held = 0

    def __repr__(self) -> str:
        return (
            f"BufferRing(name={self.name!r}, num_slots={self.num_slots}, max_shape={self.max_shape}, "
            f"dtype={self.dtype}, device='{self.device}', held={self._held}, phase={self._phase.value})"
        )

    # --- hot path -------------------------------------------------------------------------------------

    def acquire(self, shape: Sequence[int] | None = None, stream: Any = None, *, dtype: torch.dtype | None = None):
        """Hand out the next free slot as a new tensor of ``shape`` (default: the full bound).

        The producing ``stream`` (default: the current stream; hot paths pass it, 7 us saved) waits
        on the slot's last release event on the GPU. Raises ``StaticShapeError`` beyond the bound or
        for another dtype, ``EarlyReuseError`` when every slot is held, ``CaptureStateError`` after a
        capture until ``after_replay``. A whole acquire+release pair costs about 6 us on the H200 host,
        0.65x ``torch.empty`` + ``record_stream`` + free (docs/benchmarks.md).
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
        # A fresh TensorImpl: detach() of the base view (~1 us) in the common full-bound case.
        view = slot.base.detach() if shape is None or shape == self.max_shape else slot.base[: self._rows(shape)]
        if self._cuda:
            if stream is None:
                stream = self._ops.current_stream()
            elif self.debug:
                self._check_stream(stream)
            if self.debug:
                self._check_capture_state()
            event = slot.wait_on
            if event is not None and slot.wait_stream is not stream:
                self._ops.wait(event, stream)
                self._gpu_waits += 1
                if self._watchdog is not None and self._phase is Phase.EAGER:
                    self._watchdog.track(self.name, slot.index, slot.generation, event)
            slot.wait_on = None
        self._generation += 1
        slot.generation = self._generation
        slot.live = view
        self._by_id[id(view)] = slot
        if self.debug:
            tags, key = self._gen_tags, id(view)
            tags[key] = (weakref.ref(view, lambda _r, _k=key, _t=tags: _t.pop(_k, None)), self._generation)
        self._cursor = slot.index + 1 if slot.index + 1 < self.num_slots else 0
        self._acquisitions += 1
        self._held += 1
        if self._held > self._peak_held:
            self._peak_held = self._held
        return view

    def release(self, tensor: torch.Tensor, stream: Any = None) -> None:
        """Mark ``tensor`` (the object ``acquire`` returned) read for the last time on ``stream``.

        Records the slot's reusable event on the consumer ``stream`` (default: current stream); the next
        producer of the slot waits on it. Raises ``DoubleReleaseError``, ``ForeignTensorError``,
        ``StaleAliasError`` or ``SavedForBackwardError`` before any GPU work.
        """
        slot = self._by_id.pop(id(tensor), None)
        if slot is None:
            raise self._bad_release(tensor)
        if slot.saved_refs:
            self._by_id[id(tensor)] = slot
            raise SavedForBackwardError(
                f"ring '{self.name}' slot {slot.index} generation {slot.generation}: released while autograd "
                f"still holds {slot.saved_refs} saved reference(s) to it for backward; the next acquisition "
                "would overwrite them. Release after the backward that reads it (or save a copy, e.g. "
                "FP8/FP4 expert GEMMs save the quantized input)"
            )
        if self._cuda:
            if stream is None:
                stream = self._ops.current_stream()
            elif self.debug:
                self._check_stream(stream)
                if tensor.device != self.device:
                    raise ForeignTensorError(f"ring '{self.name}': tensor on {tensor.device}, ring on {self.device}")
            event = slot.capture_event if self._phase is Phase.CAPTURING else slot.eager_event
            self._ops.record(event, stream)
            slot.wait_on = event
            slot.wait_stream = stream
        slot.live = None
        self._held -= 1
        self._releases += 1

    # --- pure probes ----------------------------------------------------------------------------------

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a live acquisition of this ring (the object ``acquire`` returned). Pure."""
        slot = self._by_id.get(id(tensor))
        return slot is not None and slot.live is tensor

    def is_ring_storage(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` aliases this ring's storage, live or stale (by storage pointer). Pure.

        This is the probe for paths that free or offload their inputs (``ScheduleNode.free_input``):
        they must skip ring storage, whatever the alias's generation.
        """
        return storage_ptr(tensor) == self._storage_ptr

    def slot_of(self, tensor: torch.Tensor) -> int | None:
        """Index of the slot ``tensor``'s first element lies in, or ``None`` if not ring storage. Pure.

        Uses the storage offset, not ``data_ptr()`` (which is 0 for a zero-row view).
        """
        if not self.is_ring_storage(tensor):
            return None
        offset = tensor.storage_offset() * tensor.element_size()
        return min(max(offset, 0) // self.slot_bytes, self.num_slots - 1)

    # --- state ----------------------------------------------------------------------------------------

    @property
    def stats(self) -> RingStats:
        """A snapshot of this ring's counters."""
        return RingStats(
            acquisitions=self._acquisitions,
            releases=self._releases,
            gpu_waits=self._gpu_waits,
            peak_held=self._peak_held,
            persistent_bytes=self.persistent_bytes,
        )

    @property
    def held(self) -> int:
        """Acquisitions not yet released."""
        return self._held

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def cursor(self) -> int:
        """Slot the next ``acquire`` tries first."""
        return self._cursor

    # --- CUDA-graph phases (BufferPool drives these for all its rings at once) -------------------------

    def check_idle(self, what: str) -> None:
        """Raise ``CaptureStateError`` naming the held slots if any slot is held."""
        if self._held:
            held = ", ".join(f"slot {s.index} (generation {s.generation})" for s in self._slots if s.live is not None)
            raise CaptureStateError(
                f"ring '{self.name}': {what} with {self._held} slot(s) held: {held}; release them first"
            )

    def prepare_capture(self, stream: Any = None) -> None:
        """Before capture: ``stream`` waits on every outstanding release event, eager events are forgotten
        (a wait inside capture on an event recorded before it invalidates the capture), cursor reset."""
        if self._phase is Phase.CAPTURING:
            raise CaptureStateError(f"ring '{self.name}': prepare_capture while already capturing")
        self.check_idle("prepare_capture")
        if self._cuda:
            stream = self._ops.current_stream() if stream is None else stream
            if is_capturing(self.device):
                raise CaptureStateError(f"ring '{self.name}': prepare_capture must run before capture begins")
            for slot in self._slots:
                if slot.wait_on is not None and slot.wait_stream is not stream:
                    self._ops.wait(slot.wait_on, stream)
                    self._gpu_waits += 1
            self._ops.record(self._fence, stream)  # eager, pre-capture: safe to wait on after an abort
        self._forget(None, None)
        self._cursor = 0
        self._phase = Phase.CAPTURING

    def finish_capture(self) -> None:
        """After capture: capture-time events are forgotten (eager code must never wait on them)."""
        if self._phase is not Phase.CAPTURING:
            raise CaptureStateError(
                f"ring '{self.name}': finish_capture without prepare_capture (phase {self._phase.value})"
            )
        self.check_idle("finish_capture (a captured step must release every slot it acquires)")
        self._forget(None, None)
        self._cursor = 0
        self._phase = Phase.GRAPHED

    def after_replay(self, stream: Any = None) -> None:
        """Before eager use after replays: the first producer of each slot waits once on ``stream``
        (the replay stream, via one eager fence event); stream order replaces capture-time events."""
        if self._phase is not Phase.GRAPHED:
            raise CaptureStateError(
                f"ring '{self.name}': after_replay needs a finished capture (phase {self._phase.value})"
            )
        if self._cuda:
            stream = self._ops.current_stream() if stream is None else stream
            self._ops.record(self._fence, stream)
            self._forget(self._fence, stream)
        self._cursor = 0
        self._phase = Phase.EAGER

    def abort_capture(self) -> None:
        """After a failed capture (nothing ran on the GPU): drop held slots, back to eager, ordered after
        the pre-capture fence."""
        if self._phase is not Phase.CAPTURING:
            return
        for slot in self._slots:
            slot.live = None
            slot.saved_refs = 0
        self._by_id.clear()
        self._gen_tags.clear()
        self._held = 0
        self._forget(self._fence if self._cuda else None, None)
        self._cursor = 0
        self._phase = Phase.EAGER

    # --- internals ------------------------------------------------------------------------------------

    def _forget(self, event: Any, stream: Any) -> None:
        for slot in self._slots:
            slot.wait_on = event
            slot.wait_stream = stream

    def _next_free(self) -> _Slot:
        n = self.num_slots
        for step in range(1, n):
            slot = self._slots[(self._cursor + step) % n]
            if slot.live is None:
                return slot
        slot = self._slots[self._cursor]
        need = self._held + 1
        raise EarlyReuseError(
            f"ring '{self.name}': slot {slot.index} (generation {slot.generation}) is still held and all "
            f"{n} slot(s) are in use; this schedule needs at least {need} slots (acquisitions outstanding + 1): "
            f"raise the slot count to >= {need}, or release each buffer after its final reader",
            ring=self.name,
            slot=slot.index,
            generation=slot.generation,
            min_depth=need,
        )

    def _rows(self, shape: Sequence[int]) -> int:
        bound = self.max_shape
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
        slot = self._slots[self.slot_of(tensor) or 0]
        tag = self._gen_tags.get(id(tensor))
        alias_gen = f" of generation {tag[1]}" if tag is not None and tag[0]() is tensor else ""
        if slot.live is None:
            return DoubleReleaseError(
                f"ring '{self.name}' slot {slot.index}: already released (last generation {slot.generation}); "
                "each acquisition is released exactly once, by its final reader"
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
