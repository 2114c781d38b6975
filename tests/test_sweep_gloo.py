"""``bufreuse sweep --world-size 2 --dist-backend gloo``: the proxy's dispatch and combine become real all-to-alls
between processes (on CPU here; on the one H200 every rank shares GPU 0), and the SLURM script says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bufreuse.errors import InputError
from bufreuse.launch.local import LocalLauncher
from bufreuse.launch.sweep import SweepSpec, build_configs, config_problem, default_name, run_sweep
from bufreuse.sweepdir import SweepDir

TINY = {"hidden": 32, "ffn": 16, "tokens": 64, "local_experts": 4, "microbatches": 4, "comm_ms": 0.0,
        "device": "cpu", "steps": 2, "warmup_steps": 1, "record_steps": 0}  # fmt: skip


def test_two_processes_over_gloo_on_cpu_agree_on_every_checksum(tmp_path: Path) -> None:
    spec = SweepSpec(slots=[0, 2], modes=["stream-ordered"], params={**TINY, "dist_backend": "gloo"}, name="g",
                     world_size=2, root=str(tmp_path), timeout_s=120)  # fmt: skip
    res = run_sweep(spec, launcher=LocalLauncher(grace_s=1.0))
    assert res.statuses == dict.fromkeys(res.config_ids, "ok"), res.statuses
    sweep = SweepDir(res.folder)
    checks = set()
    for cid in res.config_ids:
        paths = sweep.paths(cid)
        assert json.loads(paths.config.read_text())["dist_backend"] == "gloo"
        ranks = sorted(paths.folder.glob("metrics.rank*.json"))
        assert [p.name for p in ranks] == ["metrics.rank0.json", "metrics.rank1.json"]  # two real processes
        per_rank = [json.loads(p.read_text()) for p in ranks]
        assert per_rank[0]["env"]["world_size"] == 2
        checks.add(tuple(m["checksum"] for m in per_rank))
    assert len(checks) == 1  # control, rings and stream-ordered compute the same thing on each rank


def test_gloo_is_asked_for_and_only_then_stored() -> None:
    plain = build_configs(SweepSpec(params=dict(TINY)), world_size=2)
    assert all("dist_backend" not in c for c in plain.values())  # older sweeps keep their configs and names
    gloo = build_configs(SweepSpec(params={**TINY, "dist_backend": "gloo"}), world_size=2)
    assert all(c["dist_backend"] == "gloo" for c in gloo.values())
    gloo_spec = SweepSpec(params={**TINY, "dist_backend": "gloo"})
    assert default_name(SweepSpec(params=dict(TINY)), 2) != default_name(gloo_spec, 2)
    with pytest.raises(InputError, match="dist-backend mpi"):
        SweepSpec(params={**TINY, "dist_backend": "mpi"}).validate()
    # a CPU run at world size 2 needs gloo (NCCL has no CPU tensors); the positive control is the gloo config
    assert "gloo" in config_problem(next(iter(plain.values())))
    assert config_problem(next(iter(gloo.values()))) is None


def test_local_launcher_lets_gloo_ranks_share_a_gpu(tmp_path: Path, monkeypatch) -> None:
    from bufreuse.launch import local

    monkeypatch.setattr(local, "visible_gpus", lambda: 1)
    for backend, ok in (("gloo", True), (None, False)):
        params = {**TINY, "device": "cuda", **({"dist_backend": backend} if backend else {})}
        spec = SweepSpec(slots=[0], params=params, name=f"s{backend}", world_size=2, root=str(tmp_path))
        sweep = SweepDir(tmp_path / f"s{backend}")
        sweep.write_manifest({"name": f"s{backend}", "launcher": "local", "configs": ["slots0"], "params": {}})
        sweep.write_config("slots0", build_configs(spec, world_size=2)["slots0"])
        launcher = LocalLauncher()
        if ok:
            launcher.prepare(sweep, ["slots0"])
        else:
            with pytest.raises(InputError, match="only 1 GPU"):
                launcher.prepare(sweep, ["slots0"])


def test_slurm_script_names_the_gloo_process_group(tmp_path: Path) -> None:
    import subprocess

    from bufreuse.launch.site import SlurmSite
    from bufreuse.launch.slurm import SlurmLauncher

    sweep = SweepDir(tmp_path / "s")
    sweep.write_manifest({"name": "s", "launcher": "slurm", "configs": ["slots0", "slots2"], "params": {}})
    base = {"workload": "proxy", "mode": "control", "slots": 0, "world_size": 1}
    sweep.write_config("slots0", base)
    sweep.write_config("slots2", {**base, "mode": "ring", "slots": 2, "dist_backend": "gloo"})
    launcher = SlurmLauncher(site=SlurmSite(partition="gpu", time="00:10:00"), dry_run=True, commands=_no_slurm())
    gloo, plain = launcher.render(sweep, "slots2"), launcher.render(sweep, "slots0")
    assert "# process group: gloo" in gloo and "process group" not in plain  # positive and negative
    path = tmp_path / "job.sbatch"
    path.write_text(gloo)
    subprocess.run(["bash", "-n", str(path)], check=True)


def _no_slurm():
    from test_slurm import no_slurm_commands

    return no_slurm_commands()
