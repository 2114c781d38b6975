"""SLURM launcher pieces that need no cluster: site validation, rendering, templates, dry run, cpu-smoke."""

from __future__ import annotations

import importlib.resources
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from bufreuse.bench.cpu_smoke import CpuSmokeFailure, run_configuration
from bufreuse.errors import InputError
from bufreuse.launch.base import LAUNCHERS, Launcher, get_launcher
from bufreuse.launch.render import BUILTIN_TEMPLATES, load_template, render_script
from bufreuse.launch.site import SlurmSite
from bufreuse.launch.slurm import SlurmLauncher, bufreuse_knob_args, slurm_state_to_status
from bufreuse.launch.slurm_cmd import SlurmCommands, parse_key_values
from bufreuse.sweepdir import SweepDir

HOSTILE = [
    "$(touch {canary})",
    "`touch {canary}`",
    "x;touch {canary}",
    "x\ntouch {canary}",
    "x'; touch {canary}; '",
    'x"; touch {canary}; "',
    "x && touch {canary}",
    "x|touch {canary}",
]


def make_sweep(folder: Path, configs: dict[str, dict]) -> SweepDir:
    sweep = SweepDir(folder)
    sweep.write_manifest({"name": folder.name, "launcher": "slurm", "configs": list(configs), "params": {}})
    for cid, extra in configs.items():
        slots = int(extra.get("slots", 0))
        config = {"workload": "cpu-smoke", "mode": "ring" if slots else "control", "slots": slots, "steps": 2}
        sweep.write_config(cid, {**config, **extra})
    return sweep


def no_slurm_commands() -> SlurmCommands:
    """Commands whose PATH holds no SLURM tool: a dry run must not need one."""
    return SlurmCommands(env={"PATH": "/nonexistent"})


@pytest.mark.parametrize("field", ["partition", "account", "qos"])
@pytest.mark.parametrize("pattern", HOSTILE)
def test_site_rejects_hostile_name_partition_account_qos(tmp_path: Path, field: str, pattern: str) -> None:
    with pytest.raises(InputError, match=f"--slurm-{field}"):
        SlurmSite(**{field: pattern.format(canary=tmp_path / "canary")})


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"time": "1:00;id"}, "--slurm-time"),
        ({"nodes": 0}, "--slurm-nodes"),
        ({"gpus_per_node": True}, "--slurm-gpus-per-node"),
        ({"extra_sbatch": ["--comment=a\n#SBATCH --x"]}, "--slurm-extra"),
        ({"extra_sbatch": ["comment=a"]}, "--slurm-extra"),
        ({"env": {"A;B": "1"}}, "--slurm-env"),
        ({"env": {"A": "x\ny"}}, "--slurm-env A"),
        ({"venv": "/v\rx"}, "--slurm-venv"),
        ({"container_image": ""}, "--slurm-container-image"),
    ],
)
def test_site_rejects_bad_value_names_option(kwargs: dict, option: str) -> None:
    with pytest.raises(InputError, match=option):
        SlurmSite(**kwargs)


def test_site_accepts_usual_values() -> None:
    site = SlurmSite(partition="gpu,gpu-long", account="proj_1", qos="normal", time="1-02:00:00", nodes=2,
                     gpus_per_node=8, exclusive=True, extra_sbatch=["--constraint=h200", "--requeue"])  # fmt: skip
    assert site.world_size == 16
    assert site.to_dict()["partition"] == "gpu,gpu-long"


def test_builtin_templates_found_as_package_resources() -> None:
    folder = importlib.resources.files("bufreuse.slurm")
    for name, filename in BUILTIN_TEMPLATES.items():
        assert folder.joinpath(filename).is_file(), filename
        source, origin = load_template(name)
        assert source.startswith("#!/bin/bash") and origin.endswith(filename)


def test_render_quotes_every_value_by_default() -> None:
    hostile = "$(touch /x); `id` 'q' \"d\""
    out = render_script("#!/bin/bash\necho {{ v }}\necho {{ items }}\n", {"v": hostile, "items": ["a b", "c"]})
    assert out.splitlines()[1] == "echo " + shlex.quote(hostile)
    assert out.splitlines()[2] == "echo 'a b' c"


