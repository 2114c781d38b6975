"""The ``bufreuse-megatron`` entry's pre-flight (``bufreuse.integrations.preflight``) and its gloo grad-sync switch.

HybridEP set-ups that would segfault or hang in DeepEP end in one line and exit 2 before Megatron starts; these
checks read only the command line and the environment, so they run on CPU without DeepEP. End-to-end runs go
through the stand-in Megatron-LM checkout of ``tests/test_integrations_entry.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bufreuse.errors import ConfigError, exit_code_for
from bufreuse.integrations.preflight import (
    SKIP_PRELOAD_ENV,
    flag_value,
    hybridep_preflight,
    libstdcxx_path,
    visible_gpus,
)

ROOT = Path(__file__).parents[1]
FAKE = ROOT / "tests" / "data" / "megatron" / "fake-megatron-lm"
HYBRIDEP = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]
EP2 = [*HYBRIDEP, "--expert-model-parallel-size", "2", "--num-experts", "8"]
DOMAIN = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"
PRELOAD = {"LD_PRELOAD": "/opt/x/libfoo.so:/usr/lib/x86_64-linux-gnu/libstdc++.so.6"}


def _refusal(argv: list[str], env: dict[str, str], gpus: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        hybridep_preflight(argv, env, gpus=gpus)
    assert exit_code_for(e.value) == 2
    return str(e.value)


# -- (a) the libstdc++ preload ----------------------------------------------------------------------------------


def test_no_preload_is_refused_naming_the_fix() -> None:
    msg = _refusal(EP2, {})
    assert f"LD_PRELOAD={libstdcxx_path()}" in msg and "segfaults in get_comm_id" in msg and SKIP_PRELOAD_ENV in msg
    assert "\n" not in msg
    assert "libstdc++" in _refusal(EP2, {"LD_PRELOAD": "/opt/x/libfoo.so"})  # another preload is not the fix


def test_preload_present_or_skipped_passes() -> None:
    assert hybridep_preflight(EP2, dict(PRELOAD), gpus=1) == []  # positive control: the fix, listed among others
    (note,) = hybridep_preflight(EP2, {SKIP_PRELOAD_ENV: "1"}, gpus=1)
    assert "skipped" in note and SKIP_PRELOAD_ENV in note


def test_other_dispatchers_are_not_checked() -> None:
    env: dict[str, str] = {"LOCAL_WORLD_SIZE": "2"}
    for argv in (["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"],
                 ["--moe-token-dispatcher-type", "alltoall", "--num-experts", "6", "--expert-model-parallel-size", "2"],
                 [*HYBRIDEP, "--moe-token-dispatcher-type", "alltoall"]):  # fmt: skip  # the last flag counts
        assert hybridep_preflight(argv, env, gpus=1) == [] and env == {"LOCAL_WORLD_SIZE": "2"}


# -- (b) several processes on one GPU ---------------------------------------------------------------------------


def test_processes_sharing_a_gpu_get_use_mnnvl_0() -> None:
    env = {**PRELOAD, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "1"}
    (note,) = hybridep_preflight(EP2, env, gpus=1)
    assert env["USE_MNNVL"] == "0" and "2 local processes on 1 visible GPU(s): set USE_MNNVL=0" in note
    env = {**PRELOAD, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1"}
    assert hybridep_preflight(EP2, env, gpus=2) == [] and "USE_MNNVL" not in env  # one GPU each: left alone
    env = {**PRELOAD, "LOCAL_WORLD_SIZE": "2", "USE_MNNVL": "False"}
    assert hybridep_preflight(EP2, env, gpus=1) == [] and env["USE_MNNVL"] == "False"  # already off


def test_fabric_memory_asked_on_a_shared_gpu_is_refused() -> None:
    msg = _refusal(EP2, {**PRELOAD, "LOCAL_WORLD_SIZE": "2", "USE_MNNVL": "1"})
    assert "USE_MNNVL=1" in msg and "start every rank with USE_MNNVL=0" in msg


def test_a_rank_pinned_to_device_0_is_refused_when_rank_0_cannot_tell() -> None:
    pinned = {**PRELOAD, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "1"}
    msg = _refusal(EP2, dict(pinned), gpus=8)
    assert "rank 1 runs on device 0" in msg and "USE_MNNVL=0 on every rank" in msg
    assert hybridep_preflight(EP2, {**pinned, "USE_MNNVL": "0"}, gpus=8) == []  # positive control: set for all


@pytest.mark.parametrize(("vis", "n"), [("0", 1), ("0,1", 2), ("", 0), ("GPU-a,GPU-b,GPU-c", 3), ("-1", 0)])
def test_visible_gpus_reads_cuda_visible_devices(vis: str, n: int) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": vis}) == n


# -- (c) the local expert count ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "local"),
    [
        (["--num-experts", "6", "--expert-model-parallel-size", "2"], {}, 3),
        (["--num-experts=10", "--expert-model-parallel-size=2"], {}, 5),
        (["--num-experts", "4", "--expert-model-parallel-size", "4"], {DOMAIN: "2"}, 1),
    ],
)  # fmt: skip
def test_odd_local_experts_are_refused(args: list[str], env: dict[str, str], local: int) -> None:
    msg = _refusal([*HYBRIDEP, *args], {**PRELOAD, **env})
    assert f"gives {local} local expert(s)" in msg and "multiple of 4" in msg


@pytest.mark.parametrize("args", [["--num-experts", "8", "--expert-model-parallel-size", "2"],
                                  ["--num-experts", "4", "--expert-model-parallel-size", "4"],
                                  ["--num-experts", "6", "--expert-model-parallel-size", "4"]])  # fmt: skip
def test_even_local_experts_pass(args: list[str]) -> None:
    """Positive control: 4 local at EP 2; 1 local at EP 4 (one domain of 4); 6 / 4 is Megatron's own refusal."""
    assert hybridep_preflight([*HYBRIDEP, *args], dict(PRELOAD), gpus=1) == []


