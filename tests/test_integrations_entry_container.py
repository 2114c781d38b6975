"""``bufreuse-megatron`` with Megatron-LM's config-container contract (core_r0.19.0 and later).

A stand-in checkout (``tests/data/megatron/fake-megatron-lm-container``) keeps upstream's shape:
``pretrain_gpt.py`` parses with ``parse_and_validate_args(extra_args_provider=...)`` first, then calls
``pretrain(cfg_container, ...)``, which builds the model through ``setup_model_and_optimizer`` and
runs megatron-core's ``compile_helpers`` as Megatron-LM's initialisation does. The real
``pretrain_gpt.py`` was run this way on the H200 (examples/megatron-h200/README.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).parents[1]
FAKE = ROOT / "tests" / "data" / "megatron" / "fake-megatron-lm-container"
RING = [
    "--moe-hybridep-reuse-dispatch-output-buffers",
    "--moe-hybridep-num-dispatch-output-buffers", "2",
    "--moe-hybridep-num-expert-output-buffers", "2",
]  # fmt: skip


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_PATH"}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    cmd = [sys.executable, "-m", "bufreuse.integrations.entry", "--megatron-lm", str(FAKE), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def _seen(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if ln.startswith("FAKE-PRETRAIN "))
    return json.loads(line.removeprefix("FAKE-PRETRAIN "))


def test_container_contract_registers_knobs_and_hooks_setup_model() -> None:
    # EP = 1: the expert ring is exercised with the validation knob (production would use no ring there)
    res = _run(["--seq-length", "64", "--micro-batch-size", "2", "--script-flag", "x", *RING,
                "--moe-bufreuse-ring-single-rank-expert"])  # fmt: skip
    assert res.returncode == 0, res.stderr
    seen = _seen(res.stdout)
    assert seen["hooked"] and seen["script_arg"] == "x" and seen["container"] == {"model": "tiny-moe"}
    assert seen["knobs"]["moe_hybridep_num_dispatch_output_buffers"] == 2
    assert "bufreuse-megatron: hooked 1 MoE layer(s); persistent bytes expert_fc2_output=" in res.stdout


def test_container_contract_refuses_config_before_training() -> None:
    res = _run(["--seq-length", "64", "--micro-batch-size", "2", "--moe-token-dispatcher-type", "allgather", *RING])
    assert res.returncode == 2 and "FAKE-PRETRAIN" not in res.stdout
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith("bufreuse-megatron: error:") and "moe_token_dispatcher_type" in err


def test_container_contract_skips_helper_build_only_for_a_prebuilt_wheel() -> None:
    import megatron.core.datasets.utils as du

    prebuilt = importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
    wheel_like = prebuilt and not (Path(du.__file__).parent / "Makefile").is_file()
    res = _run(["--seq-length", "64", "--micro-batch-size", "2"])  # knobs off: nothing hooked
    assert res.returncode == 0, res.stderr
    assert _seen(res.stdout)["hooked"] is False
    assert ("skipping Megatron-LM's make step" in res.stdout) is wheel_like
