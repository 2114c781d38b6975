"""`BufferPool`: named buffer kinds shared across layers, each with a release policy.

Control and feature runs go through the same call sites: a layer calls ``pool.acquire(name, shape,
stream)`` where it used to allocate and ``pool.release(name, tensor, stream)`` where the final reader
is done — or ``pool.release_when_unsaved(...)`` where autograd (inside ``pool.track_saved()``) or a
``pool.hold(...)`` may read it later; the policy decides what happens (ring slot, ``record_stream``,
or a stream-ordered free).

CUDA graphs (eager warm-up -> full-iteration capture -> replays -> eager)::

    pool.register(...)                       # all storage allocated here, never during capture
    for _ in range(warmup): step()           # eager
    with pool.graph_capture(s), torch.cuda.graph(g, stream=s):
        step()                               # captured; cursor starts at slot 0, events are capture-only
    for _ in range(n): g.replay()
    pool.after_replay(torch.cuda.current_stream())   # eager producers ordered after the replays
    step()                                   # eager again
    pool.before_replay(torch.cuda.current_stream())  # replays ordered after the eager releases
    g.replay()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from bufreuse.pool._config import resolve_device, storage_ptr
from bufreuse.pool._device import env_debug, is_capturing
from bufreuse.pool._state import StorageIndex
from bufreuse.pool.allocating import AllocatingBuffer
from bufreuse.pool.errors import CaptureStateError, RingConfigError, UnknownBufferError
from bufreuse.pool.policy import Policy
from bufreuse.pool.ring import ON_EXHAUSTED, BufferRing, Phase, RingStats
from bufreuse.pool.tracking import Hold, SavedTracker
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
        self._rings_by_storage = StorageIndex()
        self._trackers = (
            SavedTracker(self._rings_by_storage, strict=False),
            SavedTracker(self._rings_by_storage, strict=True),
        )
        self._phase = Phase.EAGER

    def __repr__(self) -> str:
        names = ", ".join(f"{n}:{s[0].value}/{s[1]}" for n, s in self._specs.items())
        return f"BufferPool(device='{self.device}', phase={self._phase.value}, buffers=[{names}])"

    def register(
        self,
        name: str,
        *,
        policy: Policy | str,
        num_slots: int | str = 0,
        max_shape: Sequence[int],
        dtype: torch.dtype,
        on_exhausted: str = "raise",
        initial_slots: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """Declare a buffer kind. Idempotent for identical arguments (every layer may call it).

        Args:
            name: the buffer kind (``"dispatch_output"``, ``"expert_fc2_output"``).
            policy: ``ring``, ``record-stream`` or ``stream-ordered`` (:class:`Policy`).
            num_slots: ring slots, allocated now; ``"auto"``: start at ``initial_slots`` and grow by one
                slot during eager warm-up whenever every slot is held, up to ``max_bytes``; frozen at
                ``prepare_capture``. The allocator policies take 0.
            max_shape: static bound of one acquisition.
            dtype: element type.
            on_exhausted: ``"raise"`` (``EarlyReuseError``) or ``"allocate"``: serve the acquisition from
                the caching allocator (``torch.empty``, released with ``record_stream``), warn once,
                count ``fallback_allocations``. Ignored by the allocator policies.
            initial_slots: ``"auto"`` only: the starting depth (a plan figure), default 2.
            max_bytes: ``"auto"`` only, required: the cap on the ring's persistent bytes.

        Raises:
            RingConfigError: bad or conflicting arguments. CaptureStateError: during capture.
        """
        try:
            pol = Policy(policy)
        except ValueError:
            raise RingConfigError(
                f"buffer '{name}': unknown policy {policy!r}; choose one of {', '.join(p.value for p in Policy)}"
            ) from None
        slots = self._check_slots(name, pol, num_slots, on_exhausted, initial_slots, max_bytes)
        spec = (pol, num_slots, tuple(int(d) for d in max_shape), dtype, on_exhausted, initial_slots, max_bytes)
        old = self._specs.get(name)
        if old is not None:
            if old == spec:
                return
            raise RingConfigError(
                f"buffer '{name}' is already registered as policy={old[0].value} num_slots={old[1]} "
                f"max_shape={old[2]} dtype={old[3]} on_exhausted={old[4]} initial_slots={old[5]} "
                f"max_bytes={old[6]}; cannot re-register as policy={pol.value} num_slots={num_slots} "
                f"max_shape={spec[2]} dtype={dtype} on_exhausted={on_exhausted} initial_slots={initial_slots} "
                f"max_bytes={max_bytes}"
            )
        if self._phase is Phase.CAPTURING:
            raise CaptureStateError(f"buffer '{name}': register during CUDA-graph capture; register before warm-up")
        if pol is Policy.RING:
            entry: BufferRing | AllocatingBuffer = BufferRing(
                name,
                slots,
                spec[2],
                dtype,
                self.device,
                debug=self.debug,
                watchdog=self.watchdog,
                on_exhausted=on_exhausted,
                max_bytes=max_bytes if num_slots == "auto" else None,
                registry=self._rings_by_storage,
            )
        else:
            entry = AllocatingBuffer(name, pol.value, spec[2], dtype, self.device, debug=self.debug)
        entry._phase = self._phase  # registered between capture and after_replay: joins the pool's phase
        self._entries[name] = entry
        self._specs[name] = spec

    @staticmethod
    def _check_slots(
        name: str, pol: Policy, num_slots: Any, on_exhausted: Any, initial_slots: Any, max_bytes: Any
    ) -> int:
        if on_exhausted not in ON_EXHAUSTED:
            raise RingConfigError(f"buffer '{name}': on_exhausted must be 'raise' or 'allocate', got {on_exhausted!r}")
        auto = num_slots == "auto"
        if not auto and (initial_slots is not None or max_bytes is not None):
            raise RingConfigError(f"buffer '{name}': initial_slots and max_bytes go with num_slots='auto' only")
        if pol is not Policy.RING:
            if num_slots != 0:
                raise RingConfigError(
                    f"buffer '{name}': policy '{pol.value}' takes no slots (num_slots=0), got {num_slots!r}"
                )
            return 0
        if auto:
            if initial_slots is None:
                initial_slots = 2
            if not _positive_int(initial_slots):
                raise RingConfigError(f"buffer '{name}': initial_slots must be an integer >= 1, got {initial_slots!r}")
            if max_bytes is None:
                raise RingConfigError(
                    f"buffer '{name}': num_slots='auto' needs max_bytes, the cap on the ring's persistent bytes"
                )
            return initial_slots
        if not _positive_int(num_slots):
            raise RingConfigError(f"buffer '{name}': policy 'ring' needs num_slots >= 1 or 'auto', got {num_slots!r}")
        return num_slots

    # --- hot path -------------------------------------------------------------------------------------

    def acquire(self, name: str, shape: Sequence[int] | None = None, stream: Any = None) -> torch.Tensor:
        """A buffer of ``shape`` for the producer on ``stream`` (see the policy); one dict lookup over the entry."""
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

    def release_when_unsaved(self, name: str, tensor: torch.Tensor, stream: Any = None) -> bool:
        """The forward's final reader of ``tensor`` on ``stream`` is done: release now, or as soon as
        autograd frees its last tracked saved reference and every :class:`Hold` is done.

        Returns True if released now. See :meth:`BufferRing.release_when_unsaved` (stream semantics).
        Allocator policies release now.

        Raises:
            UnknownBufferError, DoubleReleaseError, ForeignTensorError, StaleAliasError.
        """
        try:
            entry = self._entries[name]
        except KeyError:
            raise self._unknown(name) from None
        return entry.release_when_unsaved(tensor, stream)

    def hold(self, name: str, tensor: torch.Tensor) -> Hold:
        """Keep the slot ``tensor`` aliases from being released until ``hold.done(stream)``.

        For readers outside autograd's saved tensors, e.g. a weight-gradient store read in
        ``backward_dw()``: take the hold before the forward releases, call ``done`` after that read.

        Raises:
            UnknownBufferError; StaleAliasError: the slot is not held.
        """
        try:
            entry = self._entries[name]
        except KeyError:
            raise self._unknown(name) from None
        return entry.hold(tensor)

    def track_saved(self, *, strict: bool | None = None) -> SavedTracker:
        """Count autograd-saved references to ring storage made inside the block (``saved_tensors_hooks``).

        What ``release_when_unsaved`` relies on; scope it to the code whose saved tensors may alias
        ring storage (the stages that read a slot). Saved-tensor hooks do not nest: an outer pair
        (activation offload) is inactive inside. The returned tracker is the pool's own, built once:
        entering it costs one hook push (a nested entry pushes again, cheaply).

        Args:
            strict: also raise when an alias of a released slot is saved (default: debug mode).
        """
        return self._trackers[self.debug if strict is None else bool(strict)]

    # --- pure probes ----------------------------------------------------------------------------------

    def is_ring_storage(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` aliases any ring's storage (live or stale). Pure; one storage-pointer lookup."""
        return storage_ptr(tensor) in self._rings_by_storage

    def views_ring_storage(self, tensor: Any) -> bool:
        """Whether ``tensor``'s first byte lies in any ring's storage (live or stale slot). Pure.

        One pointer test per ring storage: cheap enough for a per-call "does this stage receive a
        slot?" (a zero-size view has no first byte and answers False).
        """
        try:
            ptr = tensor.data_ptr()
        except (AttributeError, RuntimeError, TypeError):
            return False
        for first, end, _ring, _storage in self._rings_by_storage.spans:  # noqa: SIM110 (no generator per call)
            if first <= ptr < end:
                return True
        return False

    def saved_references(self, name: str, tensor: torch.Tensor) -> int:
        """Autograd-saved references counted on the live slot of ``name`` that ``tensor`` views. Pure.

        Raises:
            UnknownBufferError.
        """
        return self.get(name).saved_references(tensor)

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

    def settle(self) -> None:
        """Stop every ``num_slots='auto'`` ring growing and log the depth it settled on (one line each).

        ``prepare_capture`` does this; a run without CUDA graphs calls it after warm-up (or at the end),
        so the settled depth is still reported once. Idempotent; fixed-depth rings ignore it.
        """
        for entry in self._entries.values():
            if isinstance(entry, BufferRing):
                entry.settle()

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

    def before_replay(self, stream: Any = None) -> None:
        """Call before replaying graphs on ``stream`` after eager use (``after_replay`` ... eager steps).

        ``stream`` waits (GPU side) on every outstanding eager release event of every ring, events are
        forgotten and cursors go to 0, so the replay cannot overwrite a slot an eager consumer on another
        stream still reads. A no-op right after a capture or another ``before_replay``.

        Raises:
            CaptureStateError: capturing, or a buffer still held.
        """
        if self._phase is Phase.CAPTURING:
            raise CaptureStateError("pool: before_replay during a capture; call finish_capture first")
        if self._phase is Phase.GRAPHED:
            return
        for entry in self._entries.values():
            entry.check_idle("before_replay")
        for entry in self._entries.values():
            entry.before_replay(stream)
        self._phase = Phase.GRAPHED

    def reset(self) -> None:
        """Recover after an error mid-step: synchronise the device, then every buffer forgets its holders,
        deferred releases, saved references, holds and events; storage is kept, phase back to eager.

        Raises:
            CaptureStateError: called during CUDA-graph capture.
        """
        if is_capturing(self.device):
            raise CaptureStateError("pool: reset during CUDA-graph capture; end the capture first")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for entry in self._entries.values():
            entry.reset(synchronize=False)
        if self.watchdog is not None:
            self.watchdog.resume()
        self._phase = Phase.EAGER

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

    def autograd_guard(self) -> SavedTracker:
        """The debug aid: ``track_saved(strict=True)``. ``release`` already raises while a tracked saved
        reference is alive; strict also raises when an alias of a released slot is saved."""
        return self._trackers[True]

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


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
