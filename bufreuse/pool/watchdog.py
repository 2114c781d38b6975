"""Debug-mode watchdog: names the ring, slot and event a producer has waited on for too long.

A GPU-side wait never blocks the host, so a ring too shallow for the consumer's queue (or a missing
release upstream) shows up as a GPU that spins, not as a Python stack. In debug mode every wait the
ring inserts is handed to this watchdog; a daemon thread polls ``event.query()`` (no sync)
every ``poll_s`` and reports, once, each wait whose event is still incomplete after ``threshold_s``
(env ``BUFREUSE_WATCHDOG_S``, default 10 s). Reports go to the ``bufreuse.pool`` logger at WARNING
(printed to stderr when logging is not configured) and to ``Watchdog.reports``.

Polling pauses while the pool captures a CUDA graph (``pause``/``resume``): in the default global
capture mode, querying events from another thread is not allowed during a capture.

Caveat: a slot's event is reused, so if the slot is released again while an older wait is pending the
query reflects the newer record; the report may then name a later generation's consumer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from bufreuse.pool._device import env_float

__all__ = ["DEFAULT_WATCHDOG_S", "Watchdog"]

DEFAULT_WATCHDOG_S = 10.0
_log = logging.getLogger("bufreuse.pool")


class Watchdog:
    """Poll tracked waits from one daemon thread (started on the first ``track``); ``close()`` stops it."""

    def __init__(
        self,
        threshold_s: float | None = None,
        *,
        poll_s: float | None = None,
        on_report: Callable[[str], None] | None = None,
    ) -> None:
        self.threshold_s = (
            threshold_s if threshold_s is not None else env_float("BUFREUSE_WATCHDOG_S", DEFAULT_WATCHDOG_S)
        )
        self.poll_s = poll_s if poll_s is not None else min(0.5, self.threshold_s / 4)
        self.reports: list[str] = []
        self._on_report = on_report
        self._inbox: deque[tuple[float, str, int, int, Any]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()  # held by the thread while it queries events
        self._paused = False

    def track(self, ring: str, slot: int, generation: int, event: Any) -> None:
        """Watch one enqueued wait of a producer on ``event`` (anything with ``query() -> bool``)."""
        self._inbox.append((time.monotonic(), ring, slot, generation, event))
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(target=self._run, name="bufreuse-watchdog", daemon=True)
                    self._thread.start()

    def pause(self) -> None:
        """Stop querying events until ``resume`` (returns once no query is in flight)."""
        with self._poll_lock:
            self._paused = True

    def resume(self) -> None:
        """Query again; waits tracked before the pause keep their start time."""
        with self._poll_lock:
            self._paused = False

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5 * self.poll_s + 1)

    def _run(self) -> None:
        pending: list[list[Any]] = []
        while not self._stop.wait(self.poll_s):
            while self._inbox:
                pending.append([*self._inbox.popleft(), False])
            with self._poll_lock:
                if not self._paused:
                    pending = self._poll(pending)

    def _poll(self, pending: list[list[Any]]) -> list[list[Any]]:
        now = time.monotonic()
        keep: list[list[Any]] = []
        for item in pending:
            started, ring, slot, generation, event, reported = item
            try:
                done = bool(event.query())
            except Exception:  # a destroyed context at shutdown: stop watching this wait
                done = True
            if done:
                continue
            if not reported and now - started >= self.threshold_s:
                item[5] = True
                self._report(
                    f"bufreuse watchdog: a producer on ring '{ring}' has waited {now - started:.1f} s "
                    f"(threshold {self.threshold_s:g} s, BUFREUSE_WATCHDOG_S) for the release event {event!r} "
                    f"of slot {slot}, generation {generation}; that generation's final consumer has not "
                    "finished: a missing release, a consumer stuck behind this producer, or a ring too shallow "
                    "for the schedule"
                )
            keep.append(item)
        return keep

    def _report(self, message: str) -> None:
        self.reports.append(message)
        _log.warning(message)
        if self._on_report is not None:
            self._on_report(message)
