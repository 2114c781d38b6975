"""Turn a finished Megatron-LM job's folder into the sweep's ``metrics.json``.

A Megatron configuration runs ``bufreuse.integrations.entry`` (not the one-configuration runner),
so nothing inside the job writes ``metrics.json``. When the SLURM launcher sees such a job end, it
calls :func:`megatron_metrics`: the training log (``log.txt``, written by the template through
``tee``) gives step times, throughput and the memory reports (``bufreuse.analysis.runs.megatron_log``),
and the rank-0 allocator snapshot that ``--memory-snapshot-path`` dumped is gzipped to
``snapshot.pickle.gz`` (the file name every other workload uses).
"""

from __future__ import annotations

import gzip
import shutil
import statistics
from typing import Any

from bufreuse.errors import LogFormatError
from bufreuse.fsutil import atomic_writer
from bufreuse.sweepdir import ConfigPaths

__all__ = ["compress_rank0_snapshot", "megatron_metrics"]

_MIB = 1 << 20


def compress_rank0_snapshot(paths: ConfigPaths) -> str | None:
    """Gzip the rank-0 snapshot Megatron dumped (``snapshot.pickle`` or ``snapshot*_0.pickle``)."""
    if paths.snapshot.exists():
        return str(paths.snapshot)
    candidates = sorted(
        (p for p in paths.folder.glob("snapshot*.pickle") if p.is_file()),
        key=lambda p: (not p.stem.endswith(("_0", "base_0")), p.name),
    )
    if not candidates:
        return None
    # atomically: a half-written file would be taken as done by the ``exists()`` check above
    with (
        open(candidates[0], "rb") as src,
        atomic_writer(paths.snapshot) as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1) as dst,
    ):
        shutil.copyfileobj(src, dst, length=1 << 22)
    return str(paths.snapshot)


def _stats(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"median": statistics.median(ordered), "mean": statistics.fmean(ordered), "p10": pct(0.1),
            "p90": pct(0.9), "min": ordered[0], "max": ordered[-1], "values": values}  # fmt: skip


def megatron_metrics(paths: ConfigPaths, *, job_ok: bool, warmup: int = 3) -> tuple[str, str | None, dict[str, Any]]:
    """``(status, error, figures)`` for a Megatron job that ended; ``job_ok``: SLURM said COMPLETED."""
    from bufreuse.analysis.runs.megatron_log import parse_log, steady_iterations

    try:
        log = parse_log(paths.log)
    except LogFormatError as e:
        return "failed", f"no usable Megatron log: {e}", {}
    kept, _ = steady_iterations(log, warmup=warmup) if len(log.iterations) > warmup else (log.iterations, {})
    times = [r.elapsed_ms for r in kept if r.elapsed_ms is not None]
    tflops = [r.tflops for r in kept if r.tflops is not None]

    def peak(attr: str) -> int | None:
        value = log.peak(attr)
        return None if value is None else int(value * _MIB)

    figures: dict[str, Any] = {
        "step_ms": _stats(times),
        "tflops": statistics.median(tflops) if tflops else None,
        "max_reserved_bytes": peak("max_reserved_mib"),
        "max_allocated_bytes": peak("max_allocated_mib"),
        "device_used_bytes": peak("device_used_mib"),
        "megatron_iterations": len(log.iterations),
        "snapshot": compress_rank0_snapshot(paths),
    }
    if not job_ok:
        return "failed", None, figures
    if not times:
        return "failed", f"{paths.log}: Megatron logged no iteration times", figures
    return "ok", None, figures
