"""`BufferPool`: named buffer kinds shared across layers, each with a release policy.

Control and feature runs go through the same call sites: a layer calls ``pool.acquire(name, shape,
stream)`` where it used to allocate and ``pool.release(name, tensor, stream)`` where the final reader
is done; the policy decides what happens (ring slot, ``record_stream``, or a stream-ordered free).

CUDA graphs (eager warm-up -> full-iteration capture -> replays -> eager)::

    pool.register(...)                       # all storage allocated here, never during capture
    for _ in range(warmup): step()           # eager
    with pool.graph_capture(s), torch.cuda.graph(g, stream=s):
        step()                               # captured; cursor starts at slot 0, events are capture-only
    for _ in range(n): g.replay()
    pool.after_replay(torch.cuda.current_stream())   # eager producers ordered after the replays
    step()                                   # eager again
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from bufreuse.pool._config import resolve_device, storage_ptr
from bufreuse.pool._device import env_debug
from bufreuse.pool.allocating import AllocatingBuffer
from bufreuse.pool.errors import CaptureStateError, RingConfigError, UnknownBufferError
from bufreuse.pool.guard import autograd_guard
from bufreuse.pool.policy import Policy
from bufreuse.pool.ring import BufferRing, Phase, RingStats
from bufreuse.pool.watchdog import Watchdog

__all__ = ["BufferPool"]


class BufferPool:
    """A registry of named buffers on one device (default: the current CUDA device, else CPU).

    ``debug`` (default ``BUFREUSE_DEBUG``): per-call checks in every ring, a watchdog thread for GPU
    waits that do not finish (``BUFREUSE_WATCHDOG_S``), and ``autograd_guard_if_debug()`` active.
    """

    def __init__(
        self, device: torch.device | str | None = None, *, debug: bool | None = None, watchdog_s: float | None = None
    ) -> None:
        self.device = resolve_device(device)
        self.debug = env_debug() if debug is None else bool(debug)
        self.watchdog: Watchdog | None = Watchdog(watchdog_s) if self.debug and self.device.type == "cuda" else None
        self._entries: dict[str, BufferRing | AllocatingBuffer] = {}
        self._specs: dict[str, tuple[Policy, int, tuple[int, ...], torch.dtype]] = {}
        self._rings_by_storage: dict[int, BufferRing] = {}
        self._phase = Phase.EAGER

    def __repr__(self) -> str:
        names = ", ".join(f"{n}:{s[0].value}/{s[1]}" for n, s in self._specs.items())
        return f"BufferPool(device='{self.device}', phase={self._phase.value}, buffers=[{names}])"

    def register(
        self,
        name: str,
        *,
        policy: Policy | str,
        num_slots: int = 0,
        max_shape: Sequence[int],
        dtype: torch.dtype,
    ) -> None:
        """Declare a buffer kind. Idempotent for identical arguments (every layer may call it).

        ``ring`` needs ``num_slots >= 1`` and allocates ``num_slots`` x bound now; the allocator policies
        need ``num_slots == 0``. Raises ``RingConfigError`` on bad or conflicting arguments and
        ``CaptureStateError`` during capture.
        """
        try:
            pol = Policy(policy)
        except ValueError:
            raise RingConfigError(
                f"buffer '{name}': unknown policy {policy!r}; choose one of {', '.join(p.value for p in Policy)}"
            ) from None
        if pol is Policy.RING and (not isinstance(num_slots, int) or num_slots < 1):
            raise RingConfigError(f"buffer '{name}': policy 'ring' needs num_slots >= 1, got {num_slots!r}")
        if pol is not Policy.RING and num_slots != 0:
            raise RingConfigError(
                f"buffer '{name}': policy '{pol.value}' takes no slots (num_slots=0), got {num_slots}"
            )
        spec = (pol, num_slots, tuple(int(d) for d in max_shape), dtype)
        old = self._specs.get(name)
        if old is not None:
            if old == spec:
                return
            raise RingConfigError(
                f"buffer '{name}' is already registered as policy={old[0].value} num_slots={old[1]} "
                f"max_shape={old[2]} dtype={old[3]}; cannot re-register as policy={pol.value} num_slots={num_slots} "
                f"max_shape={spec[2]} dtype={dtype}"
            )
        if self._phase is Phase.CAPTURING:
            raise CaptureStateError(f"buffer '{name}': register during CUDA-graph capture; register before warm-up")
        if pol is Policy.RING:
            entry: BufferRing | AllocatingBuffer = BufferRing(
                name, num_slots, spec[2], dtype, self.device, debug=self.debug, watchdog=self.watchdog
            )
            self._rings_by_storage[entry._storage_ptr] = entry
        else:
            entry = AllocatingBuffer(name, pol.value, spec[2], dtype, self.device, debug=self.debug)
        entry._phase = self._phase  # registered between capture and after_replay: joins the pool's phase
        self._entries[name] = entry
        self._specs[name] = spec

    # --- hot path -------------------------------------------------------------------------------------

    def acquire(self, name: str, shape: Sequence[int] | None = None, stream: Any = None) -> torch.Tensor:
        """A buffer of ``shape`` for the producer on ``stream`` (see the policy). About 0.1 us over the ring."""
        try:
            entry = self._entries[name]
        except KeyError:
            raise self._unknown(name) from None
        return entry.acquire(shape, stream)

    def release(self, name: str, tensor: torch.Tensor, stream: Any = None) -> None:
        """Hand ``tensor`` back after its final read on the consumer ``stream`` (see the policy)."""
        try:
            entry = self._entries[name]
        except KeyError:
            raise self._unknown(name) from None
        entry.release(tensor, stream)

    # --- pure probes ----------------------------------------------------------------------------------

    def is_ring_storage(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` aliases any ring's storage (live or stale). Pure; about 0.5 us."""
        return storage_ptr(tensor) in self._rings_by_storage

    def owns(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the live acquisition of buffer ``name``. Pure."""
        entry = self._entries.get(name)
        return entry is not None and entry.owns(tensor)

    # --- introspection --------------------------------------------------------------------------------

    def get(self, name: str) -> BufferRing | AllocatingBuffer:
        """The entry behind ``name`` (a ``BufferRing`` for policy ring)."""
        try:
            return self._entries[name]
        except KeyError:
            raise self._unknown(name) from None

    def names(self) -> list[str]:
        return list(self._entries)

    def policy(self, name: str) -> Policy:
        self.get(name)
        return self._specs[name][0]

    def stats(self) -> dict[str, RingStats]:
        """Counters per buffer name."""
        return {name: entry.stats for name, entry in self._entries.items()}

    def persistent_bytes(self) -> int:
        """Bytes held by all rings' slots (what the feature adds to allocated memory)."""
        return sum(entry.persistent_bytes for entry in self._entries.values())

    def ring_bytes(self) -> dict[str, int]:
        """Persistent bytes per buffer name (``metrics.json`` key ``ring_bytes``)."""
        return {name: entry.persistent_bytes for name, entry in self._entries.items()}

    def slot_bytes(self) -> dict[str, int]:
        """Bytes per slot per buffer name (``metrics.json`` key ``ring_slot_bytes``)."""
        return {name: entry.slot_bytes for name, entry in self._entries.items()}

    @property
    def phase(self) -> Phase:
        return self._phase

    # --- CUDA graphs ----------------------------------------------------------------------------------

    def prepare_capture(self, stream: Any = None) -> None:
        """Call before ``torch.cuda.graph(...)``: no buffer may be held; ``stream`` (the capture stream)
        waits on every outstanding release event, eager events are forgotten, ring cursors go to 0."""
        if self._phase is Phase.CAPTURING:
            raise CaptureStateError("pool: prepare_capture while already capturing; call finish_capture first")
        for entry in self._entries.values():
            entry.check_idle("prepare_capture")
        for entry in self._entries.values():
            entry.prepare_capture(stream)
        if self.watchdog is not None:
            self.watchdog.pause()  # no event queries from another thread during a global-mode capture
        self._phase = Phase.CAPTURING

    def finish_capture(self) -> None:
        """Call after the capture block: no buffer may be held; capture-time events are forgotten."""
        if self._phase is not Phase.CAPTURING:
            raise CaptureStateError(f"pool: finish_capture without prepare_capture (phase {self._phase.value})")
        for entry in self._entries.values():
            entry.check_idle("finish_capture (a captured step must release every buffer it acquires)")
        for entry in self._entries.values():
            entry.finish_capture()
        if self.watchdog is not None:
            self.watchdog.resume()
        self._phase = Phase.GRAPHED

    def after_replay(self, stream: Any = None) -> None:
        """Call once after enqueuing replays, before eager use: every ring's next producers wait (once
        per slot, on the GPU) on an eager event recorded on ``stream``, the stream the graph replayed on."""
        if self._phase is not Phase.GRAPHED:
            raise CaptureStateError(f"pool: after_replay needs a finished capture (phase {self._phase.value})")
        for entry in self._entries.values():
            entry.after_replay(stream)
        self._phase = Phase.EAGER

    @contextlib.contextmanager
    def graph_capture(self, stream: Any = None) -> Iterator[None]:
        """``prepare_capture(stream)`` ... ``finish_capture()``; enter it *outside* ``torch.cuda.graph``.

        If the block raises, the capture is abandoned: held slots are dropped (nothing ran on the GPU)
        and the pool returns to eager, ordered after the pre-capture state.
        """
        self.prepare_capture(stream)
        try:
            yield
        except BaseException:
            for entry in self._entries.values():
                entry.abort_capture()
            if self.watchdog is not None:
                self.watchdog.resume()
            self._phase = Phase.EAGER
            raise
        self.finish_capture()

    # --- autograd -------------------------------------------------------------------------------------

    def autograd_guard(self) -> contextlib.AbstractContextManager[None]:
        """``saved_tensors_hooks`` that make ``release`` raise ``SavedForBackwardError`` while autograd
        still holds ring storage for backward (see ``bufreuse.pool.guard``). Wrap the forward in it."""
        return autograd_guard(self._rings_by_storage)

    def autograd_guard_if_debug(self) -> contextlib.AbstractContextManager[None]:
        """The guard in debug mode, a no-op context otherwise (what integrations wrap forwards in)."""
        return self.autograd_guard() if self.debug else contextlib.nullcontext()

    def close(self) -> None:
        """Stop the debug watchdog thread. Storage is freed when the pool is dropped (synchronise first)."""
        if self.watchdog is not None:
            self.watchdog.close()

    def _unknown(self, name: str) -> UnknownBufferError:
        known = ", ".join(sorted(self._entries)) or "none"
        return UnknownBufferError(f"buffer '{name}' is not registered with this pool (registered: {known})")
