"""Thin, typed wrappers over SLURM's command-line tools: sbatch, squeue, scontrol, sacct, scancel.

The only module that runs SLURM commands. Each call is one subprocess with a timeout (an
unresponsive controller must not hang a sweep); one ``squeue`` covers every job of a sweep, so a
poll costs one RPC however many configurations there are, plus one ``scontrol show job`` per job
the first time it is seen finished. Where a job has left the controller's memory (``MinJobAge``,
default 300 s) the end state comes from ``sacct`` when accounting is configured, else from the
``jobcomp/filetxt`` file when the cluster writes one. A failed accounting call is reported through
``warnings`` ("status may be inaccurate"), never raised.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bufreuse.errors import SubmissionError

__all__ = ["TERMINAL_STATES", "JobInfo", "SlurmCommands", "parse_key_values"]

TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)
"""SLURM job states after which the job will not run again (unless requeued by an admin)."""

_SQUEUE_FORMAT = "%i|%T|%r|%N|%M"
_JOB_ID_RE = re.compile(r"^(\d+)(?:;.*)?$")
_KV_RE = re.compile(r"(\S+?)=(\S*)")


@dataclass(kw_only=True, slots=True)
class JobInfo:
    """What SLURM says about one job; ``state`` is SLURM's (``PENDING``, ``FAILED``, ...)."""

    job_id: str
    """SLURM job id as sbatch printed it."""
    state: str
    """SLURM state, upper case, without qualifiers (``CANCELLED by 0`` becomes ``CANCELLED``)."""
    reason: str | None = None
    """SLURM's reason (``Priority``, ``NonZeroExitCode``, ``TimeLimit``, ...); None when ``None``."""
    node_list: str | None = None
    """Compressed node list (``gpu[001-004]``)."""
    exit_code: str | None = None
    """``code:signal`` of the batch script, once finished."""
    elapsed: str | None = None
    start_time: str | None = None
    end_time: str | None = None
    source: str = "squeue"
    """Which command said so: squeue, scontrol, sacct or jobcomp."""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _clean_state(state: str) -> str:
    return state.strip().split()[0].rstrip("+").upper() if state.strip() else "UNKNOWN"


def _none(value: str | None) -> str | None:
    return None if value in (None, "", "None", "(null)", "Unknown", "N/A") else value


def parse_key_values(line: str) -> dict[str, str]:
    """Parse ``scontrol -o`` / jobcomp lines (``Key=value Key=value``); values hold no spaces there."""
    return {m.group(1): m.group(2) for m in _KV_RE.finditer(line)}


