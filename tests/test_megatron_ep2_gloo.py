"""The EP = 2 gloo family of examples/megatron-h200/run.sh: two ranks on one GPU, and a command line Megatron
parses (DRY_RUN prints it; megatron-core 0.19.2's own parser and validate_args read it here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _dry(tmp_path: Path, *runs: str) -> dict[str, str]:
    env = {**os.environ, "OUT": str(tmp_path), "DRY_RUN": "1"}
    res = subprocess.run(["bash", str(ROOT / "examples/megatron-h200/run.sh"), *runs], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return {line.split()[1]: line for line in res.stdout.splitlines() if line.startswith("== ")}


def test_ep2_gloo_runs_two_ranks_on_the_one_gpu(tmp_path: Path) -> None:
    cmds = _dry(tmp_path, "ep2-gloo-control", "ep2-gloo-rings", "ep2-gloo-kept-rings", "control")
    for name in ("ep2-gloo-control", "ep2-gloo-rings", "ep2-gloo-kept-rings"):
        c = cmds[name]
        assert "torchrun --nproc-per-node 2" in c and "--no-python env LOCAL_RANK=0 python3" in c
        assert c.endswith(c[c.index("--distributed-backend gloo") :])  # after COMMON's EP 1: the last one counts
        assert "--distributed-backend gloo --expert-model-parallel-size 2" in c
        assert "--use-distributed-optimizer" not in c and "--cuda-graph-impl" not in c
    assert "--moe-hybridep" not in cmds["ep2-gloo-control"]
    assert "--moe-hybridep-num-dispatch-output-buffers 1 --moe-hybridep-num-expert-output-buffers 1" in cmds[
        "ep2-gloo-rings"]  # fmt: skip
    assert cmds["ep2-gloo-kept-rings"].endswith("--moe-bufreuse-keep-unused-rings")
    assert "--nproc-per-node 1" in cmds["control"]  # positive control: the EP = 1 families keep one process


def _needs_megatron_training() -> None:
    import importlib.util

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron.training is not installed")  # (imported in the child, with 3.12's typing.override)


def _argv(line: str) -> list[str]:
    return line.split(" -m bufreuse.integrations.entry ", 1)[1].split()


# megatron's own parse_args + validate_args, then the TransformerConfig the run builds (its __post_init__ holds the
# overlap_moe_expert_parallel_comm asserts), then bufreuse's start-up validation and install()'s stream rule
_CHILD = (
    "import sys, typing, typing_extensions\n"
    "typing.override = getattr(typing, 'override', typing_extensions.override)  # 3.12's, on Python 3.11\n"
    "from megatron.training.arguments import parse_args, validate_args, core_transformer_config_from_args\n"
    "from bufreuse.config import BufReuseConfig, add_arguments, unused_rings\n"
    "from bufreuse.integrations.requirements import validate\n"
    "a = parse_args(extra_args_provider=add_arguments); validate_args(a)\n"
    "k = BufReuseConfig.from_args(a)\n"
    "print('OK', a.distributed_backend, a.expert_model_parallel_size, a.data_parallel_size,"
    " a.global_batch_size // (a.micro_batch_size * a.data_parallel_size), sorted(k.enabled()),"
    " k.moe_bufreuse_keep_unused_rings, a.use_distributed_optimizer)\n"
    "c = core_transformer_config_from_args(a)\n"
    "validate(c, k, seq_length=a.seq_length, micro_batch_size=a.micro_batch_size)\n"
    "print('CFG', c.overlap_moe_expert_parallel_comm, c.pipeline_model_parallel_size,"
    " c.num_moe_experts // c.expert_model_parallel_size, sorted(unused_rings(c, k, 'alltoall')))\n"
)


def _validate(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    return subprocess.run([sys.executable, "-c", _CHILD, *argv], env=env, capture_output=True, text=True, timeout=120)


def _line(res: subprocess.CompletedProcess[str], tag: str) -> str:
    assert res.returncode == 0, res.stderr[-2000:]
    return next(x for x in res.stdout.splitlines() if x.startswith(tag + " "))


def test_megatron_parses_and_validates_the_ep2_gloo_command_line(tmp_path: Path) -> None:
    _needs_megatron_training()
    res = _validate(_argv(_dry(tmp_path, "ep2-gloo-kept-rings")["ep2-gloo-kept-rings"]))
    # world 2 / EP 2 -> DP 2; global batch 8 / (micro 2 x DP 2) = 2 microbatches (what `bufreuse plan` planned for)
    assert _line(res, "OK") == "OK gloo 2 2 2 ['dispatch', 'expert'] True False"
    assert _line(res, "CFG") == "CFG False 1 4 []"  # kept: the validation knob keeps both rings


def test_ep2_gloo_overlap_runs_two_ranks_with_per_rank_snapshots(tmp_path: Path) -> None:
    cmds = _dry(tmp_path, "ep2-gloo-overlap-control", "ep2-gloo-overlap-rings@ov-r-1", "ep2-gloo-rings")
    for name in ("ep2-gloo-overlap-control", "ov-r-1"):
        c = cmds[name]
        launcher = c.split(" -m bufreuse.integrations.entry ", 1)[0]
        assert "torchrun --nproc-per-node 2" in launcher and "env LOCAL_RANK=0 CUDA_DEVICE_MAX_CONNECTIONS=32" in c
        # one snapshot folder per log name, under OUT
        assert launcher.endswith(f"python3 {ROOT}/scripts/rank_snapshots.py --out {tmp_path}/{name}-snapshots")
        assert c.endswith(c[c.index("--distributed-backend gloo") :])  # after COMMON's EP 1: the last one counts
        assert "--distributed-backend gloo --expert-model-parallel-size 2 --overlap-moe-expert-parallel-comm" in c
        assert "--num-layers 2 " in c and "--micro-batch-size 1 --global-batch-size 8 --num-experts 8" in c
        for absent in ("--record-memory-history", "--recompute", "--cuda-graph-impl", "--delay-wgrad-compute",
                       "--moe-shared-expert", "--use-distributed-optimizer", "--moe-grouped-gemm"):  # fmt: skip
            assert absent not in c, absent
        assert "--transformer-impl local" in c
    assert "--moe-hybridep" not in cmds["ep2-gloo-overlap-control"]
    rings = "--moe-hybridep-num-dispatch-output-buffers 1 --moe-hybridep-num-expert-output-buffers 1"
    assert cmds["ov-r-1"].endswith("--moe-hybridep-reuse-dispatch-output-buffers " + rings)
    # positive control: the EP 2 family without overlap keeps the plain launcher, one connection, no snapshots
    plain = cmds["ep2-gloo-rings"]
    assert "rank_snapshots" not in plain and "CUDA_DEVICE_MAX_CONNECTIONS" not in plain
    assert "--overlap-moe-expert-parallel-comm" not in plain


def test_megatron_accepts_ep2_gloo_overlap_and_install_uses_the_dispatch_ring(tmp_path: Path) -> None:
    _needs_megatron_training()
    cmds = _dry(tmp_path, "ep2-gloo-overlap-rings", "ep2-gloo-overlap-control", "ep2-gloo-rings")
    res = _validate(_argv(cmds["ep2-gloo-overlap-rings"]))
    # DP 2, global 8 / (micro 1 x DP 2) = 4 microbatches; PP 1 (combined 1F1B without VPP); 8 experts / EP 2 = 4
    # local experts: the mlp node frees the dispatch output across streams (ring used), the combine reads the
    # sort's copy of the FC2 output (ring unused)
    assert _line(res, "OK") == "OK gloo 2 2 4 ['dispatch', 'expert'] False False"
    assert _line(res, "CFG") == "CFG True 1 4 ['expert']"
    assert _line(_validate(_argv(cmds["ep2-gloo-overlap-control"])), "CFG") == "CFG True 1 4 []"
    # positive control: the same EP 2 without overlap, where nothing crosses streams: both rings unused
    assert _line(_validate(_argv(cmds["ep2-gloo-rings"])), "CFG") == "CFG False 1 4 ['dispatch', 'expert']"
    # and megatron's overlap asserts are live on this path: full recompute is refused (transformer_config.py)
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    bad = _validate([*_argv(cmds["ep2-gloo-overlap-rings"]), *recompute])
    assert bad.returncode != 0
    assert "disable full recomputation when enabling overlap_moe_expert_parallel_comm" in bad.stderr


def test_ep2_gloo_overlap_rings_are_at_the_planned_depth(tmp_path: Path) -> None:
    import json

    argv = _argv(_dry(tmp_path, "ep2-gloo-overlap-rings")["ep2-gloo-overlap-rings"])
    (tmp_path / "args.txt").write_text(" ".join(argv) + "\n")
    res = subprocess.run([sys.executable, "-m", "bufreuse", "plan", str(tmp_path / "args.txt"), "--data-parallel-size",
                          "2", "--json"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    plan = json.loads(res.stdout)
    assert plan["schedule"]["kind"] == "combined" and plan["schedule"]["microbatches"] == 4
    by = {b["buffer"]: b for b in plan["buffers"]}
    flags = {"dispatch": "dispatch-output", "expert": "expert-output"}
    for buf, name in flags.items():
        flag = f"--moe-hybridep-num-{name}-buffers"
        assert int(argv[argv.index(flag) + 1]) == by[buf]["minimum"], buf
    assert by["dispatch"]["unused"] is None and by["dispatch"]["control_pending_bytes"] > 0
    assert by["expert"]["unused"]  # the plan, like install(), leaves the FC2 ring unused with 4 local experts


def test_rank_snapshots_runs_the_module_as_python_m(tmp_path: Path) -> None:
    """On this CPU machine: the module runs with its own argv, from the working directory, and its exit code
    passes through (the CUDA dump itself runs on the device only)."""
    (tmp_path / "probe_mod.py").write_text("import sys\nprint('ARGV', sys.argv[1:])\nsys.exit(int(sys.argv[-1]))\n")
    script = ROOT / "scripts" / "rank_snapshots.py"
    env = {**os.environ, "RANK": "1", "CUDA_VISIBLE_DEVICES": ""}
    for code in ("0", "3"):
        cmd = [sys.executable, str(script), "--out", str(tmp_path / "s"), "-m", "probe_mod", "--x", "y", code]
        res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == int(code), res.stderr
        assert f"ARGV ['--x', 'y', '{code}']" in res.stdout
        assert "rank 1: no CUDA, no allocator history recorded" in res.stdout
    assert not (tmp_path / "s").exists()
    bad = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "usage" in bad.stderr
