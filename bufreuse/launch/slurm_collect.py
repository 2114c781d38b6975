"""Record what SLURM says about a configuration's job in ``job.json``; collect it once it ended.

Collecting a finished job means: expand its node list (``nodes.txt`` the job wrote, else
``scontrol show hostnames``), and make sure the folder has a ``metrics.json``. The runner writes its
own; a job that ended without one (cancelled while queued, timed out, killed, failed before Python
started) gets one written here with status ``cancelled``/``timeout``/``failed`` and an error naming
the job id, SLURM state, reason, exit code and the tail of its output. A Megatron configuration's
metrics come from its training log (:mod:`bufreuse.launch.megatron_collect`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bufreuse.fsutil import atomic_write_json, read_json
from bufreuse.launch.base import utc_now, write_failure_metrics
from bufreuse.launch.slurm_cmd import JobInfo, SlurmCommands
from bufreuse.sweepdir import ConfigPaths

__all__ = ["NODES_NAME", "read_job", "record_job", "slurm_state_to_status", "slurm_summary", "write_job"]

NODES_NAME = "nodes.txt"
"""Expanded node list the job script writes into its configuration folder."""
_FINAL_STATUS = {"COMPLETED": "ok", "CANCELLED": "cancelled", "TIMEOUT": "timeout", "DEADLINE": "timeout"}
_QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESV_DEL_HOLD", "STOPPED"}
_RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESIZING", "UNKNOWN"}


def slurm_state_to_status(state: str) -> str:
    """Map a SLURM state to a bufreuse state: queued, running, ok, failed, cancelled or timeout."""
    if state in _QUEUED:
        return "queued"
    if state in _FINAL_STATUS:
        return _FINAL_STATUS[state]
    return "running" if state in _RUNNING else "failed"


def read_job(paths: ConfigPaths) -> dict[str, Any]:
    """The configuration's ``job.json`` ({} when absent or unreadable)."""
    try:
        data = read_json(paths.job)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_job(paths: ConfigPaths, job: dict[str, Any]) -> None:
    job["updated_at"] = utc_now()
    atomic_write_json(paths.job, job)


def slurm_summary(job: dict[str, Any]) -> dict[str, Any]:
    """The ``slurm`` block of a launcher-written ``metrics.json``."""
    keys = ("job_id", "slurm_state", "reason", "exit_code", "node_list", "nodes", "output")
    return {k: job.get(k) for k in keys}


def record_job(
    paths: ConfigPaths, job: dict[str, Any], info: JobInfo | None, commands: SlurmCommands
) -> dict[str, Any]:
    """Update ``job.json`` from ``info`` (None: SLURM no longer knows the job); collect a finished job."""
    job = dict(job)
    if info is None:  # nobody remembers the job: trust metrics.json if the run wrote one
        metrics = paths.read_metrics()
        job["state"] = metrics["status"] if metrics else "failed"
        job["reason"] = job.get("reason") or "job unknown to SLURM (purged; no accounting or jobcomp record)"
        commands.warnings.append(
            f"job {job.get('job_id')}: not found in squeue/scontrol/accounting, status may be inaccurate"
        )
    else:
        for key in ("reason", "node_list", "exit_code", "elapsed", "start_time", "end_time"):
            value = getattr(info, key)
            if value is not None or key not in job or (info.terminal and key == "reason"):
                job[key] = value
        job["slurm_state"], job["source"] = info.state, info.source
        job["state"] = slurm_state_to_status(info.state)
    if job["state"] in ("queued", "running"):
        write_job(paths, job)
        return job
    if job.get("node_list") and not job.get("nodes"):
        try:
            job["nodes"] = (paths.folder / NODES_NAME).read_text().split()
        except OSError:
            job["nodes"] = commands.hostnames(job["node_list"])
    metrics = paths.read_metrics() or _collect_metrics(paths, job)
    job["state"] = metrics["status"]
    job["collected_at"] = utc_now()
    write_job(paths, job)
    return job


def _collect_metrics(paths: ConfigPaths, job: dict[str, Any]) -> dict[str, Any]:
    """Write ``metrics.json`` for a job that ended without one (Megatron: from its log)."""
    config = read_json(paths.config) if paths.config.is_file() else {}
    extra: dict[str, Any] = {"slurm": slurm_summary(job)}
    status = "failed" if job["state"] == "ok" else job["state"]
    error: str | None = None
    if config.get("workload") == "megatron":
        from bufreuse.launch.megatron_collect import megatron_metrics

        found, error, figures = megatron_metrics(paths, job_ok=job["state"] == "ok")
        extra.update(figures)
        if found == "ok":
            metrics = {
                "status": "ok", "error": None, "config": config, "pending_free_at_max_active_bytes": None,
                "pending_free_by_category_at_max_active": None, "ring_bytes": {}, "ring_slot_bytes": {},
                "checksum": None, "env": {"slurm_job_id": job.get("job_id"), "slurm_nodelist": job.get("node_list")},
                "started_at": job.get("start_time"), "finished_at": job.get("end_time") or utc_now(), **extra,
            }  # fmt: skip
            atomic_write_json(paths.metrics, metrics)
            return metrics
    if error is None:
        error = _failure_text(job, wrote_nothing=job["state"] == "ok")
        job["reason"] = job.get("reason") or error
    return write_failure_metrics(paths, status=status, error=error, config=config, extra=extra)


def _failure_text(job: dict[str, Any], *, wrote_nothing: bool) -> str:
    head = f"job {job.get('job_id')} {job.get('slurm_state', 'ended')}"
    details = [d for d in (job.get("reason"), f"exit {job['exit_code']}" if job.get("exit_code") else None) if d]
    text = head + (f" ({', '.join(details)})" if details else "")
    if wrote_nothing:
        text += " but wrote no metrics.json"
    tail = _tail(Path(str(job.get("output", ""))))
    return f"{text}: {tail}" if tail else text


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])
