"""The SLURM launcher: one sbatch job per configuration, rendered from an editable Jinja2 template.

``launch`` renders ``CONFIG_DIR/job.sbatch`` for each configuration not yet finished and submits
it (``dry_run`` renders only); ``poll``/``wait`` track every job of a sweep with one ``squeue`` call
per poll and record what SLURM says in ``CONFIG_DIR/job.json``; a job that ended without writing
``metrics.json`` (killed, timed out, cancelled, failed before the runner started) gets one written
with its SLURM state and reason, so the sweep table and ``compare`` list it. A re-run submits only
configurations that have no ``metrics.json`` and no job still queued or running (resume);
``cancel`` scancels what is in flight. The jobs write their logs, snapshots and node lists straight
into their configuration folder, which must therefore be on storage the nodes share.

``job.json``: ``job_id``, ``state`` (a :data:`bufreuse.launch.base.STATES` value), ``slurm_state``,
``reason``, ``exit_code``, ``node_list``, ``nodes`` (expanded), ``output`` (SLURM's stdout file),
``script``, ``template``, ``submitted_at``, ``updated_at``, ``source`` (which SLURM tool said so).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bufreuse.errors import InputError, SubmissionError
from bufreuse.fsutil import atomic_write_text
from bufreuse.launch.base import ProgressEvent, ProgressFn, utc_now, write_failure_metrics
from bufreuse.launch.render import load_template, render_script
from bufreuse.launch.site import SlurmSite, check_single_line
from bufreuse.launch.slurm_cmd import JobInfo, SlurmCommands
from bufreuse.launch.slurm_collect import (
    NODES_NAME,
    read_job,
    record_job,
    slurm_state_to_status,
    slurm_summary,
    write_job,
)
from bufreuse.sweepdir import ConfigPaths, SweepDir

__all__ = ["JobRow", "SlurmLauncher", "bufreuse_knob_args", "slurm_state_to_status"]

SCRIPT_NAME = "job.sbatch"
OUTPUT_PATTERN = "slurm-%j.out"
"""SLURM's stdout+stderr file, relative to the configuration folder (sbatch runs with ``--chdir`` there)."""
_NAME_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def bufreuse_knob_args(config: dict[str, Any]) -> list[str]:
    """This feature's Megatron arguments for one configuration; none for the control (slots 0)."""
    mode = config.get("mode", "ring" if config.get("slots") else "control")
    if mode == "stream-ordered":
        return ["--moe-bufreuse-dispatch-policy", "stream-ordered", "--moe-bufreuse-expert-policy", "stream-ordered"]
    slots = int(config.get("slots") or 0)
    if mode == "control" or slots == 0:
        return []
    buffers = config.get("buffers") or ["dispatch", "expert"]
    args: list[str] = []
    if "dispatch" in buffers:
        args += [
            "--moe-hybridep-reuse-dispatch-output-buffers",
            "--moe-hybridep-num-dispatch-output-buffers",
            str(slots),
        ]
    if "expert" in buffers:
        args += ["--moe-hybridep-num-expert-output-buffers", str(slots)]
    return args


@dataclass(kw_only=True, slots=True)
class JobRow:
    """One line of the live status table."""

    config_id: str
    job_id: str | None
    state: str
    slurm_state: str | None
    reason: str | None
    nodes: str | None
    elapsed: str | None


