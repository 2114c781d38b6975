"""The ring's phase changes (CUDA graphs) and recovery, as a mixin of :class:`BufferRing`.

Cycle: eager warm-up -> ``prepare_capture`` -> capture -> ``finish_capture`` -> replays ->
``after_replay`` -> eager -> ``before_replay`` -> replays -> ``after_replay`` -> eager ...

* A captured iteration bakes slot addresses into the graph and starts at slot 0, so every capture and
  every replay must find the ring idle with its cursor at 0.
* Waits inside a capture may only use events recorded in the same capture: eager events are forgotten
  at each boundary; eager producers after replays are ordered by one fence on the replay stream
  (``after_replay``); replays after eager use are ordered by the replay stream waiting on every
  outstanding eager release event (``before_replay``).
* ``reset`` is the way back after an error in the middle of a step: synchronise, forget every holder.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from bufreuse.pool._device import is_capturing
from bufreuse.pool._state import Phase
from bufreuse.pool.errors import CaptureStateError

if TYPE_CHECKING:
    from bufreuse.pool._state import _Slot

__all__ = ["RingLifecycle"]

_log = logging.getLogger("bufreuse.pool")


class RingLifecycle:
    """Phase transitions and ``reset`` of a ring (state lives on :class:`BufferRing`)."""

    name: str
    device: torch.device
    num_slots: int
    max_bytes: int | None
    persistent_bytes: int
    _slots: list[_Slot]
    _phase: Phase
    _frozen: bool
    _grown: int
    _cuda: bool
    _ops: Any
    _fence: Any
    _gpu_waits: int
    _cursor: int
    _held: int
    _deferred_freed: int
    _epoch: int
    _by_id: dict
    _gen_tags: dict
    _fallback: dict
    _spare_events: list
    _lock: Any

    def check_idle(self, what: str) -> None:
        """Raise ``CaptureStateError`` naming the held slots if anything is held.

        Raises:
            CaptureStateError: a slot (deferred releases included) or a fallback allocation is held.
        """
        held_slots = self._held - self._deferred_freed
        if held_slots or self._fallback:
            held = ", ".join(
                f"slot {s.index} (generation {s.generation}) {s.state()}" for s in self._slots if s.live is not None
            )
            if self._fallback:
                held += f"{', ' if held else ''}{len(self._fallback)} fallback allocation(s)"
            raise CaptureStateError(
                f"ring '{self.name}': {what} with {held_slots + len(self._fallback)} acquisition(s) held: {held}; "
                "release them first"
            )

    def prepare_capture(self, stream: Any = None) -> None:
        """Before capture: order ``stream`` after outstanding releases, forget eager events, cursor to 0.

        An ``auto`` ring stops growing here (its depth is settled; one log line says which).

        Raises:
            CaptureStateError: already capturing, a slot held, or called under capture.
        """
        if self._phase is Phase.CAPTURING:
            raise CaptureStateError(f"ring '{self.name}': prepare_capture while already capturing")
        self.check_idle("prepare_capture")
        if self._cuda:
            stream = self._ops.current_stream() if stream is None else stream
            if is_capturing(self.device):
                raise CaptureStateError(f"ring '{self.name}': prepare_capture must run before capture begins")
            self._join_releases(stream)
            self._ops.record(self._fence, stream)  # eager, pre-capture: safe to wait on after an abort
        self._settle()
        self._forget(None, None)
        self._cursor = 0
        self._phase = Phase.CAPTURING

    def finish_capture(self) -> None:
        """After capture: capture-time events are forgotten (eager code must never wait on them).

        Raises:
            CaptureStateError: not capturing, or the captured step left a slot held.
        """
        if self._phase is not Phase.CAPTURING:
            raise CaptureStateError(
                f"ring '{self.name}': finish_capture without prepare_capture (phase {self._phase.value})"
            )
        self.check_idle("finish_capture (a captured step must release every slot it acquires)")
        self._forget(None, None)
        self._cursor = 0
        self._phase = Phase.GRAPHED

    def before_replay(self, stream: Any = None) -> None:
        """Before replaying a graph on ``stream`` after eager use: ``stream`` waits on every outstanding
        eager release event (GPU side), the events are forgotten and the cursor goes to 0.

        A no-op when no eager use happened since the capture (phase still graphed).

        Raises:
            CaptureStateError: capturing, or a slot (or fallback allocation) still held.
        """
        if self._phase is Phase.GRAPHED:
            return
        if self._phase is Phase.CAPTURING:
            raise CaptureStateError(f"ring '{self.name}': before_replay during a capture; call finish_capture first")
        self.check_idle("before_replay (the graph rewrites every slot it captured)")
        if self._cuda:
            stream = self._ops.current_stream() if stream is None else stream
            self._join_releases(stream)
        self._settle()
        self._forget(None, None)
        self._cursor = 0
        self._phase = Phase.GRAPHED

    def after_replay(self, stream: Any = None) -> None:
        """Before eager use after replays: the first producer of each slot waits once on ``stream``
        (the replay stream, via one eager fence event); stream order replaces capture-time events.

        Raises:
            CaptureStateError: no finished capture (or ``before_replay``) to follow.
        """
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
        with self._lock:
            self._drop_holders()
            self._forget(self._fence if self._cuda else None, None)
            self._cursor = 0
            self._phase = Phase.EAGER

    def reset(self, *, synchronize: bool = True) -> None:
        """Recover after an error mid-step: synchronise the device, forget every holder, keep the storage.

        Held slots, deferred releases, autograd-saved references (their later frees are ignored), holds,
        fallback allocations and pending events are forgotten; cursor to 0; phase eager (a captured graph
        stays valid: call ``before_replay`` before replaying it). Counters are kept.

        Args:
            synchronize: wait for all GPU work of the device first (``BufferPool.reset`` does it once).

        Raises:
            CaptureStateError: called during CUDA-graph capture.
        """
        if self._cuda and is_capturing(self.device):
            raise CaptureStateError(f"ring '{self.name}': reset during CUDA-graph capture; end the capture first")
        if synchronize and self._cuda:
            torch.cuda.synchronize(self.device)
        with self._lock:
            self._drop_holders()
            self._forget(None, None)
            self._cursor = 0
            self._phase = Phase.EAGER

    # --- internals ------------------------------------------------------------------------------------

    def _drop_holders(self) -> None:
        self._epoch += 1  # saved refs and holds of earlier epochs no longer count
        for slot in self._slots:
            slot.live = None
            slot.saved_refs = 0
            slot.holds = 0
            slot.pending = False
            self._spare_events.extend(event for _, event, _late in slot.marks)
            slot.marks.clear()
        self._by_id.clear()
        self._gen_tags.clear()
        self._fallback.clear()
        self._held = self._deferred_freed  # held = _held - _deferred_freed = 0

    def _join_releases(self, stream: Any) -> None:
        for slot in self._slots:
            if slot.wait_on is not None and slot.wait_stream is not stream:
                if slot.late:
                    self._record_late(slot, switch=False)  # a capture stream joins once
                self._ops.wait(slot.wait_on, stream)
                self._gpu_waits += 1

    def _forget(self, event: Any, stream: Any) -> None:
        for slot in self._slots:
            slot.wait_on = event
            slot.wait_stream = stream
            slot.late = False

    def settle(self) -> None:
        """An ``auto`` ring stops growing; one log line gives the depth it settled on (once)."""
        self._settle()

    def _settle(self) -> None:
        if self._frozen:
            return
        self._frozen = True
        _log.info(
            "bufreuse: ring '%s' (num_slots='auto') settled at %d slots (%d grown, %d bytes of max_bytes=%d)",
            self.name, self.num_slots, self._grown, self.persistent_bytes, self.max_bytes,
        )  # fmt: skip
