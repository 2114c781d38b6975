"""The autograd guard: ring storage saved for backward must not be released before that backward.

Mechanism (``torch.autograd.graph.saved_tensors_hooks``):

* **pack** (forward, per saved tensor): a tensor whose storage is ring storage is wrapped in a
  ``_SavedRingRef`` that remembers (ring, slot, generation) and increments the slot's ``saved_refs``.
  Saving a slot that is not held (a stale alias) raises at once.
* **release** of a slot with ``saved_refs > 0`` raises ``SavedForBackwardError`` before any GPU work:
  this is what catches the bf16 expert linear that saves its input (a view of the dispatch slot) when
  the slot is released after the forward. The count drops when autograd frees the saved variable (after
  the backward that used it, or when the graph is dropped), so releasing after the backward passes.
* **unpack** (backward) re-checks the generation and raises if the slot was acquired again since
  (a second line for saves made outside the guard's release check, e.g. after a capture abort).

Costs about 1 us per saved tensor (a storage-pointer lookup); nothing for tensors not saved.
Hooks do not nest: inside this guard an outer ``saved_tensors_hooks`` (activation offload) is inactive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bufreuse.pool._config import storage_ptr
from bufreuse.pool.errors import SavedForBackwardError
from bufreuse.pool.ring import BufferRing

__all__ = ["autograd_guard"]


class _SavedRingRef:
    __slots__ = ("generation", "ring", "slot", "tensor")

    def __init__(self, tensor: torch.Tensor, ring: BufferRing, slot: Any) -> None:
        self.tensor = tensor
        self.ring = ring
        self.slot = slot
        self.generation = slot.generation
        slot.saved_refs += 1

    def unpack(self) -> torch.Tensor:
        if self.slot.generation != self.generation:
            raise SavedForBackwardError(
                f"ring '{self.ring.name}' slot {self.slot.index}: backward reads a tensor saved at generation "
                f"{self.generation}, but the slot was acquired again since (generation {self.slot.generation}) "
                "and may hold another microbatch's data; release ring buffers only after the backward that reads them"
            )
        return self.tensor

    def __del__(self) -> None:
        slot = self.slot
        if slot.saved_refs > 0:
            slot.saved_refs -= 1


@contextmanager
def autograd_guard(rings_by_storage: dict[int, BufferRing]) -> Iterator[None]:
    """Install pack/unpack hooks that track ring storage saved for backward (see the module doc)."""

    def pack(tensor: torch.Tensor) -> Any:
        ring = rings_by_storage.get(storage_ptr(tensor))
        if ring is None:
            return tensor
        index = ring.slot_of(tensor)
        slot = ring._slots[index or 0]
        if slot.live is None:
            raise SavedForBackwardError(
                f"ring '{ring.name}' slot {slot.index}: a tensor aliasing a released slot (last generation "
                f"{slot.generation}) is being saved for backward; its data may be overwritten by the next "
                "acquisition. Keep the buffer acquired until after backward, or save a copy"
            )
        return _SavedRingRef(tensor, ring, slot)

    def unpack(packed: Any) -> torch.Tensor:
        if type(packed) is _SavedRingRef:
            return packed.unpack()
        return packed

    hooks: Callable[..., Any] = torch.autograd.graph.saved_tensors_hooks
    with hooks(pack, unpack):
        yield
