"""Run one configuration in this (fresh) process: ``python -m bufreuse.bench.runner CONFIG_DIR``.

Reads ``CONFIG_DIR/config.json``, resolves ``config["workload"]`` (``bufreuse.bench.workloads``;
extra workloads can be named in ``$BUFREUSE_WORKLOADS`` as ``name=module:function,...``), logs to
``log.txt`` and writes ``metrics.json`` LAST and atomically, so a folder with a ``metrics.json`` is a
finished configuration and anything else is not.

A watchdog thread watches the log: when no line is logged for ``config["stall_s"]`` seconds
(default: half of ``timeout_s``, at most 300), it writes every thread's stack to ``log.txt`` (the
last words), writes ``metrics.json`` with status ``hung`` and exits with code 3. The launcher's
timeout stays the backstop for a process that cannot even run the watchdog.

Exit codes: 0 ok, 1 failed, 2 bad configuration, 3 hung. Under torchrun (``WORLD_SIZE`` > 1) rank
R writes ``metrics.rank<R>.json`` and ``log.rank<R>.txt``; rank 0 also writes ``metrics.json`` with
the per-rank maxima of the memory figures.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from bufreuse.bench.workloads import EXTRA_WORKLOADS_ENV, extra_workloads, resolve_workload
from bufreuse.errors import BufreuseError, exit_code_for
from bufreuse.fsutil import atomic_write_json, read_json
from bufreuse.sweepdir import ConfigPaths, blank_metrics, utc_now

__all__ = ["EXTRA_WORKLOADS_ENV", "collect_env", "main", "run_config_dir"]

_MAX_KEYS = ("max_reserved_bytes", "max_allocated_bytes", "device_used_bytes")
log = logging.getLogger("bufreuse.bench.runner")


class _Heartbeat(logging.Handler):
    """Remembers when the last log record was emitted; the watchdog reads it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        self.last = time.monotonic()


def collect_env(rank: int, world_size: int) -> dict[str, Any]:
    """Versions and placement of this run; torch figures only if the workload imported torch."""
    env: dict[str, Any] = {
        "torch": None,
        "cuda": None,
        "gpu": None,
        "driver": None,
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_nodelist": os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST"),
        "rank": rank,
        "world_size": world_size,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=20, check=True,
                )  # fmt: skip
                env["driver"] = out.stdout.strip().splitlines()[0]
            except (OSError, subprocess.SubprocessError, IndexError):
                env["driver"] = None
    return env


def _metrics_path(paths: ConfigPaths, rank: int, world_size: int) -> Path:
    return paths.metrics if world_size == 1 else paths.folder / f"metrics.rank{rank}.json"


def _watchdog(beat: _Heartbeat, stall_s: float, stop: threading.Event, write_hung: Any, log_file: Any) -> None:
    while not stop.wait(min(1.0, stall_s / 4)):
        idle = time.monotonic() - beat.last
        if idle >= stall_s and not stop.is_set():
            log.error("watchdog: no progress for %.0f s; last words (all thread stacks) follow", idle)
            log_file.flush()
            faulthandler.dump_traceback(file=log_file, all_threads=True)
            log_file.flush()
            write_hung(f"no progress for {idle:.0f} s (stall_s); thread stacks in log.txt")
            os._exit(3)


def run_config_dir(folder: str | os.PathLike[str]) -> int:
    """Run the configuration in ``folder``; return the process exit code."""
    paths = ConfigPaths(Path(folder))
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    log_path = paths.log if rank == 0 else paths.folder / f"log.rank{rank}.txt"
    paths.folder.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    handler = logging.StreamHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    beat = _Heartbeat()
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    root.addHandler(beat)
    started = utc_now()
    config: dict[str, Any] = {}
    stop = threading.Event()

    def finish(status: str, error: str | None, workload_metrics: dict[str, Any] | None = None) -> None:
        if status != "hung":
            stop.set()
        env = collect_env(rank, world_size)
        metrics = blank_metrics(status=status, error=error, config=config, env=env, started_at=started)
        fixed = {k: metrics[k] for k in ("status", "error", "config", "env", "started_at", "finished_at")}
        metrics.update(workload_metrics or {})
        metrics.update(fixed)  # the workload's figures never override the run's own record
        atomic_write_json(_metrics_path(paths, rank, world_size), metrics)
        if world_size > 1:
            _merge_ranks(paths, rank, world_size, metrics)

    try:
        config = read_json(paths.config)
        if not isinstance(config, dict):
            raise BufreuseError(f"{paths.config}: not a JSON object")
        timeout_s = float(config.get("timeout_s") or 600)
        stall_s = float(config.get("stall_s") or min(300.0, max(timeout_s / 2, 1.0)))
        threading.Thread(
            target=_watchdog, args=(beat, stall_s, stop, lambda e: finish("hung", e), log_file), daemon=True
        ).start()
        log.info("config %s: workload %s (rank %d/%d)", paths.config_id, config.get("workload"), rank, world_size)
        fn = resolve_workload(str(config.get("workload", "")), extra_workloads())
        result = fn(config, paths)
    except BufreuseError as e:
        log.error("%s", e)
        finish("failed", str(e))
        return exit_code_for(e)
    except BaseException as e:  # a hung or crashed workload must still leave a metrics.json
        log.error("failed:\n%s", traceback.format_exc())
        finish("failed", f"{type(e).__name__}: {e}")
        return 1
    log.info("done")
    finish("ok", None, result)
    return 0


def _merge_ranks(paths: ConfigPaths, rank: int, world_size: int, mine: dict[str, Any]) -> None:
    """Rank 0 waits (up to 60 s) for every rank's file and writes metrics.json with per-rank maxima."""
    if rank != 0:
        return
    files = [paths.folder / f"metrics.rank{r}.json" for r in range(world_size)]
    deadline = time.monotonic() + 60
    while not all(f.is_file() for f in files) and time.monotonic() < deadline:
        time.sleep(0.5)
    ranks = [read_json(f) for f in files if f.is_file()]
    merged = dict(mine)
    for key in _MAX_KEYS:
        vals = [m.get(key) for m in ranks if m.get(key) is not None]
        merged[key] = max(vals) if vals else None
    bad = [m for m in ranks if m.get("status") != "ok"]
    if len(ranks) < world_size:
        merged.update(status="failed", error=f"only {len(ranks)} of {world_size} ranks wrote metrics")
    elif bad:
        merged.update(status=bad[0]["status"], error=f"rank {bad[0]['env']['rank']}: {bad[0]['error']}")
    merged["ranks"] = len(ranks)
    atomic_write_json(paths.metrics, merged)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bufreuse.bench.runner CONFIG_DIR", file=sys.stderr)
        return 2
    return run_config_dir(args[0])


if __name__ == "__main__":
    sys.exit(main())