@pytest.mark.parametrize(
    ("template", "message"),
    [("echo hi\n", "must start with"), ("#!/bin/bash\n{{ nope }}\n", "undefined"), ("#!/bin/bash\n{% if %}", "syntax")],
)
def test_render_bad_template_raises_input_error(template: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        render_script(template, {}, origin="mine.j2")


def test_render_sbatch_filter_refuses_newline() -> None:
    with pytest.raises(InputError, match="newline"):
        render_script("#!/bin/bash\n#SBATCH {{ v | sbatch }}\n", {"v": "--a=b\nrm -rf /"})


def test_dry_run_writes_scripts_without_submitting(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path / "dry", {"slots0": {}, "slots4": {"slots": 4}})
    site = SlurmSite(partition="gpu", time="00:10:00")
    launcher = SlurmLauncher(site=site, dry_run=True, commands=no_slurm_commands())
    ids = sweep.config_ids()
    launcher.prepare(sweep, ids)
    events = []
    launcher.launch(sweep, ids, progress=events.append)
    assert sorted(launcher.rendered) == ids
    assert [e.state for e in events] == ["pending", "pending"]
    for cid in ids:
        script = (tmp_path / "dry" / cid / "job.sbatch").read_text()
        assert "#SBATCH --partition=gpu" in script and "#SBATCH --time=00:10:00" in script
        assert "-m bufreuse.bench.runner" in script
        assert not (tmp_path / "dry" / cid / "job.json").exists()
        subprocess.run(["bash", "-n", str(tmp_path / "dry" / cid / "job.sbatch")], check=True)


def test_prepare_without_slurm_raises_input_error(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path / "s", {"slots0": {}})
    with pytest.raises(InputError, match="SLURM is not reachable"):
        SlurmLauncher(commands=no_slurm_commands()).prepare(sweep, ["slots0"])


def test_render_hostile_paths_and_env_stay_quoted(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    folder = tmp_path / f"sw$(touch {canary})`touch {canary}`;x"
    sweep = make_sweep(folder, {"slots0": {}})
    site = SlurmSite(env={"A": f"$(touch {canary})", "B": f"'; touch {canary}; '"},
                     extra_sbatch=[f"--comment=$(touch {canary}) x"], python="/usr/bin/true")  # fmt: skip
    script = SlurmLauncher(site=site, dry_run=True, commands=no_slurm_commands()).render(sweep, "slots0")
    # Run the script's shell body (SLURM variables stubbed): nothing may create the canary.
    body = script.replace('scontrol show hostnames "$SLURM_JOB_NODELIST"', "echo")
    env = {**os.environ, "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"}
    subprocess.run(["bash", "-c", body], check=True, env=env, capture_output=True)
    assert not canary.exists()


def test_megatron_template_passes_knobs_from_slots(tmp_path: Path) -> None:
    configs = {"slots0": {"workload": "megatron"}, "slots4": {"workload": "megatron", "slots": 4}}
    sweep = make_sweep(tmp_path / "m", configs)
    site = SlurmSite(nodes=2, gpus_per_node=8, container_image="nvcr.io/nvidia/pytorch:26.01-py3", exclusive=True)
    launcher = SlurmLauncher(site=site, megatron_args=["--num-layers", "4", "--tokenizer-type", "Null Tokenizer"],
                             dry_run=True, commands=no_slurm_commands())  # fmt: skip
    control, ring = launcher.render(sweep, "slots0"), launcher.render(sweep, "slots4")
    for script in (control, ring):
        assert "-m bufreuse.integrations.entry" in script and "--log-throughput" in script
        assert "--record-memory-history --memory-snapshot-path" in script
        assert "--nnodes=2 --nproc-per-node=8" in script and "'Null Tokenizer'" in script
        assert "--container-image=nvcr.io/nvidia/pytorch:26.01-py3" in script and "#SBATCH --exclusive" in script
        assert "\nPYTHON=python\n" in script  # the container's interpreter, not this machine's
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "moe-hybridep" not in control
    assert ("--moe-hybridep-reuse-dispatch-output-buffers --moe-hybridep-num-dispatch-output-buffers 4 "
            "--moe-hybridep-num-expert-output-buffers 4") in ring  # fmt: skip


def test_knob_args_follow_mode_and_buffers() -> None:
    assert bufreuse_knob_args({"mode": "control", "slots": 0}) == []
    assert bufreuse_knob_args({"mode": "ring", "slots": 2, "buffers": ["expert"]}) == [
        "--moe-hybridep-num-expert-output-buffers",
        "2",
    ]
    assert "stream-ordered" in bufreuse_knob_args({"mode": "stream-ordered", "slots": 0})


def test_user_template_path_is_used(tmp_path: Path) -> None:
    mine = tmp_path / "mine.sbatch.j2"
    mine.write_text(
        "#!/bin/bash\n#SBATCH --job-name={{ job.name | sbatch }}\n{{ python }} -c 'print(1)' {{ job.config_dir }}\n"
    )
    sweep = make_sweep(tmp_path / "u", {"slots0": {}})
    script = SlurmLauncher(template=mine, dry_run=True, commands=no_slurm_commands()).render(sweep, "slots0")
    assert script.splitlines()[1] == "#SBATCH --job-name=bufreuse-u-slots0"
    with pytest.raises(InputError, match="--template"):
        SlurmLauncher(template=tmp_path / "missing.j2", commands=no_slurm_commands()).render(sweep, "slots0")


def test_slurm_launcher_registered_and_satisfies_protocol() -> None:
    assert LAUNCHERS["slurm"] == "bufreuse.launch.slurm:SlurmLauncher"
    launcher = get_launcher("slurm", dry_run=True, commands=no_slurm_commands())
    assert isinstance(launcher, Launcher) and launcher.name == "slurm"


@pytest.mark.parametrize(
    ("state", "status"),
    [("PENDING", "queued"), ("RUNNING", "running"), ("COMPLETED", "ok"), ("FAILED", "failed"),
     ("CANCELLED", "cancelled"), ("TIMEOUT", "timeout"), ("NODE_FAIL", "failed"), ("OUT_OF_MEMORY", "failed")],
)  # fmt: skip
def test_slurm_state_maps_to_status(state: str, status: str) -> None:
    assert slurm_state_to_status(state) == status


def test_parse_key_values_reads_scontrol_line() -> None:
    kv = parse_key_values("JobId=7 JobName=x JobState=FAILED Reason=NonZeroExitCode ExitCode=1:0 NodeList=gpu[1-2]")
    assert kv["JobState"] == "FAILED" and kv["ExitCode"] == "1:0" and kv["NodeList"] == "gpu[1-2]"


def test_sacct_failure_is_a_warning_not_a_crash(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Problem talking to the database' >&2\nexit 1\n")
    (fake / "sacct").chmod(0o755)
    commands = SlurmCommands(env={"PATH": f"{fake}:/usr/bin:/bin"})
    assert commands.sacct(["12"]) == {}
    assert any("status may be inaccurate" in w for w in commands.warnings)


def test_cpu_smoke_runs_and_records_host(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path / "c", {"slots2": {"slots": 2, "iterations": 100}})
    metrics = run_configuration(sweep.read_config("slots2"), sweep.paths("slots2"))
    assert metrics["host"] and len(metrics["step_ms"]["values"]) == 2 and len(metrics["checksum"]) == 64
    assert "step 1" in sweep.paths("slots2").log.read_text()


def test_cpu_smoke_fail_flag_raises(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path / "c", {"slots0": {"fail": True, "iterations": 10}})
    with pytest.raises(CpuSmokeFailure, match="on purpose"):
        run_configuration(sweep.read_config("slots0"), sweep.paths("slots0"))


def test_cpu_smoke_bad_field_raises_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"config\.steps"):
        run_configuration({"steps": 0}, SweepDir(tmp_path).paths("slots0"))


def test_megatron_metrics_from_real_log_shape(tmp_path: Path) -> None:
    from bufreuse.launch.megatron_collect import megatron_metrics

    sweep = make_sweep(tmp_path / "m", {"slots4": {"workload": "megatron", "slots": 4}})
    paths = sweep.paths("slots4")
    paths.log.write_text((Path(__file__).parent / "data" / "logs" / "slurm-2796012.out").read_text())
    status, error, figures = megatron_metrics(paths, job_ok=True)
    assert status == "ok" and error is None
    assert figures["step_ms"]["median"] > 0 and figures["tflops"] > 0
    assert figures["max_reserved_bytes"] >= 170035 * 2**20 and figures["snapshot"] is None
    assert megatron_metrics(paths, job_ok=False)[0] == "failed"


@pytest.mark.parametrize("option", ["--slurm-partition", "--slurm-account", "--slurm-qos"])
def test_cli_hostile_site_value_exits_2_and_runs_nothing(tmp_path: Path, option: str) -> None:
    from typer.testing import CliRunner

    from bufreuse.cli.app import app

    canary = tmp_path / "canary"
    for value in (f"x;touch {canary}", f"$(touch {canary})", f"`touch {canary}`", f"x\ntouch {canary}"):
        result = CliRunner().invoke(app, ["sweep", "--launcher", "slurm", "--workload", "cpu-smoke", "--slots", "0",
                                          "--root", str(tmp_path), option, value, "--dry-run"])  # fmt: skip
        assert result.exit_code == 2 and option in result.output
    assert not canary.exists()


def test_wait_gives_up_after_repeated_poll_failures(tmp_path: Path) -> None:
    from bufreuse.errors import SubmissionError
    from bufreuse.fsutil import atomic_write_json

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "squeue").write_text("#!/bin/sh\necho 'squeue: error: Unable to contact slurm controller' >&2\nexit 1\n")
    (fake / "squeue").chmod(0o755)
    sweep = make_sweep(tmp_path / "w", {"slots0": {}})
    atomic_write_json(sweep.paths("slots0").job, {"job_id": "5", "state": "queued"})
    launcher = SlurmLauncher(commands=SlurmCommands(env={"PATH": f"{fake}:/usr/bin:/bin"}))
    with pytest.raises(SubmissionError, match="2 polls in a row failed; the jobs keep running"):
        launcher.wait(sweep, poll_s=0.1, max_poll_failures=2)
    assert any("Unable to contact slurm controller" in w for w in launcher.warnings)
