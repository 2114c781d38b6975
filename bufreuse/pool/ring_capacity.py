"""What a ring does when every slot is held, as a mixin of :class:`BufferRing`.

In order: another free slot in rotation; ``num_slots='auto'`` growth by one slot (eager phase, not
frozen, within ``max_bytes``; a new storage allocation, registered with the pool's storage registry so
the probes and ``track_saved`` see it); ``on_exhausted='allocate'``: a ``torch.empty`` on the producer
stream, released with ``record_stream`` on the consumer stream, warned about once per ring; else
``EarlyReuseError`` naming the depth needed and why the ring could not provide it. Under CUDA-graph
capture neither growth nor fallback allocation happens (``CaptureStateError``).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from bufreuse.pool._device import is_capturing
from bufreuse.pool._state import Phase, StorageIndex, _Slot
from bufreuse.pool.errors import CaptureStateError, EarlyReuseError

__all__ = ["RingCapacity"]

_log = logging.getLogger("bufreuse.pool")


class RingCapacity:
    """Exhaustion handling of a ring (state lives on :class:`BufferRing`)."""

    name: str
    device: torch.device
    dtype: torch.dtype
    max_shape: tuple[int, ...]
    num_slots: int
    slot_bytes: int
    persistent_bytes: int
    max_bytes: int | None
    on_exhausted: str
    _slots: list[_Slot]
    _phase: Phase
    _frozen: bool
    _grown: int
    _cuda: bool
    _ops: Any
    _cursor: int
    _held: int
    _deferred_freed: int
    _stride: int
    _storages: list[torch.Tensor]
    _slot_map: dict[int, tuple[int, int]]
    _registry: StorageIndex
    _fallback: dict[int, tuple[torch.Tensor, Any]]
    _fallback_done: weakref.WeakValueDictionary
    _fallbacks: int
    _acquisitions: int
    _empty: int
    _releases: int
    _peak_held: int
    _warned: bool

    def _next_free(self) -> _Slot | None:
        n = self.num_slots
        for step in range(1, n):
            slot = self._slots[(self._cursor + step) % n]
            if slot.live is None:
                return slot
        return self._exhausted()

    def _exhausted(self) -> _Slot | None:
        slot, need = self._slots[self._cursor], self._held - self._deferred_freed + 1
        capturing = self._phase is Phase.CAPTURING or (self._cuda and is_capturing(self.device))
        growable = self.max_bytes is not None
        fits = growable and (self.num_slots + 1) * self.slot_bytes <= self.max_bytes
        if capturing and (growable or self.on_exhausted == "allocate"):
            raise CaptureStateError(
                f"ring '{self.name}': every slot is held under CUDA-graph capture and the ring cannot grow or "
                f"allocate there; this schedule needs at least {need} slots: warm up eagerly with the same "
                "schedule first (num_slots='auto' grows then) or raise the slot count"
            )
        if growable and not self._frozen and fits:
            return self._grow(need)
        if self.on_exhausted == "allocate":
            return None
        if growable and not self._frozen:
            why = (
                f"num_slots='auto' reached its cap max_bytes={self.max_bytes} "
                f"({self.num_slots} slot(s) of {self.slot_bytes} bytes)"
            )
            fix = f"raise max_bytes to >= {need * self.slot_bytes}"
        elif growable:
            why = f"num_slots='auto' settled at {self.num_slots} slot(s) at prepare_capture and no longer grows"
            fix = f"warm up with the deepest schedule before capture, or register >= {need} slots"
        else:
            why = f"all {self.num_slots} slot(s) are in use"
            fix = f"raise the slot count to >= {need}"
        raise EarlyReuseError(
            f"ring '{self.name}': slot {slot.index} (generation {slot.generation}) is {slot.state()}; {why}; "
            f"this schedule needs at least {need} slots (acquisitions outstanding + 1): {fix}, or release each "
            "buffer after its final reader (release_when_unsaved)",
            ring=self.name,
            slot=slot.index,
            generation=slot.generation,
            min_depth=need,
        )

    def _grow(self, need: int) -> _Slot:
        storage = torch.empty(self._stride, dtype=self.dtype, device=self.device)
        ptr = storage.untyped_storage().data_ptr()
        slot = self._new_slot(self.num_slots, storage, 0)
        self._storages.append(storage)
        self._slot_map[ptr] = (slot.index, 1)
        self._registry.add(ptr, storage.untyped_storage().nbytes(), self)
        self._slots.append(slot)
        self.num_slots += 1
        self.persistent_bytes += self.slot_bytes
        self._grown += 1
        _log.info(
            "bufreuse: ring '%s' grew to %d slots (%d bytes of max_bytes=%d): %d acquisitions were outstanding",
            self.name, self.num_slots, self.persistent_bytes, self.max_bytes, need - 1,
        )  # fmt: skip
        return slot

    def _fallback_acquire(self, shape: Sequence[int] | None, stream: Any) -> torch.Tensor:
        size = self.max_shape if shape is None or shape == self.max_shape else (self._rows(shape), *self.max_shape[1:])
        if self._cuda:
            if stream is None:
                stream = self._ops.current_stream()
            if self._ops.stream_is_current(stream):
                tensor = torch.empty(size, dtype=self.dtype, device=self.device)
            else:
                with torch.cuda.stream(stream):
                    tensor = torch.empty(size, dtype=self.dtype, device=self.device)
        else:
            tensor = torch.empty(size, dtype=self.dtype, device=self.device)
        self._fallback[id(tensor)] = (tensor, stream)
        self._fallbacks += 1
        self._acquisitions += 1
        if not size[0]:
            self._empty += 1
        held = self._held - self._deferred_freed + len(self._fallback)
        if held > self._peak_held:
            self._peak_held = held
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"bufreuse: ring '{self.name}': all {self.num_slots} slot(s) held ({held} acquisitions "
                "outstanding); serving acquisitions from the caching allocator (on_exhausted='allocate'). "
                "Counted in stats().fallback_allocations; warned once per ring",
                RuntimeWarning,
                stacklevel=4,
            )
        return tensor

    def _release_other(self, tensor: Any, stream: Any) -> None:
        entry = self._fallback.pop(id(tensor), None)
        if entry is not None and entry[0] is tensor:
            if self._cuda:
                stream = self._ops.current_stream() if stream is None else stream
                if stream is not entry[1]:
                    tensor.record_stream(stream)
            self._fallback_done[id(tensor)] = tensor
            self._releases += 1
            return
        if entry is not None:
            self._fallback[id(tensor)] = entry
        raise self._bad_release(tensor)
