"""The local launcher: each configuration in a fresh process on this machine, one after another.

A fresh process per configuration gives each one a clean caching allocator (max reserved is
per process). ``world_size`` > 1 runs the configuration under ``torchrun --standalone`` with one
process per GPU. Each run gets ``timeout_s`` (from its ``config.json``) plus a grace period; past
that its process group is killed and ``metrics.json`` says ``timeout`` (the runner's own watchdog
writes ``hung`` earlier when it sees no progress). A run that dies without writing ``metrics.json``
is recorded as ``failed`` with the tail of its ``stderr.txt``.

``job.json`` in the configuration folder holds the process id while it runs, so ``status`` and
``cancel`` work from another shell on the same host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bufreuse.errors import InputError
from bufreuse.fsutil import atomic_write_json, read_json
from bufreuse.launch.base import (
    ProgressEvent,
    ProgressFn,
    finished_states,
    runner_argv,
    utc_now,
    write_failure_metrics,
)
from bufreuse.sweepdir import ConfigPaths, SweepDir

__all__ = ["LocalLauncher", "visible_gpus"]

_GRACE_S = 30.0
_NO_CUDA = (
    "no CUDA GPU is visible here, and the proxy needs one: run the sweep on a GPU node with "
    "`bufreuse sweep --launcher slurm ...`, or look at recorded results with `bufreuse demo`"
)


def visible_gpus() -> int:
    """CUDA devices this process can see (imports torch: about a second)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class LocalLauncher:
    """Runs configurations sequentially as subprocesses of this one."""

    name = "local"

    def __init__(self, *, python: str | None = None, grace_s: float = _GRACE_S, env: dict[str, str] | None = None):
        self.python = python or sys.executable
        """Interpreter that runs ``bufreuse.bench.runner`` (this one by default)."""
        self.grace_s = grace_s
        """Seconds past a configuration's ``timeout_s`` before its process group is killed."""
        self.env = dict(env or {})
        """Extra environment for the runs (e.g. ``BUFREUSE_DEBUG=1``)."""
        self._gpus: int | None = None

    def default_world_size(self) -> int:
        """Every visible GPU (at least 1): one process per GPU under torchrun."""
        return max(1, self._visible())

    def _visible(self) -> int:
        if self._gpus is None:
            self._gpus = visible_gpus()
        return self._gpus

    def prepare(self, sweep: SweepDir, config_ids: Sequence[str]) -> None:
        from bufreuse.bench.workloads import WORKLOADS, extra_workloads

        known = {**WORKLOADS, **extra_workloads({**os.environ, **self.env})}
        for cid in config_ids:
            config = sweep.read_config(cid)
            workload = str(config.get("workload", ""))
            if workload not in known:
                raise InputError(
                    f"configuration {cid}: workload {workload!r} does not run locally; choose from "
                    f"{', '.join(sorted(known))} (megatron runs with --launcher slurm)"
                )
            if config.get("device", "cuda") != "cuda":
                continue
            gpus = self._visible()
            if gpus == 0:
                raise InputError(_NO_CUDA)
            world = int(config.get("world_size") or 1)
            if world > gpus and config.get("dist_backend") != "gloo":  # gloo: processes may share a GPU
                raise InputError(
                    f"configuration {cid}: world_size {world} but only {gpus} GPU(s) are visible here "
                    "(--dist-backend gloo runs several processes on one GPU)"
                )

    def launch(self, sweep: SweepDir, config_ids: Sequence[str], *, progress: ProgressFn | None = None) -> None:
        total = len(config_ids)
        for done, cid in enumerate(config_ids):
            paths = sweep.paths(cid)
            if progress:
                progress(ProgressEvent(config_id=cid, state="running", done=done, total=total))
            status, message = self._run_one(paths)
            if progress:
                progress(ProgressEvent(config_id=cid, state=status, done=done + 1, total=total, message=message))

    def _argv(self, paths: ConfigPaths, config: dict[str, Any]) -> list[str]:
        world = int(config.get("world_size") or 1)
        if world == 1:
            return runner_argv(paths.folder, python=self.python)
        return [
            self.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "bufreuse.bench.runner", str(paths.folder),
        ]  # fmt: skip

    def _run_one(self, paths: ConfigPaths) -> tuple[str, str]:
        config = read_json(paths.config)
        timeout = float(config.get("timeout_s") or 600) + self.grace_s
        started = utc_now()
        stderr_path = paths.folder / "stderr.txt"
        env = {**os.environ, **self.env}
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                self._argv(paths, config), stdout=err, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            job = {"launcher": "local", "pid": proc.pid, "host": socket.gethostname(), "started_at": started}
            atomic_write_json(paths.job, {**job, "pid_start": _pid_start(proc.pid)})

            def settle(status: str, error: str) -> None:
                """Write the failure record unless the runner wrote its own metrics.json."""
                if not paths.is_finished():
                    write_failure_metrics(paths, status=status, config=config, started_at=started, error=error)

            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                settle(
                    "timeout",
                    f"killed after {timeout:.0f} s (timeout_s + {self.grace_s:.0f} s grace); "
                    f"log tail: {_tail(paths.log)}",
                )
            except BaseException:
                _kill_group(proc)
                settle("cancelled", "interrupted")
                raise
            else:
                settle("failed", f"runner exited with code {rc} without writing metrics.json: {_tail(stderr_path)}")
        metrics = paths.read_metrics() or {}
        return str(metrics.get("status", "failed")), str(metrics.get("error") or "")

    def status(self, sweep: SweepDir) -> dict[str, str]:
        states = finished_states(sweep)
        for cid, state in states.items():
            if state == "pending" and _live_pid(sweep.paths(cid)) is not None:
                states[cid] = "running"
        return states

    def cancel(self, sweep: SweepDir) -> list[str]:
        cancelled = []
        for cid, state in finished_states(sweep).items():
            if state != "pending":
                continue
            paths = sweep.paths(cid)
            pid = _live_pid(paths)
            if pid is None:
                continue
            # Written before the kill, so the launching process finds it and does not record "failed".
            write_failure_metrics(paths, status="cancelled", error="cancelled by `bufreuse sweep --cancel`")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
            cancelled.append(cid)
        return cancelled


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop the run's process group (the runner and any torchrun workers): TERM, then KILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _live_pid(paths: ConfigPaths) -> int | None:
    """The pid in ``job.json`` if it was started on this host by the local launcher and still runs."""
    try:
        job = read_json(paths.job)
    except (OSError, ValueError):
        return None
    if not isinstance(job, dict) or job.get("launcher") != "local" or job.get("host") != socket.gethostname():
        return None
    pid = job.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return None
    # A pid from an old job.json may belong to another process by now: never signal that one.
    if job.get("pid_start") is not None and _pid_start(pid) != job["pid_start"]:
        return None
    return pid


def _pid_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (Linux ``/proc``; None elsewhere or if gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: count fields after the last ')'
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _tail(path: Path, n: int = 400) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    return " ".join(text[-n:].split()) or "(no output)"