def test_flag_value_takes_the_last_occurrence() -> None:
    argv = ["--distributed-backend", "nccl", "--x", "--distributed-backend=gloo"]
    assert flag_value(argv, "--distributed-backend") == "gloo" and flag_value(argv, "--y") is None
    assert flag_value(["--distributed-backend"], "--distributed-backend") is None


# -- end to end, through the entry --------------------------------------------------------------------------------


def _run(args: list[str], env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    drop = {"MEGATRON_LM_PATH", "LD_PRELOAD", "USE_MNNVL", SKIP_PRELOAD_ENV, DOMAIN, "LOCAL_WORLD_SIZE", "LOCAL_RANK"}
    drop |= {"RANK", "CUDA_VISIBLE_DEVICES"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", **env_extra})
    cmd = [sys.executable, "-m", "bufreuse.integrations.entry", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def _one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "FAKE-PRETRAIN" not in res.stdout
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("bufreuse-megatron: error: HybridEP: ")
    return line


def test_entry_stops_a_hybridep_run_without_the_preload() -> None:
    line = _one_error_line(_run(["--megatron-lm", str(FAKE), *EP2], {}))
    assert f"LD_PRELOAD={libstdcxx_path()}" in line


def test_entry_stops_an_odd_expert_count() -> None:
    argv = [*HYBRIDEP, "--expert-model-parallel-size", "2", "--num-experts", "6"]
    assert "gives 3 local expert(s)" in _one_error_line(_run(["--megatron-lm", str(FAKE), *argv], {}))


def test_entry_stops_a_pinned_rank() -> None:
    env = {SKIP_PRELOAD_ENV: "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "1"}
    env["CUDA_VISIBLE_DEVICES"] = "0,1"  # a GPU each by count: only this rank's LOCAL_RANK says otherwise
    assert "rank 1 runs on device 0" in _one_error_line(_run(["--megatron-lm", str(FAKE), *EP2], env))


def test_entry_sets_use_mnnvl_on_a_shared_gpu_before_anything_else() -> None:
    """No checkout given: the pre-flight passes (its lines printed), then the checkout lookup is what stops the run."""
    env = {SKIP_PRELOAD_ENV: "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0", "CUDA_VISIBLE_DEVICES": "0"}
    res = _run(EP2, env)
    assert res.returncode == 2 and "--megatron-lm PATH or set MEGATRON_LM_PATH" in res.stderr
    assert "bufreuse-megatron: HybridEP: 2 local processes on 1 visible GPU(s): set USE_MNNVL=0" in res.stdout
    assert f"bufreuse-megatron: HybridEP: libstdc++ preload check skipped ({SKIP_PRELOAD_ENV}=1)" in res.stdout


def _seen_grad_sync(res: subprocess.CompletedProcess[str]) -> bool:
    import json

    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("FAKE-PRETRAIN "))
    return json.loads(line.removeprefix("FAKE-PRETRAIN "))["gloo_grad_sync"]


def test_entry_patches_megatron_grad_sync_under_gloo_only() -> None:
    pytest.importorskip("megatron.core")
    base = ["--megatron-lm", str(FAKE), "--seq-length", "64", "--micro-batch-size", "2"]
    res = _run([*base, "--distributed-backend", "gloo"], {})
    assert _seen_grad_sync(res)
    (line,) = [ln for ln in res.stdout.splitlines() if "--distributed-backend gloo" in ln]
    assert "each bucket's collective on its own" in line and "not NCCL's" in line
    res = _run([*base, "--distributed-backend", "nccl"], {})  # positive control: megatron's manager left alone
    assert not _seen_grad_sync(res) and "--distributed-backend gloo" not in res.stdout
