"""Release by fact: count autograd's saved references to ring storage, and explicit deferred readers.

A ring slot may be reused only after its *last* reader. In a training step the last reader is often
not the forward consumer that calls ``release`` but autograd (the bf16 expert GEMM saves its input, a
view of the dispatch slot, for backward) or a deferred weight-gradient pass outside autograd
(TE/Megatron's wgrad store, read in ``backward_dw()``). This module makes both facts visible:

* :func:`track_saved` (a :class:`SavedTracker`) pushes ``torch.autograd.graph.saved_tensors_hooks``.
  **pack** tests the saved
  tensor's data pointer against the byte spans of the pool's ring storages (a few integer
  comparisons; every other tensor passes through untouched) and, for ring storage of a held slot,
  returns a :class:`_SavedRef` that counts one saved reference on (ring, slot, generation). Autograd
  frees the holder when it frees the saved variable — after enqueuing the backward that read it,
  or when the graph is dropped — and the holder's ``__del__`` takes the count back down. **unpack**
  hands the tensor back, raising ``SavedForBackwardError`` if the slot was acquired again since (its
  data may be another microbatch's).
* :class:`Hold` (``pool.hold(name, tensor)``) is a reader outside autograd's saved tensors; the slot is
  released only after every hold is ``done``.

``BufferPool.release_when_unsaved`` releases at once when nothing is saved or held, else defers the
release to the moment the last saved reference is freed and every hold is done; see
:meth:`bufreuse.pool.BufferRing.release_when_unsaved` for the stream the release is recorded on.

Strict mode (``strict=True``, what ``pool.autograd_guard()`` and debug mode use) additionally raises at
pack when an alias of a *released* slot is saved. Saved-tensor hooks do not nest: inside this context
an outer ``saved_tensors_hooks`` pair (activation offload) is inactive, so scope it to the region whose
saved tensors may alias ring storage (dispatch -> experts -> combine).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from bufreuse.pool._device import saved_hooks_push_pop
from bufreuse.pool._state import Phase, StorageIndex
from bufreuse.pool.errors import SavedForBackwardError

if TYPE_CHECKING:
    from bufreuse.pool.ring import BufferRing, _Slot

__all__ = ["Hold", "SavedRefCounting", "SavedTracker", "track_saved"]


class _SavedRef:
    """One autograd-saved reference to a held slot; freeing it (autograd drops it) counts it down."""

    __slots__ = ("epoch", "generation", "ring", "slot", "tensor")

    def __init__(self, tensor: torch.Tensor, ring: BufferRing, slot: _Slot, epoch: int) -> None:
        self.tensor = tensor
        self.ring = ring
        self.slot = slot
        self.generation = slot.generation
        self.epoch = epoch

    def unpack(self) -> torch.Tensor:
        slot = self.slot
        if slot.generation != self.generation:
            raise SavedForBackwardError(
                f"ring '{self.ring.name}' slot {slot.index}: backward reads a tensor saved at generation "
                f"{self.generation}, but the slot was acquired again since (generation {slot.generation}) and "
                "may hold another microbatch's data; release ring buffers with release_when_unsaved() (or "
                "only after the backward that reads them)"
            )
        return self.tensor

    def __del__(self) -> None:
        ring = self.ring
        if ring is not None:
            ring._untrack(self.slot, self.generation, self.epoch)


class Hold:
    """A reader of a buffer outside autograd's saved tensors; the slot stays held until :meth:`done`.

    Made by ``pool.hold(name, tensor)``. For ring storage the hold counts on (ring, slot, generation);
    for an allocator-backed tensor (policy ``record-stream``/``stream-ordered``, or a ring's fallback
    allocation) the hold keeps a reference to the tensor, and ``done(stream)`` records that stream on it
    (``record_stream``) before dropping it. Also a context manager (``done()`` on exit).
    """

    __slots__ = ("_epoch", "_generation", "_ring", "_slot", "_tensor")

    def __init__(
        self,
        *,
        ring: BufferRing | None = None,
        slot: _Slot | None = None,
        epoch: int = 0,
        tensor: torch.Tensor | None = None,
    ) -> None:
        self._ring = ring
        self._slot = slot
        self._generation = slot.generation if slot is not None else 0
        self._epoch = epoch
        self._tensor = tensor

    @property
    def active(self) -> bool:
        """Whether :meth:`done` has not been called yet."""
        return self._ring is not None or self._tensor is not None

    def done(self, stream: Any = None) -> None:
        """Mark the deferred read finished on ``stream`` (default: the current stream). Idempotent.

        If this was the last thing keeping a slot whose release was deferred, the release event is
        recorded on ``stream`` now.
        """
        ring, tensor = self._ring, self._tensor
        self._ring = self._tensor = None
        if ring is not None and self._slot is not None:
            ring._hold_done(self._slot, self._generation, self._epoch, stream)
        elif tensor is not None and stream is not None and tensor.is_cuda:
            tensor.record_stream(stream)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()

    def __repr__(self) -> str:
        if self._slot is not None:
            where = f"ring '{self._ring.name if self._ring else '?'}' slot {self._slot.index}"
            return f"Hold({where}, generation {self._generation}, active={self.active})"
        return f"Hold(allocator tensor, active={self.active})"


class SavedRefCounting:
    """The ring side of the counting (a mixin of :class:`BufferRing`): called from pack, from a holder's
    ``__del__`` and from ``Hold.done``, on any thread, under the ring's lock."""

    name: str
    debug: bool
    _slots: list[_Slot]
    _lock: Any
    _epoch: int
    _cuda: bool
    _ops: Any
    _spare_events: list[Any]
    _deferred_freed: int
    _deferred_waits: int
    _elide: bool
    _phase: Phase
    _marks_elided: int

    def _track(self, tensor: torch.Tensor, ptr: int, strict: bool) -> Any:
        with self._lock:
            slot = self._slot_for(tensor, ptr)
            if slot.live is None:
                if strict:
                    raise SavedForBackwardError(
                        f"ring '{self.name}' slot {slot.index}: a tensor aliasing a released slot (last "
                        f"generation {slot.generation}) is being saved for backward; its data may be overwritten "
                        "by the next acquisition. Keep the buffer acquired (release_when_unsaved), or save a copy"
                    )
                return tensor
            slot.saved_refs += 1
            return _SavedRef(tensor, self, slot, self._epoch)

    def _untrack(self, slot: _Slot, generation: int, epoch: int) -> None:
        with self._lock:
            if epoch != self._epoch or slot.generation != generation or slot.saved_refs <= 0:
                return
            slot.saved_refs -= 1
            self._reader_done(slot, None)

    def _hold_done(self, slot: _Slot, generation: int, epoch: int, stream: Any) -> None:
        with self._lock:
            if epoch != self._epoch or slot.generation != generation or slot.holds <= 0:
                return
            slot.holds -= 1
            if self._cuda and stream is not None and self.debug:
                self._check_stream(stream)
            self._reader_done(slot, stream)

    def _reader_done(self, slot: _Slot, stream: Any) -> None:
        if self._cuda and stream is None:
            stream = self._ops.current_stream()
        if slot.pending and not slot.saved_refs and not slot.holds:
            if self._cuda:
                self._deferred_waits += self._record_release(slot, stream, deferred=True)
            elif self.debug:
                self._poison(slot, None)
            slot.pending = False
            slot.live = None  # last: acquire (no lock) sees the event before the free slot
            self._deferred_freed += 1  # the hot path's counters are never written from here
        elif self._cuda:
            self._mark(slot, stream)  # the final release joins this reader's stream

    def _mark(self, slot: _Slot, stream: Any) -> None:
        """A reader on ``stream`` is done with ``slot`` (a deferred slot): the final release must follow it.

        Eager, the mark's event is not recorded now (``late``): if the final release comes on ``stream`` too,
        stream order covers the reader and nothing is recorded; on another stream, ``_record_release`` records
        it then, on ``stream``, before waiting (conservative: it may also cover later work there).
        """
        for mark_stream, event, late in slot.marks:
            if mark_stream is stream:  # re-recording on the same stream still covers the earlier reads
                if not late:
                    self._ops.record(event, stream)
                return
        event = self._spare_events.pop() if self._spare_events else self._ops.new_event()
        if self._elide and self._phase is Phase.EAGER:
            slot.marks.append((stream, event, True))
            self._marks_elided += 1
            return
        self._ops.record(event, stream)
        slot.marks.append((stream, event, False))


