"""The SLURM launcher against a real one-node SLURM (``scripts/slurm-cluster.sh``), cpu-smoke jobs.

The session fixture starts munged, slurmctld and slurmd in a private folder on free ports and stops
them by PID at the end. Where SLURM is not installed or cannot start the tests skip with the reason,
except under ``CI=true``, where that is a failure (CI installs SLURM in ``.ci/run``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bufreuse.launch.site import SlurmSite
from bufreuse.launch.slurm import SlurmLauncher
from bufreuse.launch.slurm_cmd import SlurmCommands
from bufreuse.sweepdir import SweepDir

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm-cluster.sh"
WAIT_S = 45.0


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port < 65000:
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"SLURM tests cannot run under CI=true: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCommands]:
    """A running one-node cluster; yields commands bound to its private ``SLURM_CONF``."""
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    if not all(shutil.which(t, path=path) for t in ("slurmctld", "slurmd", "sbatch", "munged")):
        _unavailable("SLURM is not installed (run: bash scripts/slurm-cluster.sh install)")
    folder = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "PATH": path, "BUFREUSE_SLURM_DIR": str(folder), "BUFREUSE_SLURM_PORT": str(_free_port_pair())}
    proc = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        _unavailable(f"scripts/slurm-cluster.sh start failed: {proc.stderr.strip()[-500:]}")
    conf = proc.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF=")
    try:
        yield SlurmCommands(env={"SLURM_CONF": conf, "PATH": path})
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=60)


def _sweep(folder: Path, configs: dict[str, dict]) -> SweepDir:
    sweep = SweepDir(folder)
    old = sweep.config_ids() if sweep.exists() else []
    sweep.write_manifest({"name": folder.name, "launcher": "slurm", "configs": old + list(configs), "params": {}})
    for cid, extra in configs.items():
        slots = int(extra.get("slots", 0))
        base = {"workload": "cpu-smoke", "mode": "ring" if slots else "control", "slots": slots, "steps": 2,
                "iterations": 2000, "timeout_s": 60}  # fmt: skip
        sweep.write_config(cid, {**base, **extra})
    return sweep


def _job(sweep: SweepDir, cid: str) -> dict:
    return json.loads(sweep.paths(cid).job.read_text())


def test_sweep_three_configs_complete_with_job_id_and_host(slurm: SlurmCommands, tmp_path: Path) -> None:
    sweep = _sweep(tmp_path / "three", {"slots0": {}, "slots2": {"slots": 2}, "slots4": {"slots": 4}})
    launcher = SlurmLauncher(commands=slurm)
    ids = sweep.config_ids()
    launcher.prepare(sweep, ids)
    events = []
    launcher.launch(sweep, ids, progress=events.append)
    assert [e.state for e in events] == ["queued"] * 3
    updates = []
    states = launcher.wait(sweep, poll_s=0.5, timeout_s=WAIT_S, on_update=updates.append)
    assert states == {"slots0": "ok", "slots2": "ok", "slots4": "ok"}, [sweep.paths(c).log.read_text() for c in ids]
    assert updates and all(len(rows) == 3 for rows in updates)
    host = socket.gethostname()
    job_ids = set()
    for cid in ids:
        paths, job = sweep.paths(cid), _job(sweep, cid)
        metrics = paths.read_metrics()
        assert metrics["status"] == "ok" and metrics["config"]["slots"] == int(cid.removeprefix("slots"))
        assert metrics["slurm_job_id"] == job["job_id"] == metrics["env"]["slurm_job_id"]
        assert metrics["host"] == host and job["nodes"] == [socket.gethostname().split(".")[0]]
        assert job["slurm_state"] == "COMPLETED" and job["exit_code"] == "0:0"
        assert (paths.folder / f"slurm-{job['job_id']}.out").is_file() and "step 1" in paths.log.read_text()
        job_ids.add(job["job_id"])
    assert len(job_ids) == 3
    # After the controller forgets a job the jobcomp file still has its end state.
    assert slurm.jobcomp(job_ids)[min(job_ids)].state == "COMPLETED"


def test_failing_job_reported_failed_with_reason(slurm: SlurmCommands, tmp_path: Path) -> None:
    sweep = _sweep(tmp_path / "fail", {"slots0": {"fail": True}})
    launcher = SlurmLauncher(commands=slurm)
    launcher.launch(sweep, ["slots0"])
    assert launcher.wait(sweep, poll_s=0.5, timeout_s=WAIT_S) == {"slots0": "failed"}
    job, metrics = _job(sweep, "slots0"), sweep.paths("slots0").read_metrics()
    assert job["slurm_state"] == "FAILED" and job["reason"] == "NonZeroExitCode" and job["exit_code"] == "1:0"
    assert metrics["status"] == "failed" and "failed on purpose" in metrics["error"]
    assert launcher.status(sweep) == {"slots0": "failed"}


def test_job_without_metrics_gets_failure_metrics_with_reason(slurm: SlurmCommands, tmp_path: Path) -> None:
    sweep = _sweep(tmp_path / "nometrics", {"slots0": {}})
    launcher = SlurmLauncher(site=SlurmSite(python="/bin/false"), commands=slurm)
    launcher.launch(sweep, ["slots0"])
    assert launcher.wait(sweep, poll_s=0.5, timeout_s=WAIT_S) == {"slots0": "failed"}
    metrics = sweep.paths("slots0").read_metrics()
    assert metrics["error"].startswith(f"job {_job(sweep, 'slots0')['job_id']} FAILED (NonZeroExitCode, exit 1:0)")
    assert metrics["slurm"]["nodes"]


def test_cancel_stops_running_job_and_marks_cancelled(slurm: SlurmCommands, tmp_path: Path) -> None:
    sweep = _sweep(tmp_path / "cancel", {"slots0": {"iterations": 10**9, "steps": 1}})
    launcher = SlurmLauncher(commands=slurm)
    launcher.launch(sweep, ["slots0"])
    job_id = _job(sweep, "slots0")["job_id"]
    deadline = time.monotonic() + WAIT_S
    while launcher.status(sweep)["slots0"] != "running" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launcher.cancel(sweep) == ["slots0"]
    assert slurm.scontrol_job(job_id).state == "CANCELLED"
    assert sweep.paths("slots0").read_metrics()["status"] == "cancelled"
    assert launcher.status(sweep) == {"slots0": "cancelled"}
    assert launcher.cancel(sweep) == []


def test_resume_submits_only_unfinished(slurm: SlurmCommands, tmp_path: Path) -> None:
    sweep = _sweep(tmp_path / "resume", {"slots0": {}})
    launcher = SlurmLauncher(commands=slurm)
    launcher.launch(sweep, ["slots0"])
    assert launcher.wait(sweep, poll_s=0.5, timeout_s=WAIT_S) == {"slots0": "ok"}
    first = _job(sweep, "slots0")["job_id"]
    _sweep(tmp_path / "resume", {"slots2": {"slots": 2}})
    events = []
    launcher.launch(sweep, sweep.config_ids(), progress=events.append)
    assert [(e.config_id, e.state) for e in events] == [("slots0", "skipped"), ("slots2", "queued")]
    assert list(launcher.rendered) == ["slots2"] and _job(sweep, "slots0")["job_id"] == first
    # A re-run while slots2 is still queued or running does not submit it twice.
    again = []
    launcher.launch(sweep, sweep.config_ids(), progress=again.append)
    assert not launcher.rendered or sweep.paths("slots2").read_metrics() is None
    assert launcher.wait(sweep, poll_s=0.5, timeout_s=WAIT_S) == {"slots0": "ok", "slots2": "ok"}


def test_shell_injection_values_execute_nothing(slurm: SlurmCommands, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    hostile = [f"$(touch {canary})", f"`touch {canary}`", f"x;touch {canary}", f"x'; touch {canary}; '",
               f'x"; touch {canary}; "', f"x && touch {canary} #"]  # fmt: skip
    folder = tmp_path / f"sw$(touch {canary})`touch {canary}`;x'y\"z"
    sweep = _sweep(folder, {"slots0": {}})
    site = SlurmSite(
        env={f"V{i}": value for i, value in enumerate(hostile)},
        extra_sbatch=[f"--comment={hostile[0]}", f"--comment={hostile[2]}"],
    )
    launcher = SlurmLauncher(site=site, commands=slurm)
    launcher.launch(sweep, ["slots0"])
    assert launcher.wait(sweep, poll_s=0.5, timeout_s=WAIT_S) == {"slots0": "ok"}
    assert sweep.paths("slots0").read_metrics()["status"] == "ok"
    script = (sweep.paths("slots0").folder / "job.sbatch").read_text()
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export V"))
    for i, value in enumerate(hostile):  # each value reaches the job verbatim, as data
        shown = subprocess.run(["bash", "-c", f'{exports}\nprintf %s "$V{i}"'], capture_output=True, text=True)
        assert shown.stdout == value
    assert not canary.exists()


def test_run_sweep_through_slurm_resumes_without_resubmitting(slurm: SlurmCommands, tmp_path: Path) -> None:
    from bufreuse.launch.sweep import SweepSpec, run_sweep

    spec = SweepSpec(slots=[0, 2, 4], params={"workload": "cpu-smoke", "device": "cpu", "steps": 60, "warmup_steps": 0},
                     name="cpu", root=str(tmp_path), timeout_s=60)  # fmt: skip
    options = {"commands": slurm}
    first = run_sweep(spec, launcher="slurm", launcher_options=options)
    assert first.ran == ["slots0", "slots2", "slots4"] and first.launcher == "slurm"
    sweep = SweepDir(first.folder)
    job_ids = {cid: _job(sweep, cid)["job_id"] for cid in first.ran}
    again = run_sweep(spec, launcher="slurm", launcher_options=options)  # while the jobs are in flight (~1 s each)
    # in-flight jobs are skipped, not handed to the launcher again (commit 53edf7d)
    assert again.ran == [] and again.skipped == first.ran
    assert set(again.statuses.values()) <= {"queued", "running"}
    assert {cid: _job(sweep, cid)["job_id"] for cid in first.ran} == job_ids
    launcher = SlurmLauncher(commands=slurm)
    assert launcher.wait(sweep, poll_s=0.5, timeout_s=WAIT_S) == dict.fromkeys(first.ran, "ok")
    for cid in first.ran:
        assert sweep.paths(cid).read_metrics()["env"]["slurm_job_id"] == job_ids[cid]
    third = run_sweep(spec, launcher="slurm", launcher_options=options)
    assert third.ran == [] and third.skipped == first.ran and again.launcher == "slurm"


def test_user_template_megatron_job_collected_from_its_log(slurm: SlurmCommands, tmp_path: Path) -> None:
    log = REPO / "tests" / "data" / "logs" / "slurm-2796012.out"
    mine = tmp_path / "mine.sbatch.j2"
    mine.write_text(
        "#!/bin/bash\n#SBATCH --job-name={{ job.name | sbatch }}\n#SBATCH --output={{ job.output | sbatch }}\n"
        "echo would run: {{ bufreuse_args }}\ncat {{ config.recorded_log }} > {{ job.log }}\n"
    )
    # The template stands in for a Megatron run by copying a recorded Megatron log to log.txt.
    sweep = _sweep(tmp_path / "meg", {"slots4": {"workload": "megatron", "slots": 4, "recorded_log": str(log)}})
    launcher = SlurmLauncher(template=mine, commands=slurm)
    launcher.launch(sweep, ["slots4"])
    assert launcher.wait(sweep, poll_s=0.5, timeout_s=WAIT_S) == {"slots4": "ok"}
    metrics = sweep.paths("slots4").read_metrics()
    assert metrics["step_ms"]["median"] > 0 and metrics["env"]["slurm_job_id"] == _job(sweep, "slots4")["job_id"]
    out = (sweep.paths("slots4").folder / f"slurm-{_job(sweep, 'slots4')['job_id']}.out").read_text()
    assert "--moe-hybridep-num-dispatch-output-buffers 4" in out


def _cli(slurm: SlurmCommands, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    from typer.testing import CliRunner

    from bufreuse.cli.app import app

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.setenv("PATH", slurm.env["PATH"])
    return CliRunner().invoke(app, list(args))


def test_cli_sweep_cpu_smoke_submits_waits_and_reports_status(
    slurm: SlurmCommands, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _cli(slurm, monkeypatch, "sweep", "--launcher", "slurm", "--workload", "cpu-smoke", "--slots", "0,2,4",
                  "--steps", "2", "--root", str(tmp_path), "--name", "cli", "--slurm-poll", "0.5")  # fmt: skip
    assert result.exit_code == 0, result.output
    sweep = SweepDir(tmp_path / "cli")
    status = _cli(slurm, monkeypatch, "sweep", "--status", str(sweep.folder), "--json")
    assert status.exit_code == 0, status.output
    payload = json.loads(status.stdout)
    assert payload["launcher"] == "slurm" and payload["states"] == {"slots0": "ok", "slots2": "ok", "slots4": "ok"}
    for job in payload["jobs"]:
        metrics = sweep.paths(job["config_id"]).read_metrics()
        assert job["slurm_state"] == "COMPLETED" and metrics["env"]["slurm_job_id"] == job["job_id"]


def test_cli_cancel_stops_submitted_sweep(
    slurm: SlurmCommands, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _cli(slurm, monkeypatch, "sweep", "--launcher", "slurm", "--workload", "cpu-smoke", "--slots", "0",
                  "--steps", "100000", "--root", str(tmp_path), "--name", "long", "--no-wait")  # fmt: skip
    assert result.exit_code == 0, result.output
    folder = str(tmp_path / "long")
    cancelled = _cli(slurm, monkeypatch, "sweep", "--cancel", folder, "--json")
    assert cancelled.exit_code == 0 and json.loads(cancelled.stdout)["cancelled"] == ["slots0"]
    status = _cli(slurm, monkeypatch, "sweep", "--status", folder, "--json")
    assert json.loads(status.stdout)["states"] == {"slots0": "cancelled"}
