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


def test_megatron_parses_and_validates_the_ep2_gloo_command_line(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron.training is not installed")  # (imported in the child, with 3.12's typing.override)
    line = _dry(tmp_path, "ep2-gloo-kept-rings")["ep2-gloo-kept-rings"]
    argv = line.split(" -m bufreuse.integrations.entry ", 1)[1].split()
    code = (
        "import sys, typing, typing_extensions\n"
        "typing.override = getattr(typing, 'override', typing_extensions.override)  # 3.12's, on Python 3.11\n"
        "from megatron.training.arguments import parse_args, validate_args\n"
        "from bufreuse.config import BufReuseConfig, add_arguments\n"
        "a = parse_args(extra_args_provider=add_arguments); validate_args(a)\n"
        "k = BufReuseConfig.from_args(a)\n"
        "print('OK', a.distributed_backend, a.expert_model_parallel_size, a.data_parallel_size,"
        " a.global_batch_size // (a.micro_batch_size * a.data_parallel_size), sorted(k.enabled()),"
        " k.moe_bufreuse_keep_unused_rings, a.use_distributed_optimizer)\n"
    )
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    res = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    ok = next(x for x in res.stdout.splitlines() if x.startswith("OK "))
    # world 2 / EP 2 -> DP 2; global batch 8 / (micro 2 x DP 2) = 2 microbatches (what `bufreuse plan` planned for)
    assert ok == "OK gloo 2 2 2 ['dispatch', 'expert'] True False"
