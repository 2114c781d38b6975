"""The two allocator-backed policies, behind the same interface as `BufferRing`.

* ``record-stream`` (the control, what Megatron does today): ``acquire`` is ``torch.empty`` on the
  producer stream; ``release`` calls ``tensor.record_stream(consumer)`` and drops the pool's reference.
  The block then sits in the caching allocator's pending-free queue until the consumer's work is seen
  complete.
* ``stream-ordered`` (Megatron-LM PR 6883): ``acquire`` is ``torch.empty`` on the producer stream;
  ``release`` records one reusable event on the consumer stream, makes the producer stream wait on it,
  and drops the tensor without ``record_stream``: the block is reusable at once by later work on the
  producer stream, at the price of a wait the producer stream would not otherwise have.

Both keep the same misuse checks as a ring (shape bound, double release, foreign tensor) so control and
feature runs fail identically at the same call sites. No persistent memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from bufreuse.pool._config import check_config, resolve_device
from bufreuse.pool._device import DeviceOps, env_debug, is_capturing
from bufreuse.pool._state import Phase, RingStats
from bufreuse.pool.errors import CaptureStateError, DoubleReleaseError, ForeignTensorError, StaticShapeError
from bufreuse.pool.tracking import Hold

__all__ = ["AllocatingBuffer"]


class AllocatingBuffer:
    """A named buffer kind served by the caching allocator (``policy`` 'record-stream' or 'stream-ordered')."""

    num_slots = 0
    slot_bytes = 0
    persistent_bytes = 0

    def __init__(
        self,
        name: str,
        policy: str,
        max_shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        debug: bool | None = None,
    ) -> None:
        if policy not in ("record-stream", "stream-ordered"):
            raise ValueError(f"AllocatingBuffer policy must be 'record-stream' or 'stream-ordered', got {policy!r}")
        self.max_shape = check_config(name, 1, max_shape, dtype)
        self.name = name
        self.policy = str(policy)
        self.dtype = dtype
        self.device = resolve_device(device)
        self.debug = env_debug() if debug is None else bool(debug)
        self._ops = DeviceOps(self.device)
        self._cuda = self._ops.cuda
        self._stream_ordered = policy == "stream-ordered"
        self._eager_event = self._ops.new_event() if self._stream_ordered else None
        self._capture_event = self._ops.new_event() if self._stream_ordered else None
        self._live: dict[int, tuple[torch.Tensor, Any]] = {}
        self._released: dict[int, weakref.ref] = {}
        self._phase = Phase.EAGER
        self._acquisitions = 0
        self._empty = 0  # zero-row acquisitions
        self._releases = 0
        self._gpu_waits = 0
        self._peak_held = 0

    def __repr__(self) -> str:
        return (
            f"AllocatingBuffer(name={self.name!r}, policy={self.policy!r}, max_shape={self.max_shape}, "
            f"held={self.held})"
        )

    def acquire(self, shape: Sequence[int] | None = None, stream: Any = None, *, dtype: torch.dtype | None = None):
        """``torch.empty`` of ``shape`` (default: the bound) allocated on the producer ``stream``."""
        if self._phase is Phase.GRAPHED:
            raise CaptureStateError(
                f"buffer '{self.name}': acquire after a CUDA-graph capture; call after_replay(stream)"
            )
        if dtype is not None and dtype != self.dtype:
            raise StaticShapeError(f"buffer '{self.name}': requested dtype {dtype}, buffer holds {self.dtype}")
        if shape is None:
            shape = self.max_shape
        elif shape != self.max_shape:
            self._check_shape(shape)
        if self._cuda:
            if stream is None:
                stream = self._ops.current_stream()
            if self._ops.stream_is_current(stream):
                tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
            else:
                with torch.cuda.stream(stream):
                    tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        else:
            tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._live[id(tensor)] = (tensor, stream)
        self._acquisitions += 1
        if not tensor.shape[0]:
            self._empty += 1
        if len(self._live) > self._peak_held:
            self._peak_held = len(self._live)
        return tensor

    def release(self, tensor: torch.Tensor, stream: Any = None) -> None:
        """Hand ``tensor`` back after its final read on the consumer ``stream`` (see the module doc)."""
        entry = self._live.pop(id(tensor), None)
        if entry is None or entry[0] is not tensor:
            if entry is not None:
                self._live[id(tensor)] = entry
            ref = self._released.get(id(tensor))
            if ref is not None and ref() is tensor:
                raise DoubleReleaseError(f"buffer '{self.name}': tensor already released ({self.policy})")
            raise ForeignTensorError(
                f"buffer '{self.name}': release of a tensor it did not hand out ({self.policy}); "
                "release only what acquire() returned"
            )
        if self._cuda:
            if stream is None:
                stream = self._ops.current_stream()
            producer = entry[1]
            if self._stream_ordered:
                if producer is not stream:
                    event = self._capture_event if self._phase is Phase.CAPTURING else self._eager_event
                    self._ops.record(event, stream)
                    self._ops.wait(event, producer)
                    self._gpu_waits += 1
            else:
                tensor.record_stream(stream)
        self._releases += 1
        released = self._released
        key = id(tensor)
        released[key] = weakref.ref(tensor, lambda _r, _k=key, _d=released: _d.pop(_k, None))

    def release_when_unsaved(self, tensor: torch.Tensor, stream: Any = None) -> bool:
        """``release`` now (returns True): autograd's own reference keeps an allocator block alive, and
        the policy's stream semantics order its reuse, exactly as in the control."""
        self.release(tensor, stream)
        return True

    def hold(self, tensor: torch.Tensor) -> Hold:
        """A :class:`Hold` keeping ``tensor`` alive; ``done(stream)`` records ``stream`` on it."""
        if not isinstance(tensor, torch.Tensor):
            raise ForeignTensorError(f"buffer '{self.name}': hold of a {type(tensor).__name__}, not a tensor")
        return Hold(tensor=tensor)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a live acquisition of this buffer. Pure."""
        entry = self._live.get(id(tensor))
        return entry is not None and entry[0] is tensor

    def is_ring_storage(self, tensor: torch.Tensor) -> bool:
        """Always False: allocator-backed buffers own no persistent storage."""
        return False

    def saved_references(self, tensor: torch.Tensor) -> int:
        """Always 0: saved references are counted on ring storage only."""
        return 0

    @property
    def held(self) -> int:
        return len(self._live)

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def stats(self) -> RingStats:
        return RingStats(
            acquisitions=self._acquisitions,
            empty_acquisitions=self._empty,
            releases=self._releases,
            gpu_waits=self._gpu_waits,
            peak_held=self._peak_held,
            persistent_bytes=0,
        )

    def reset(self, *, synchronize: bool = True) -> None:
        """Forget every acquisition (after an error mid-step) and return to eager; see ``BufferRing.reset``."""
        if self._cuda and is_capturing(self.device):
            raise CaptureStateError(f"buffer '{self.name}': reset during CUDA-graph capture; end the capture first")
        if synchronize and self._cuda:
            torch.cuda.synchronize(self.device)
        self._live.clear()
        self._phase = Phase.EAGER

    def check_idle(self, what: str) -> None:
        if self._live:
            raise CaptureStateError(
                f"buffer '{self.name}': {what} with {len(self._live)} acquisition(s) held; release them first"
            )

    def prepare_capture(self, stream: Any = None) -> None:
        if self._phase is Phase.CAPTURING:
            raise CaptureStateError(f"buffer '{self.name}': prepare_capture while already capturing")
        self.check_idle("prepare_capture")
        self._phase = Phase.CAPTURING

    def finish_capture(self) -> None:
        if self._phase is not Phase.CAPTURING:
            raise CaptureStateError(
                f"buffer '{self.name}': finish_capture without prepare_capture (phase {self._phase.value})"
            )
        self.check_idle("finish_capture (a captured step must release every buffer it acquires)")
        self._phase = Phase.GRAPHED

    def before_replay(self, stream: Any = None) -> None:
        """Before replays after eager use: nothing may be held; no events to join (the allocator orders)."""
        if self._phase is Phase.GRAPHED:
            return
        if self._phase is Phase.CAPTURING:
            raise CaptureStateError(f"buffer '{self.name}': before_replay during a capture")
        self.check_idle("before_replay")
        self._phase = Phase.GRAPHED

    def after_replay(self, stream: Any = None) -> None:
        if self._phase is not Phase.GRAPHED:
            raise CaptureStateError(
                f"buffer '{self.name}': after_replay needs a finished capture (phase {self._phase.value})"
            )
        self._phase = Phase.EAGER

    def abort_capture(self) -> None:
        if self._phase is Phase.CAPTURING:
            self._live.clear()
            self._phase = Phase.EAGER

    def _check_shape(self, shape: Sequence[int]) -> None:
        bound = self.max_shape
        try:
            req = tuple(int(d) for d in shape)
        except TypeError:
            req = None
        if req is None or len(req) != len(bound) or req[1:] != bound[1:] or not 0 <= req[0] <= bound[0]:
            raise StaticShapeError(
                f"buffer '{self.name}': requested shape {shape!r} does not fit the static bound {bound} "
                f"({self.dtype}); only the leading dimension may be smaller"
            )
