"""Sweep building, the sweep folder's resume / skip / force logic and the local launcher (CPU runs)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bufreuse.cli import app
from bufreuse.errors import InputError
from bufreuse.launch.base import LAUNCHERS, Launcher, clear_results, get_launcher, write_failure_metrics
from bufreuse.launch.local import LocalLauncher
from bufreuse.launch.sweep import SweepSpec, build_configs, default_name, parse_int_list, run_sweep
from bufreuse.sweepdir import SweepDir

TINY = {"hidden": 32, "ffn": 16, "tokens": 64, "local_experts": 4, "microbatches": 4, "comm_ms": 0.0,
        "device": "cpu", "steps": 2, "warmup_steps": 1, "record_steps": 0}  # fmt: skip


def _spec(tmp_path: Path, **over: object) -> SweepSpec:
    kw: dict[str, object] = {"slots": [0, 2], "modes": ["stream-ordered"], "params": dict(TINY), "name": "t"}
    kw.update(over)
    return SweepSpec(root=str(tmp_path), timeout_s=60, **kw)  # type: ignore[arg-type]


def test_build_configs_ids_modes_and_graph_suffix() -> None:
    configs = build_configs(SweepSpec(slots=[10, 0, 4], modes=["stream-ordered"]))
    assert list(configs) == ["slots0", "slots4", "slots10", "stream-ordered"]
    assert [c["mode"] for c in configs.values()] == ["control", "ring", "ring", "stream-ordered"]
    assert configs["slots4"]["slots"] == 4 and configs["slots0"]["hidden"] == 4096
    graph = build_configs(SweepSpec(slots=[4], modes=["control"], cuda_graph=True))
    assert list(graph) == ["slots0-graph", "slots4-graph"] and graph["slots4-graph"]["cuda_graph"] is True


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"slots": [-1]}, "--slots"),
        ({"modes": ["ring9"]}, "--modes"),
        ({"buffers": ["attention"]}, "--buffers"),
        ({"params": {"hidden": 0}}, "--hidden"),
        ({"params": {"bogus": 1}}, "unknown sweep parameter"),
        ({"params": {"dtype": "int7"}}, "--dtype int7"),
        ({"params": {"warmup_steps": -1}}, "--warmup-steps"),
        ({"name": "../escape"}, "--name '../escape'"),
        ({"name": "a/b"}, "--name"),
    ],
)
def test_spec_invalid_names_option(over: dict[str, object], match: str) -> None:
    with pytest.raises(InputError, match=match):
        SweepSpec(**over).validate()  # type: ignore[arg-type]


def test_cli_sweep_name_outside_root_refused(tmp_path: Path) -> None:
    args = ["sweep", "--workload", "cpu-smoke", "--root", str(tmp_path / "r"), "--name", "../escape"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "--name" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "escape").exists() and not (tmp_path / "r").exists()


def test_parse_int_list_rejects_words() -> None:
    assert parse_int_list("0, 4,10", "--slots") == [0, 4, 10]
    with pytest.raises(InputError, match="--slots"):
        parse_int_list("0,four", "--slots")


def test_default_name_stable_and_param_sensitive() -> None:
    a, b = SweepSpec(slots=[0, 4]), SweepSpec(slots=[0, 10])
    assert default_name(a, 1) == default_name(b, 1)  # slot lists grow one sweep
    assert default_name(a, 1) != default_name(SweepSpec(params={"comm_ms": 3.0}), 1)


def test_get_launcher_registry() -> None:
    assert isinstance(get_launcher("local"), Launcher)
    assert set(LAUNCHERS) >= {"local", "slurm"}
    with pytest.raises(InputError, match="unknown launcher"):
        get_launcher("kubernetes")


def test_sweep_cpu_end_to_end_then_resume_and_force(tmp_path: Path) -> None:
    from bufreuse.analysis.render.plots import sweep_figures
    from bufreuse.analysis.render.sweep_tables import sweep_table
    from bufreuse.analysis.runs.sweep_rows import checksum_mismatches, load_sweep_rows
    from bufreuse.cli._common import write_figures

    events: list[tuple[str, str]] = []
    res = run_sweep(_spec(tmp_path), progress=lambda e: events.append((e.config_id, e.state)))
    assert res.config_ids == ["slots0", "slots2", "stream-ordered"] and res.ran == res.config_ids
    assert res.statuses == dict.fromkeys(res.config_ids, "ok")
    assert ("slots2", "running") in events and ("slots2", "ok") in events
    manifest = SweepDir(res.folder).read_manifest()
    assert manifest["configs"] == res.config_ids and manifest["launcher"] == "local"
    rows = load_sweep_rows(res.folder)
    assert not checksum_mismatches(rows) and rows[1].reserved_delta_bytes is None  # CPU: no CUDA memory figures
    assert rows[0].step_delta_pct == 0.0
    assert sweep_table(rows).row_count == 3
    assert all(p.stat().st_size > 1000 for p in write_figures(res.folder, sweep_figures(rows)))

    again = run_sweep(_spec(tmp_path))
    assert again.ran == [] and again.skipped == res.config_ids
    # A run killed midway: its folder has a log but no metrics.json; only it reruns.
    slots2 = SweepDir(res.folder).paths("slots2")
    slots2.metrics.unlink()
    (slots2.folder / ".metrics.json.x.tmp").write_text("{half")
    resumed = run_sweep(_spec(tmp_path, slots=[0, 2, 4]))
    assert resumed.ran == ["slots2", "slots4"] and resumed.statuses["slots4"] == "ok"
    assert SweepDir(res.folder).read_manifest()["configs"] == ["slots0", "slots2", "stream-ordered", "slots4"]
    forced = run_sweep(_spec(tmp_path, slots=[0], modes=[], force=True))
    assert forced.ran == ["slots0"]


def test_sweep_changed_parameters_refused_without_force(tmp_path: Path) -> None:
    sweep = SweepDir(tmp_path / "t")
    configs = build_configs(_spec(tmp_path))
    sweep.write_manifest({"name": "t", "configs": list(configs)})
    for cid, cfg in configs.items():
        sweep.write_config(cid, {**cfg, "hidden": 64})
    with pytest.raises(InputError, match="hidden"):
        run_sweep(_spec(tmp_path))


def _fake_workloads(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "fake_workloads.py").write_text(
        textwrap.dedent(
            """
            import logging, time

            def slow_but_alive(config, paths):
                if config["slots"] == 2:  # keeps logging, never ends: the launcher's timeout stops it
                    while True:
                        logging.getLogger("fake").info("still working")
                        time.sleep(0.1)
                if config["slots"] == 4:  # stops logging: the runner's watchdog calls it hung
                    time.sleep(3600)
                return {"step_ms": {"median": 1.0, "p10": 1.0, "p90": 1.0}, "checksum": "same"}
            """
        )
    )
    return {"PYTHONPATH": str(tmp_path), "BUFREUSE_WORKLOADS": "fake=fake_workloads:slow_but_alive"}


def test_sweep_timeout_and_hung_recorded_and_sweep_goes_on(tmp_path: Path) -> None:
    launcher = LocalLauncher(grace_s=0.5, env=_fake_workloads(tmp_path))
    spec = SweepSpec(
        slots=[0, 2, 4, 6], params={**TINY, "workload": "fake"}, timeout_s=2.0, root=str(tmp_path), name="f"
    )
    res = run_sweep(spec, launcher=launcher)
    assert res.statuses == {"slots0": "ok", "slots2": "timeout", "slots4": "hung", "slots6": "ok"}
    sweep = SweepDir(res.folder)
    assert "killed after" in sweep.paths("slots2").read_metrics()["error"]
    assert (
        "time.sleep" in sweep.paths("slots4").log.read_text()
        or "slow_but_alive" in sweep.paths("slots4").log.read_text()
    )
    assert launcher.status(sweep) == res.statuses
    again = run_sweep(spec, launcher=launcher)
    assert again.ran == []  # hung and timed-out configurations count as finished


def test_write_failure_metrics_and_clear_results(tmp_path: Path) -> None:
    paths = SweepDir(tmp_path).paths("slots4")
    paths.folder.mkdir()
    paths.config.write_text(json.dumps({"slots": 4}))
    with pytest.raises(ValueError):
        write_failure_metrics(paths, status="ok", error="")
    m = write_failure_metrics(paths, status="cancelled", error="stopped")
    assert paths.read_metrics() == m and m["config"] == {"slots": 4} and m["max_reserved_bytes"] is None
    paths.log.write_text("x")
    clear_results(paths)
    assert not paths.metrics.exists() and not paths.log.exists() and paths.config.exists()


def test_cli_sweep_without_cuda_exits_2_and_points_to_slurm_and_demo(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = CliRunner().invoke(app, ["sweep", "--slots", "0,4", "--root", str(tmp_path)])
    assert result.exit_code == 2
    assert "--launcher slurm" in result.output and "bufreuse demo" in result.output
    assert not any(tmp_path.iterdir())


EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "sweep-h200"


@pytest.mark.skipif(not (EXAMPLES / "manifest.json").is_file(), reason="examples/sweep-h200 not recorded yet")
def test_cli_sweep_rerun_of_recorded_sweep_skips_all_and_renders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    monkeypatch.setenv("COLUMNS", "160")
    shutil.copytree(EXAMPLES, tmp_path / "sweep-h200")
    args = ["sweep", "--slots", "0,2,4,10", "--modes", "stream-ordered", "--root", str(tmp_path),
            "--name", "sweep-h200", "--timeout", "120"]  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["ran"] == [] and len(payload["skipped"]) == 5 and payload["checksums_match"] is True
    rows = {r["config_id"]: r for r in payload["rows"]}
    assert rows["slots4"]["reserved_delta_bytes"] < 0 and rows["slots4"]["pending_free_bytes"] == 0
    assert rows["slots0"]["pending_free_bytes"] > 0
    assert all(Path(p).is_file() for p in payload["plots"])
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "stream-ordered" in table.stdout and "3,160" in table.stdout


def test_local_cancel_stops_running_configuration(tmp_path: Path) -> None:
    import threading
    import time

    launcher = LocalLauncher(grace_s=0.5, env=_fake_workloads(tmp_path))
    spec = SweepSpec(slots=[2], params={**TINY, "workload": "fake"}, timeout_s=60.0, root=str(tmp_path), name="c")
    worker = threading.Thread(target=run_sweep, args=(spec,), kwargs={"launcher": launcher})
    worker.start()
    sweep = SweepDir(tmp_path / "c")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (sweep.exists() and launcher.status(sweep).get("slots2") == "running"):
        time.sleep(0.1)
    assert launcher.status(sweep) == {"slots2": "running"}
    assert launcher.cancel(sweep) == ["slots2"]
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert sweep.paths("slots2").read_metrics()["status"] == "cancelled"


def test_local_stale_job_json_with_reused_pid_is_not_running(tmp_path: Path) -> None:
    import os
    import socket

    from bufreuse.fsutil import atomic_write_json

    sweep = SweepDir(tmp_path / "s")
    sweep.write_manifest({"name": "s", "configs": ["slots2"]})
    paths = sweep.write_config("slots2", {"workload": "fake"})
    job = {"launcher": "local", "pid": os.getpid(), "host": socket.gethostname(), "pid_start": -1}
    atomic_write_json(paths.job, job)  # this pid is alive, but it is not the process that job.json named
    launcher = LocalLauncher()
    assert launcher.status(sweep) == {"slots2": "pending"}
    assert launcher.cancel(sweep) == []  # and nothing was signalled: this test process is still here


def test_local_prepare_refuses_unknown_workload_before_gpu_check(tmp_path: Path) -> None:
    spec = SweepSpec(slots=[0], params={"workload": "nope"}, root=str(tmp_path), name="w")  # device cuda
    with pytest.raises(InputError, match="workload 'nope' does not run locally"):
        run_sweep(spec, launcher=LocalLauncher())
    assert not (tmp_path / "w").exists()
    fake = LocalLauncher(env=_fake_workloads(tmp_path))  # names from the launcher's own env count
    ok = run_sweep(_spec(tmp_path, slots=[0], modes=[], params={**TINY, "workload": "fake"}), launcher=fake)
    assert ok.statuses == {"slots0": "ok"}