class SlurmCommands:
    """Runs SLURM tools with ``env`` (e.g. a private ``SLURM_CONF``); ``timeout_s`` bounds each call."""

    def __init__(self, *, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> None:
        self.env = dict(os.environ) if env is None else {**os.environ, **env}
        self.timeout_s = timeout_s
        self.warnings: list[str] = []
        self._config: dict[str, str] | None = None

    # -- plumbing ---------------------------------------------------------------------------------
    def _run(self, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        if shutil.which(argv[0], path=self.env.get("PATH")) is None:
            raise SubmissionError(
                f"{argv[0]} not found on PATH: run this on a SLURM login node (or start one: "
                "bash scripts/slurm-cluster.sh start)"
            )
        try:
            proc = subprocess.run(
                list(argv), capture_output=True, text=True, env=self.env, timeout=self.timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            raise SubmissionError(f"{' '.join(argv[:3])} did not answer within {self.timeout_s:.0f} s") from None
        if check and proc.returncode != 0:
            tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise SubmissionError(f"{' '.join(argv[:2])} failed (exit {proc.returncode}): {tail}")
        return proc

    def available(self) -> bool:
        """True when sbatch is on PATH and the controller answers."""
        if shutil.which("sbatch", path=self.env.get("PATH")) is None:
            return False
        try:
            self.config()
        except SubmissionError:
            return False
        return True

    def config(self) -> dict[str, str]:
        """``scontrol show config`` as a dict (cached per instance)."""
        if self._config is None:
            out = self._run(["scontrol", "show", "config"]).stdout
            conf: dict[str, str] = {}
            for line in out.splitlines():
                key, sep, value = line.partition("=")
                if sep:
                    conf[key.strip()] = value.strip()
            self._config = conf
        return self._config

    # -- submit / cancel --------------------------------------------------------------------------
    def sbatch(self, script: str | os.PathLike[str], *, cwd: str | os.PathLike[str] | None = None) -> str:
        """Submit ``script``; return the job id. Raises :class:`SubmissionError` with sbatch's stderr."""
        argv = ["sbatch", "--parsable"]
        if cwd is not None:
            argv.append(f"--chdir={cwd}")
        proc = self._run([*argv, str(script)])
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        m = _JOB_ID_RE.match(line)
        if not m:
            raise SubmissionError(f"sbatch {script}: could not parse a job id from {proc.stdout.strip()!r}")
        return m.group(1)

    def scancel(self, job_ids: Iterable[str]) -> None:
        ids = [str(j) for j in job_ids]
        if ids:
            self._run(["scancel", *ids], check=False)

    # -- track ------------------------------------------------------------------------------------
    def squeue(self, job_ids: Iterable[str]) -> dict[str, JobInfo]:
        """One ``squeue -t all`` for all ``job_ids``; jobs the controller forgot are absent."""
        ids = sorted({str(j) for j in job_ids}, key=int)
        if not ids:
            return {}
        proc = self._run(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", _SQUEUE_FORMAT], check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return {}
            tail = " ".join(proc.stderr.strip().splitlines()[-2:])
            raise SubmissionError(f"squeue failed (exit {proc.returncode}): {tail}")
        out: dict[str, JobInfo] = {}
        for line in proc.stdout.splitlines():
            parts = line.split("|")
            if len(parts) != 5 or parts[0] not in ids:
                continue
            jid, state, reason, nodes, elapsed = parts
            out[jid] = JobInfo(
                job_id=jid, state=_clean_state(state), reason=_none(reason), node_list=_none(nodes),
                elapsed=_none(elapsed), source="squeue",
            )  # fmt: skip
        return out

    def scontrol_job(self, job_id: str) -> JobInfo | None:
        """``scontrol show job -o ID``: exit code and times too; None once the controller forgot it."""
        proc = self._run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if proc.returncode != 0 or not proc.stdout.strip():
            return None
        kv = parse_key_values(proc.stdout.strip().splitlines()[0])
        return JobInfo(
            job_id=str(job_id), state=_clean_state(kv.get("JobState", "")), reason=_none(kv.get("Reason")),
            node_list=_none(kv.get("NodeList")), exit_code=_none(kv.get("ExitCode")), elapsed=_none(kv.get("RunTime")),
            start_time=_none(kv.get("StartTime")), end_time=_none(kv.get("EndTime")), source="scontrol",
        )  # fmt: skip

    def accounting_enabled(self) -> bool:
        return self.config().get("AccountingStorageType", "accounting_storage/none") != "accounting_storage/none"

    def sacct(self, job_ids: Iterable[str]) -> dict[str, JobInfo]:
        """End states from accounting; a failing sacct adds a warning and returns nothing."""
        ids = [str(j) for j in job_ids]
        if not ids:
            return {}
        argv = ["sacct", "-n", "-P", "-X", "-j", ",".join(ids), "-o", "JobID,State,Reason,NodeList,ExitCode,Elapsed"]
        try:
            proc = self._run(argv)
        except SubmissionError as e:
            self.warnings.append(f"sacct failed, status may be inaccurate: {e}")
            return {}
        out: dict[str, JobInfo] = {}
        for line in proc.stdout.splitlines():
            parts = line.split("|")
            if len(parts) >= 6 and parts[0] in ids:
                out[parts[0]] = JobInfo(
                    job_id=parts[0], state=_clean_state(parts[1]), reason=_none(parts[2]), node_list=_none(parts[3]),
                    exit_code=_none(parts[4]), elapsed=_none(parts[5]), source="sacct",
                )  # fmt: skip
        return out

    def jobcomp(self, job_ids: Iterable[str]) -> dict[str, JobInfo]:
        """End states from the ``jobcomp/filetxt`` file, when the cluster writes one we can read."""
        ids = {str(j) for j in job_ids}
        try:
            conf = self.config()
        except SubmissionError as e:
            self.warnings.append(f"scontrol show config failed, status may be inaccurate: {e}")
            return {}
        if not ids or conf.get("JobCompType") != "jobcomp/filetxt":
            return {}
        path = Path(conf.get("JobCompLoc", ""))
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as e:
            self.warnings.append(f"cannot read the jobcomp file {path} ({e.strerror}), status may be inaccurate")
            return {}
        out: dict[str, JobInfo] = {}
        for line in lines:
            kv = parse_key_values(line)
            jid = kv.get("JobId")
            if jid in ids:
                out[jid] = JobInfo(
                    job_id=jid, state=_clean_state(kv.get("JobState", "")), node_list=_none(kv.get("NodeList")),
                    exit_code=_none(kv.get("ExitCode")), start_time=_none(kv.get("StartTime")),
                    end_time=_none(kv.get("EndTime")), source="jobcomp",
                )  # fmt: skip
        return out

    def hostnames(self, node_list: str) -> list[str]:
        """Expand a compressed node list (``gpu[001-003]``) with ``scontrol show hostnames``."""
        proc = self._run(["scontrol", "show", "hostnames", node_list], check=False)
        names = proc.stdout.split() if proc.returncode == 0 else []
        return names or [node_list]
