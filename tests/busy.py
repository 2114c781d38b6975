"""A host busy-wait of known length: what the timing tests inject into hook code and megatron code alike."""

from __future__ import annotations

import time


def spin(us: float) -> None:
    """Burn ``us`` microseconds of host time on this thread (no sleep: the wait is CPU time, as hook code is)."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass
