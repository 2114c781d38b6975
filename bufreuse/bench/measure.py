"""Timing, memory and snapshot measurements shared by the proxy workload and the benchmark.

Timing and snapshot recording are separate passes: recording Python stacks adds a cost to every
allocation, which slows the control (one allocation per buffer per microbatch) more than a ring
(none), so step times come only from unrecorded steps.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import pickle
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bufreuse.fsutil import atomic_write_bytes

__all__ = ["memory_figures", "record_snapshot", "snapshot_figures", "step_stats", "time_steps"]

log = logging.getLogger(__name__)


def step_stats(values: list[float]) -> dict[str, Any]:
    """Median, mean, p10, p90, min, max of per-step milliseconds, plus the values themselves."""
    if not values:
        raise ValueError("no timed steps")
    ordered = sorted(values)

    def pct(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {
        "median": statistics.median(ordered),
        "mean": statistics.fmean(ordered),
        "p10": pct(0.10),
        "p90": pct(0.90),
        "min": ordered[0],
        "max": ordered[-1],
        "values": [round(v, 4) for v in values],
    }


def time_steps(
    run: Callable[[], None],
    steps: int,
    *,
    stream: torch.cuda.Stream | None,
    label: str = "step",
    min_total_ms: float = 0.0,
    max_steps: int = 1000,
) -> list[float]:
    """Run ``run`` ``steps`` times; milliseconds each from CUDA events on ``stream`` (wall clock on CPU).

    Synchronises after each step, so steps do not overlap and the CPU cannot run a step ahead.
    ``min_total_ms`` keeps running steps (up to ``max_steps``) until the steps add up to that much
    time: a warm-up measured in time rather than steps, so the GPU's clocks have settled under
    sustained load before the timed steps start.
    """
    values: list[float] = []
    k = 0
    while k < steps or (sum(values) < min_total_ms and k < max(steps, max_steps)):
        k += 1
        if stream is None:
            t0 = time.perf_counter()
            run()
            values.append((time.perf_counter() - t0) * 1e3)
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            with torch.cuda.stream(stream):
                run()
            end.record(stream)
            end.synchronize()
            values.append(start.elapsed_time(end))
        log.info("%s %d/%d: %.3f ms", label, k, steps, values[-1])
    return values


def memory_figures(device: torch.device) -> dict[str, int | None]:
    """Peak reserved / allocated since the last reset and the device memory in use now (all processes)."""
    if device.type != "cuda":
        return {"max_reserved_bytes": None, "max_allocated_bytes": None, "device_used_bytes": None}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "device_used_bytes": int(total - free),
    }


def record_snapshot(
    run: Callable[[], None],
    steps: int,
    path: str | os.PathLike[str],
    *,
    device: torch.device,
    stream: torch.cuda.Stream | None = None,
    max_entries: int = 200_000,
) -> Path:
    """Record allocator history with Python stacks over ``steps`` untimed steps; write a gzipped pickle.

    Empties the allocator cache first so the recorded steps allocate their segments inside the trace
    (persistent tensors and ring storage stay; they appear in the snapshot's segments).
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)
    try:
        for k in range(steps):
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                run()
            torch.cuda.synchronize(device)
            log.info("recorded step %d/%d", k + 1, steps)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    data = gzip.compress(pickle.dumps(snap, protocol=4), compresslevel=6)
    return atomic_write_bytes(path, data)


def snapshot_figures(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Pending-free at max-active (total and by category) from the snapshot analysis (``analysis``)."""
    from bufreuse.analysis.snapshot.batch import report_file

    report = report_file(str(path))
    return {
        "pending_free_at_max_active_bytes": report.get("pending_free_at_max_active_bytes"),
        "pending_free_by_category_at_max_active": report.get("pending_free_by_category_at_max_active"),
        "snapshot_max_reserved_bytes": report.get("max_reserved_bytes"),
        "snapshot_max_active_bytes": report.get("max_active_bytes"),
        "snapshot_warnings": report.get("warnings", []),
    }
