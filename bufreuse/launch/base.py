"""The launcher seam: how a sweep's configurations get run (a local GPU, SLURM, ...).

A launcher takes a prepared sweep folder (``bufreuse.sweepdir``: manifest + one ``config.json`` per
configuration) and makes every named configuration end with a ``metrics.json`` in its folder. It
never decides *what* to run (``bufreuse.launch.sweep`` builds the list) and never reads results
beyond the status (``bufreuse.analysis.runs.sweep_rows`` does). Each configuration runs as
``python -m bufreuse.bench.runner CONFIG_DIR`` (:func:`runner_argv`) in a fresh process.

Launchers register by name in :data:`LAUNCHERS` as ``"module:Class"`` strings, so naming one
imports nothing heavy; :func:`get_launcher` builds one from its keyword options.

Configuration states (:data:`STATES`) are the finished statuses of ``sweepdir.STATUSES`` plus the
in-flight ones ``pending`` (nothing started), ``queued`` (submitted, not running) and ``running``.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from bufreuse.errors import InputError
from bufreuse.fsutil import atomic_write_json, read_json
from bufreuse.sweepdir import STATUSES, ConfigPaths, SweepDir, blank_metrics, utc_now

__all__ = [
    "IN_FLIGHT_STATES",
    "LAUNCHERS",
    "STATES",
    "Launcher",
    "ProgressEvent",
    "ProgressFn",
    "clear_results",
    "finished_states",
    "get_launcher",
    "runner_argv",
    "utc_now",
    "write_failure_metrics",
]

IN_FLIGHT_STATES = ("pending", "queued", "running")
STATES = IN_FLIGHT_STATES + STATUSES

LAUNCHERS: dict[str, str] = {
    "local": "bufreuse.launch.local:LocalLauncher",
    "slurm": "bufreuse.launch.slurm:SlurmLauncher",
}


@dataclass(kw_only=True, slots=True)
class ProgressEvent:
    """One step of a launch, reported to the CLI's progress bar."""

    config_id: str
    """The configuration this event is about."""
    state: str
    """One of :data:`STATES`, or ``"skipped"`` (already finished, not rerun)."""
    done: int
    """Configurations finished (including skipped ones) after this event."""
    total: int
    """Configurations in this launch."""
    message: str = ""
    """Short human text (error line, job id, ...)."""


ProgressFn = Callable[[ProgressEvent], None]


@runtime_checkable
class Launcher(Protocol):
    """What every launcher implements; ``sweep`` has its manifest and ``config.json`` files written."""

    name: str

    def prepare(self, sweep: SweepDir, config_ids: Sequence[str]) -> None:
        """Check the launcher can run these configurations (tools, GPUs, ...); write nothing final.

        Raises ``bufreuse.errors.InputError`` (exit 2) when it cannot, with what to do instead.
        """
        ...

    def launch(self, sweep: SweepDir, config_ids: Sequence[str], *, progress: ProgressFn | None = None) -> None:
        """Run (or submit) each configuration; returns when all have ended (local) or are submitted.

        Every configuration must end with a ``metrics.json`` (use :func:`write_failure_metrics` for
        runs that died without writing one). ``progress`` receives a :class:`ProgressEvent` per change.
        """
        ...

    def status(self, sweep: SweepDir) -> dict[str, str]:
        """The state (:data:`STATES`) of every configuration in the sweep's manifest."""
        ...

    def cancel(self, sweep: SweepDir) -> list[str]:
        """Stop configurations still in flight; mark them ``cancelled``; return their ids."""
        ...


def get_launcher(name: str, **options: Any) -> Launcher:
    """Build the launcher registered as ``name`` with its keyword options."""
    try:
        target = LAUNCHERS[name]
    except KeyError:
        raise InputError(f"unknown launcher {name!r}; choose from {', '.join(sorted(LAUNCHERS))}") from None
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise InputError(f"launcher {name!r} is not available in this installation ({e})") from None
    return cls(**options)


def finished_states(sweep: SweepDir, config_ids: Sequence[str] | None = None) -> dict[str, str]:
    """``metrics.json`` status of each configuration, ``pending`` where none is written yet."""
    ids = list(config_ids) if config_ids is not None else sweep.config_ids()
    out: dict[str, str] = {}
    for cid in ids:
        m = sweep.paths(cid).read_metrics()
        out[cid] = m["status"] if m is not None else "pending"
    return out


_RESULT_GLOBS = ("metrics*.json", "snapshot*.pickle.gz", "log*.txt", "stderr.txt", "job.json")


def clear_results(paths: ConfigPaths) -> None:
    """Remove a configuration's previous results before it runs again (``metrics.json`` first).

    The configuration itself (``config.json``) stays. Removing ``metrics.json`` first means a crash
    in the middle leaves the folder unfinished, never finished with stale files beside it.
    """
    paths.metrics.unlink(missing_ok=True)
    for pattern in _RESULT_GLOBS:
        for f in paths.folder.glob(pattern):
            f.unlink(missing_ok=True)


def runner_argv(config_dir: str | os.PathLike[str], *, python: str | None = None) -> list[str]:
    """The command that runs one configuration in a fresh process."""
    return [python or sys.executable, "-m", "bufreuse.bench.runner", str(config_dir)]


def write_failure_metrics(
    paths: ConfigPaths,
    *,
    status: str,
    error: str,
    config: dict[str, Any] | None = None,
    started_at: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``metrics.json`` for a run that ended without writing its own (killed, hung, lost).

    Keeps the contract's keys present (numbers are None) so tables and ``compare`` can list the row.
    """
    if status not in STATUSES or status == "ok":
        raise ValueError(f"status must be one of {STATUSES[1:]}, got {status!r}")
    if config is None:
        try:
            config = read_json(paths.config)
        except (OSError, ValueError):
            config = {}
    env = {"hostname": socket.gethostname(), "python": sys.version.split()[0]}
    metrics = blank_metrics(status=status, error=error, config=config, env=env, started_at=started_at)
    if extra:
        metrics.update(extra)
    atomic_write_json(paths.metrics, metrics)
    return metrics