class SlurmLauncher:
    """Submit, track, collect and cancel a sweep's configurations as SLURM jobs.

    Options (all keyword): ``site`` (:class:`SlurmSite`), ``template`` (``"proxy"``, ``"megatron"``
    or a path; default chosen per configuration's workload), ``megatron_args`` (the user's own
    pretrain arguments for the Megatron template), ``dry_run``, ``retry_failed`` (resubmit
    configurations whose ``metrics.json`` says failed/timeout/cancelled), ``commands`` (a
    :class:`SlurmCommands`, e.g. with a private ``SLURM_CONF``).
    """

    name = "slurm"

    def __init__(
        self,
        *,
        site: SlurmSite | None = None,
        template: str | Path | None = None,
        megatron_args: Sequence[str] = (),
        dry_run: bool = False,
        retry_failed: bool = False,
        commands: SlurmCommands | None = None,
    ) -> None:
        self.site = (site or SlurmSite()).validate()
        self.template = template
        self.megatron_args = [check_single_line("--megatron-args", str(a)) for a in megatron_args]
        self.dry_run = dry_run
        self.retry_failed = retry_failed
        self.commands = commands or SlurmCommands()
        self.rendered: dict[str, Path] = {}
        """Scripts written by the last :meth:`launch` (config id → path); ``--dry-run`` prints them."""
        self._held: dict[str, dict[str, Any]] = {}

    def default_world_size(self) -> int:
        """Ranks per configuration: nodes × GPUs per node (one rank when no GPU is requested)."""
        return self.site.world_size

    @property
    def warnings(self) -> list[str]:
        """Tracking problems worth showing (accounting unreachable, ...): status may be inaccurate."""
        return self.commands.warnings

    # -- Launcher protocol ------------------------------------------------------------------------
    def prepare(self, sweep: SweepDir, config_ids: Sequence[str]) -> None:
        """Check the templates render for every configuration and, unless dry-run, that SLURM answers."""
        for cid in config_ids:
            world = sweep.read_config(cid).get("world_size")
            if world is not None and int(world) != self.site.world_size:
                raise InputError(
                    f"configuration {cid}: world_size {world} but the SLURM site gives {self.site.nodes} node(s) x "
                    f"{self.site.ranks_per_node} rank(s); set --slurm-nodes/--slurm-gpus-per-node to match"
                )
            self.render(sweep, cid)
        reachable = self.commands.available()
        if not reachable and self.dry_run:
            return
        if not reachable:
            raise InputError(
                "SLURM is not reachable (sbatch missing or `scontrol show config` failed): run on a login node, "
                "set SLURM_CONF, or use --dry-run to write the scripts only"
            )
        # A caller may clear result files (job.json included) between prepare and launch; remember
        # which configurations still have a job in flight so that launch neither loses nor resubmits them.
        in_flight = self._in_flight(sweep, config_ids)
        self._held = {cid: read_job(sweep.paths(cid)) for cid in in_flight}

    def launch(self, sweep: SweepDir, config_ids: Sequence[str], *, progress: ProgressFn | None = None) -> None:
        """Submit every configuration that has not finished and is not already queued or running."""
        self.rendered = {}
        in_flight = {} if self.dry_run else self._in_flight(sweep, config_ids)
        held, self._held = self._held, {}
        total, done = len(config_ids), 0
        for cid in config_ids:
            paths = sweep.paths(cid)
            metrics = paths.read_metrics()
            skip = None
            if cid in held or cid in in_flight:
                job = held.get(cid) or read_job(paths)
                if not paths.job.exists():
                    write_job(paths, job)
                skip = f"already submitted as job {job.get('job_id')}"
            elif metrics is not None and (
                metrics["status"] == "ok" or (metrics["status"] != "cancelled" and not self.retry_failed)
            ):
                skip = f"finished ({metrics['status']})"
            if skip:
                done += 1
                self._emit(progress, cid, "skipped", done, total, skip)
                continue
            script_path = paths.folder / SCRIPT_NAME
            atomic_write_text(script_path, self.render(sweep, cid))
            script_path.chmod(0o755)
            self.rendered[cid] = script_path
            if self.dry_run:
                self._emit(progress, cid, "pending", done, total, f"dry run: wrote {script_path}")
                continue
            if metrics is not None:  # retry: keep the failed attempt's metrics for the record
                paths.metrics.replace(paths.folder / f"metrics.{read_job(paths).get('job_id', 'prev')}.json")
            job_id = self.commands.sbatch(script_path, cwd=paths.folder)
            output = paths.folder.resolve() / OUTPUT_PATTERN.replace("%j", job_id)
            write_job(paths, {
                "job_id": job_id, "state": "queued", "slurm_state": "PENDING", "reason": None, "exit_code": None,
                "node_list": None, "nodes": [], "output": str(output),
                "script": str(script_path), "template": self._template_for(sweep, cid)[1],
                "submitted_at": utc_now(), "source": "sbatch", "site": self.site.to_dict(),
            })  # fmt: skip
            self._emit(progress, cid, "queued", done, total, f"job {job_id}")

    def status(self, sweep: SweepDir) -> dict[str, str]:
        """Poll SLURM once and return every configuration's state."""
        return {row.config_id: row.state for row in self.poll(sweep)}

    def cancel(self, sweep: SweepDir) -> list[str]:
        """scancel every queued or running job of the sweep; mark those configurations cancelled."""
        ids = sweep.config_ids()
        in_flight = self._in_flight(sweep, ids)
        self.commands.scancel(job.job_id for job in in_flight.values())
        for cid, info in in_flight.items():
            paths = sweep.paths(cid)
            final = self._wait_terminal(info.job_id, timeout_s=10.0)
            job = read_job(paths)
            reason = f"cancelled by bufreuse sweep --cancel (SLURM state {final.state if final else 'unknown'})"
            job.update({"state": "cancelled", "slurm_state": final.state if final else "CANCELLED", "reason": reason,
                        "updated_at": utc_now()})  # fmt: skip
            write_job(paths, job)
            if paths.read_metrics() is None:
                write_failure_metrics(paths, status="cancelled", error=f"job {info.job_id}: {reason}",
                                      extra={"slurm": slurm_summary(job)})  # fmt: skip
        return sorted(in_flight)

    # -- tracking ---------------------------------------------------------------------------------
    def poll(self, sweep: SweepDir, config_ids: Sequence[str] | None = None) -> list[JobRow]:
        """Ask SLURM about every submitted job (one squeue), update ``job.json``, collect finished ones."""
        ids = list(config_ids) if config_ids is not None else sweep.config_ids()
        jobs = {cid: read_job(sweep.paths(cid)) for cid in ids}
        open_ids = {
            cid: str(j["job_id"])
            for cid, j in jobs.items()
            if j.get("job_id") and j.get("state") in ("queued", "running")
        }
        infos = self.commands.squeue(open_ids.values()) if open_ids else {}
        rows: list[JobRow] = []
        for cid in ids:
            paths, job = sweep.paths(cid), jobs[cid]
            if cid in open_ids:
                info = infos.get(open_ids[cid])
                if info is None or info.terminal:
                    info = self._final_info(open_ids[cid], info)
                job = record_job(paths, job, info, self.commands)
            rows.append(self._row(paths, job))
        return rows

    def wait(
        self,
        sweep: SweepDir,
        config_ids: Sequence[str] | None = None,
        *,
        poll_s: float = 10.0,
        timeout_s: float | None = None,
        on_update: Callable[[list[JobRow]], None] | None = None,
        max_poll_failures: int = 5,
    ) -> dict[str, str]:
        """Poll until no job is queued or running (backoff from 0.5 s up to ``poll_s``); return states.

        A poll that fails (controller busy or restarting) is a warning; ``max_poll_failures`` in a row
        raise :class:`SubmissionError`. The jobs themselves are never touched by a failed poll.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay, failures = 0.5, 0
        while True:
            try:
                rows = self.poll(sweep, config_ids)
                failures = 0
            except SubmissionError as e:
                failures += 1
                if failures >= max_poll_failures:
                    raise SubmissionError(f"{e} ({failures} polls in a row failed; the jobs keep running: "
                                          f"bufreuse sweep --status {sweep.folder})") from None  # fmt: skip
                self.warnings.append(f"poll failed, status may be inaccurate: {e}")
                rows = None
            if rows is not None:
                if on_update is not None:
                    on_update(rows)
                if not any(r.state in ("queued", "running") for r in rows):
                    return {r.config_id: r.state for r in rows}
            if deadline is not None and time.monotonic() >= deadline:
                raise SubmissionError(
                    f"{sweep.folder}: jobs still in flight after {timeout_s:.0f} s; "
                    f"check later with `bufreuse sweep --status {sweep.folder}`"
                )
            time.sleep(delay)
            delay = min(poll_s, delay * 1.5)

    # -- rendering --------------------------------------------------------------------------------
    def render(self, sweep: SweepDir, config_id: str) -> str:
        """The sbatch script for one configuration (validated and shell-quoted)."""
        paths = sweep.paths(config_id)
        config = sweep.read_config(config_id)
        source, origin = self._template_for(sweep, config_id, config)
        folder = paths.folder.resolve()
        megatron_args = [str(a) for a in config.get("megatron_args", self.megatron_args)]
        for arg in megatron_args:
            check_single_line("--megatron-args", arg)
        sweep_name = _NAME_SAFE.sub("_", sweep.folder.resolve().name)[:60]
        context = {
            "site": self.site,
            "config": config,
            "python": self.site.interpreter,
            "job": {
                "name": f"bufreuse-{sweep_name}-{config_id}",
                "config_id": config_id,
                "config_dir": str(folder),
                "sweep_dir": str(folder.parent),
                "output": OUTPUT_PATTERN,
                "nodes_file": str(folder / NODES_NAME),
                "log": str(folder / paths.log.name),
                "world_size": self.site.world_size,
                "ranks_per_node": self.site.ranks_per_node,
            },
            "megatron_args": megatron_args,
            "bufreuse_args": bufreuse_knob_args(config),
            "snapshot_path": str(folder / "snapshot.pickle"),
        }
        return render_script(source, context, origin=origin)

    def _template_for(self, sweep: SweepDir, config_id: str, config: dict[str, Any] | None = None) -> tuple[str, str]:
        if self.template is not None:
            return load_template(self.template)
        config = config if config is not None else sweep.read_config(config_id)
        return load_template("megatron" if config.get("workload") == "megatron" else "proxy")

    # -- internals --------------------------------------------------------------------------------
    @staticmethod
    def _emit(progress: ProgressFn | None, cid: str, state: str, done: int, total: int, message: str) -> None:
        if progress is not None:
            progress(ProgressEvent(config_id=cid, state=state, done=done, total=total, message=message))

    def _in_flight(self, sweep: SweepDir, config_ids: Sequence[str]) -> dict[str, JobInfo]:
        """Configurations whose recorded job SLURM still shows as queued or running."""
        recorded = {cid: read_job(sweep.paths(cid)).get("job_id") for cid in config_ids}
        recorded = {cid: str(j) for cid, j in recorded.items() if j}
        if not recorded:
            return {}
        infos = self.commands.squeue(recorded.values())
        out: dict[str, JobInfo] = {}
        for cid, jid in recorded.items():
            info = infos.get(jid)
            if info is not None and not info.terminal:
                out[cid] = info
        return out

    def _final_info(self, job_id: str, seen: JobInfo | None) -> JobInfo | None:
        """Best end-of-job record: scontrol (exit code, times), then sacct, then the jobcomp file."""
        info = self.commands.scontrol_job(job_id)
        if info is not None:
            return info
        if self.commands.accounting_enabled():
            found = self.commands.sacct([job_id]).get(job_id)
            if found is not None:
                return found
        return self.commands.jobcomp([job_id]).get(job_id) or seen

    def _wait_terminal(self, job_id: str, *, timeout_s: float) -> JobInfo | None:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self._final_info(job_id, None)
            if info is None or info.terminal or time.monotonic() >= deadline:
                return info
            time.sleep(0.2)

    @staticmethod
    def _row(paths: ConfigPaths, job: dict[str, Any]) -> JobRow:
        state = job.get("state")
        if not job.get("job_id"):
            metrics = paths.read_metrics()
            state = metrics["status"] if metrics else "pending"
        return JobRow(
            config_id=paths.config_id, job_id=job.get("job_id"), state=str(state), slurm_state=job.get("slurm_state"),
            reason=job.get("reason"), nodes=job.get("node_list"), elapsed=job.get("elapsed"),
        )  # fmt: skip