class SavedTracker:
    """A reusable ``track_saved`` region over one pool's ring storage.

    The pack/unpack pair is built once (per pool and strictness), so entering a region costs one
    push of torch's default saved-tensor hooks (a C call). Regions nest (an inner one pushes the same
    pair again). ``regions`` counts the outermost entries on the calling path: what the
    integration's "one region per layer call" is measured by. The counters are shared by all threads
    (the hooks themselves are per thread, as torch keeps them).
    """

    __slots__ = ("_depth", "_pop", "_push", "regions", "strict")

    def __init__(self, registry: Mapping[int, BufferRing], *, strict: bool = False) -> None:
        self._push, self._pop = saved_hooks_push_pop(*_pack_unpack(registry, strict))
        self._depth = 0
        self.strict = bool(strict)
        self.regions = 0

    def __enter__(self) -> None:
        self._push()
        if self._depth == 0:
            self.regions += 1
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        self._pop()

    def run(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` inside a region: what ``with tracker:`` does, in one frame (the hot path's form)."""
        self._push()
        if self._depth == 0:
            self.regions += 1
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1
            self._pop()

    @property
    def active(self) -> bool:
        """Whether a region of this tracker is open."""
        return self._depth > 0


def _pack_unpack(registry: Mapping[int, BufferRing], strict: bool) -> tuple[Any, Any]:
    spans = registry.spans if isinstance(registry, StorageIndex) else None

    def pack(tensor: torch.Tensor) -> Any:
        try:
            ptr = tensor.data_ptr()
        except (AttributeError, RuntimeError, TypeError, NotImplementedError):
            return tensor
        for first, end, ring, storage in spans:
            if first <= ptr < end:
                return ring._track(tensor, storage, strict)
        return tensor

    if spans is None:  # a plain mapping: look the storage pointer up
        get = registry.get

        def pack(tensor: torch.Tensor) -> Any:
            try:
                ptr = tensor.untyped_storage().data_ptr()
            except (AttributeError, RuntimeError, TypeError, NotImplementedError):
                return tensor
            ring = get(ptr)
            return tensor if ring is None else ring._track(tensor, ptr, strict)

    def unpack(packed: Any) -> torch.Tensor:
        if type(packed) is _SavedRef:
            return packed.unpack()
        return packed

    return pack, unpack


def track_saved(registry: Mapping[int, BufferRing], *, strict: bool = False) -> SavedTracker:
    """Count autograd-saved references to the ring storage in ``registry`` while the block runs.

    Args:
        registry: storage pointer -> ring, shared with the pool (rings that grow add their new
            storages to it, so the hooks see them).
        strict: also raise ``SavedForBackwardError`` when an alias of a released slot is saved.

    Returns:
        A new :class:`SavedTracker` (``BufferPool.track_saved`` returns the pool's own, built once).

    Raises:
        SavedForBackwardError: at pack (strict) for a released slot; at unpack when the slot was
            acquired again since the save.
    """
    return SavedTracker(registry, strict=strict)
