"""``cpu-smoke``: a tiny CPU-only workload that proves a launcher really ran a configuration.

It exists for the SLURM tests and for trying a launcher on a machine without a GPU: it does a
little real work (``iterations`` rounds of SHA-256 chained over a seed-derived buffer), records
where it ran (host, SLURM job id and node list from the environment) and
returns metrics in the sweep contract's shape with the GPU figures set to None. Like the proxy's, its
checksum depends on the seed and the work, not on the slot count, so every configuration of a sweep
agrees. ``fail: true`` in the configuration makes it raise :class:`CpuSmokeFailure` after the work,
so a launcher's failure path can be tested with a real failing process. Imports only the standard
library (no torch).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from typing import Any

from bufreuse.errors import InputError, JobFailedError
from bufreuse.sweepdir import ConfigPaths

__all__ = ["DEFAULT_ITERATIONS", "CpuSmokeFailure", "run_configuration", "slurm_environment"]

DEFAULT_ITERATIONS = 20_000
"""SHA-256 rounds per step when the configuration does not say (~20 ms on one core)."""


class CpuSmokeFailure(JobFailedError):
    """Raised on purpose when the configuration has ``fail: true`` (a failed run: exit code 1)."""


def slurm_environment() -> dict[str, Any]:
    """Where this process runs: host name plus the SLURM job's id, node list and rank (None outside SLURM)."""
    env = os.environ
    return {
        "hostname": socket.gethostname(),
        "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_nodelist": env.get("SLURM_JOB_NODELIST"),
        "slurm_cluster": env.get("SLURM_CLUSTER_NAME"),
        "rank": int(env.get("RANK", env.get("SLURM_PROCID", "0"))),
        "world_size": int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))),
    }


def _int_field(config: dict[str, Any], name: str, default: int, minimum: int) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"cpu-smoke: config.{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _step(seed: int, iterations: int) -> tuple[float, str]:
    digest = f"cpu-smoke:{seed}".encode()
    t0 = time.perf_counter()
    for _ in range(iterations):
        digest = hashlib.sha256(digest).digest()
    return (time.perf_counter() - t0) * 1e3, digest.hex()


def run_configuration(config: dict[str, Any], paths: ConfigPaths) -> dict[str, Any]:
    """Run ``steps`` timed steps of chained hashing and return contract-shaped metrics.

    Reads ``seed``, ``slots``, ``steps`` (default 3), ``warmup_steps`` (default 0), ``iterations``
    (rounds per step, default :data:`DEFAULT_ITERATIONS`) and ``fail``. Appends one line per step to
    ``paths.log`` so a launcher has a real log to collect.
    """
    steps = _int_field(config, "steps", 3, 1)
    warmup = _int_field(config, "warmup_steps", 0, 0)
    iterations = _int_field(config, "iterations", DEFAULT_ITERATIONS, 1)
    seed = _int_field(config, "seed", 0, 0)
    slots = _int_field(config, "slots", 0, 0)
    where = slurm_environment()
    values: list[float] = []
    checksum = ""
    paths.folder.mkdir(parents=True, exist_ok=True)
    with open(paths.log, "a", encoding="utf-8") as log:
        log.write(f"cpu-smoke on {where['hostname']} job={where['slurm_job_id']} slots={slots}\n")
        for i in range(warmup + steps):
            ms, checksum = _step(seed + i, iterations)
            if i >= warmup:
                values.append(ms)
            log.write(f"step {i} {'warmup ' if i < warmup else ''}{ms:.3f} ms\n")
        if config.get("fail", False):
            log.write("failing on purpose (config.fail = true)\n")
            log.flush()
            raise CpuSmokeFailure(
                f"cpu-smoke failed on purpose (config.fail = true) on {where['hostname']}, job {where['slurm_job_id']}"
            )
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {
        "max_reserved_bytes": None,
        "max_allocated_bytes": None,
        "device_used_bytes": None,
        "step_ms": {
            "median": pct(0.5),
            "mean": sum(values) / len(values),
            "p10": pct(0.1),
            "p90": pct(0.9),
            "min": ordered[0],
            "max": ordered[-1],
            "values": values,
        },
        "tflops": None,
        "pending_free_at_max_active_bytes": None,
        "pending_free_by_category_at_max_active": None,
        "ring_bytes": {},
        "ring_slot_bytes": {},
        "checksum": checksum,
        "env": where,
        "host": where["hostname"],
        "slurm_job_id": where["slurm_job_id"],
        "iterations": iterations,
    }
