"""The ``bufreuse-megatron`` entry: argument handling, validation before training, checkout lookup.

A stand-in Megatron-LM checkout (``tests/data/megatron/fake-megatron-lm``) keeps upstream's
``pretrain(..., extra_args_provider=...)`` contract and builds one real megatron-core MoELayer on
CPU, so these tests run the real wrapper in a subprocess, end to end, without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).parents[1]
FAKE = ROOT / "tests" / "data" / "megatron" / "fake-megatron-lm"
RING = [
    "--moe-hybridep-reuse-dispatch-output-buffers",
    "--moe-hybridep-num-dispatch-output-buffers", "2",
    "--moe-hybridep-num-expert-output-buffers", "2",
]  # fmt: skip


def _run(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_PATH"}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", **(env_extra or {})})
    cmd = [sys.executable, "-m", "bufreuse.integrations.entry", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def _seen(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if ln.startswith("FAKE-PRETRAIN "))
    return json.loads(line.removeprefix("FAKE-PRETRAIN "))


BASE = ["--megatron-lm", str(FAKE), "--seq-length", "64", "--micro-batch-size", "2"]
EXERCISE = ["--moe-bufreuse-ring-single-rank-expert"]  # EP = 1: ring the FC2 output anyway (production: unused)


def _hooked_line(res: subprocess.CompletedProcess[str]) -> str:
    """The entry's ``bufreuse-megatron: hooked ...`` line of a run that exited 0."""
    assert res.returncode == 0, res.stderr
    return next(ln for ln in res.stdout.splitlines() if ln.startswith("bufreuse-megatron: hooked"))


def test_entry_registers_knobs_validates_and_installs() -> None:
    res = _run([*BASE, "--script-flag", "x", *RING, "--moe-bufreuse-expert-policy", "stream-ordered", *EXERCISE])
    assert _hooked_line(res).startswith("bufreuse-megatron: hooked 1 MoE layer(s)")  # the stream-ordered buffer
    seen = _seen(res.stdout)
    assert seen["hooked"] and seen["script_arg"] == "x"  # the script's own extra args still work
    assert seen["knobs"]["moe_hybridep_num_expert_output_buffers"] == 2
    assert seen["knobs"]["moe_bufreuse_expert_policy"] == "stream-ordered"


@pytest.mark.parametrize(("batch", "start"), [([], "expert_fc2_output=2 (no plan)"), (
    ["--global-batch-size", "16"], "expert_fc2_output=1 (planned for 8 microbatch(es), PP rank 0)")])  # fmt: skip
def test_entry_auto_ring_starts_at_the_plan_when_the_schedule_is_known(batch: list[str], start: str) -> None:
    auto = ["--moe-hybridep-num-expert-output-buffers", "auto", "--moe-bufreuse-auto-max-mib", "64"]
    res = _run([*BASE, *batch, *auto, *EXERCISE])
    line = _hooked_line(res)
    assert f"num_slots='auto' starts at {start}, cap 64 MiB" in line, line
    assert _seen(res.stdout)["hooked"]


def test_entry_says_the_ep1_rings_are_not_used() -> None:
    line = _hooked_line(_run([*BASE, *RING]))
    assert line.startswith("bufreuse-megatron: hooked 0 MoE layer(s); persistent bytes none; not used: "), line
    assert "dispatch_output (EP = 1:" in line and "expert_fc2_output (EP x ETP = 1:" in line, line
    # positive control: the validation knob rings the FC2 output, and the line lists its bytes
    line = _hooked_line(_run([*BASE, *RING, *EXERCISE]))
    assert "dispatch_output=" not in line.split("; not used")[0] and "expert_fc2_output=" in line, line
    assert "not used: dispatch_output (EP = 1:" in line and "expert_fc2_output (" not in line, line


def test_entry_checkout_from_environment_and_knobs_off() -> None:
    res = _run(["--seq-length", "64", "--micro-batch-size", "2"], {"MEGATRON_LM_PATH": str(FAKE)})
    assert res.returncode == 0, res.stderr
    assert _seen(res.stdout)["hooked"] is False


def test_entry_refuses_config_before_training() -> None:
    res = _run(["--megatron-lm", str(FAKE), "--moe-token-dispatcher-type", "allgather", *RING])
    assert res.returncode == 2
    assert "FAKE-PRETRAIN" not in res.stdout
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith("bufreuse-megatron: error:") and "moe_token_dispatcher_type" in err
    assert "[dispatch/ring]" in err and "[expert/ring]" in err  # every unmet requirement in the one message


def test_entry_without_checkout_says_how_to_point_at_it(tmp_path: Path) -> None:
    res = _run(["--seq-length", "64"])
    assert res.returncode == 2 and "--megatron-lm PATH or set MEGATRON_LM_PATH" in res.stderr
    res = _run(["--megatron-lm", str(tmp_path)])
    assert res.returncode == 2 and "pretrain_gpt.py not found" in res.stderr


def test_entry_rejects_unknown_arguments_like_upstream() -> None:
    res = _run(["--megatron-lm", str(FAKE), "--no-such-flag"])
    assert res.returncode == 2 and "unrecognized arguments: --no-such-flag" in res.stderr


def _vpp(slots: int) -> subprocess.CompletedProcess[str]:
    """PP 2 x VPP 2, 4 layers (one MoE layer per chunk), 4 microbatches, rank 0; one local expert, so the
    bf16 expert GEMM saves the dispatch slot (released after backward)."""
    return _run(["--megatron-lm", str(FAKE), "--seq-length", "64", "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--num-layers", "4", "--num-experts", "1",
                 "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                 "--moe-hybridep-reuse-dispatch-output-buffers", "--moe-hybridep-num-dispatch-output-buffers",
                 str(slots), "--moe-hybridep-num-expert-output-buffers", "0",
                 "--moe-bufreuse-ring-identity-dispatch"])  # fmt: skip


def test_entry_vpp_chunks_share_one_ring_sized_by_the_plan() -> None:
    # At EP = 1 the dispatch ring is exercised through the validation knob (_vpp passes it): production
    # leaves an identity dispatch alone (test_entry_says_the_ep1_rings_are_not_used).
    # Rank 0 of p = 2, v = 2 (g = p): megatron's warm-up is 2 (p - 1) + (v - 1) g = 4 forwards, the steady
    # phase runs one more before the first backward, and every one holds its chunk's single MoE layer's slot
    # in the one ring both chunks share: 5. A pool per chunk would have needed min(m, 2g, w + 1) = 4 per ring.
    need = 1 * min(4 * 2, (2 * (2 - 1) + (2 - 1) * 2) + 1)
    ok = _vpp(need)
    assert ok.returncode == 0, ok.stderr
    seen = _seen(ok.stdout)
    assert seen["chunks"] == 2 and seen["hooked_layers"] == 2
    hooked = [ln for ln in ok.stdout.splitlines() if ln.startswith("bufreuse-megatron: hooked")]
    assert len(hooked) == 2  # one install per chunk (upstream calls model_provider per vp_stage) ...
    rings = {ln.split("persistent bytes ", 1)[1] for ln in hooked}
    assert len(rings) == 1 and rings.pop().count("=") == 1  # ... into one pool: one dispatch ring, same bytes
    short = _vpp(need - 1)
    assert short.returncode == 2 and "FAKE-PRETRAIN" not in short.stdout
    err = short.stderr.strip().splitlines()[-1]
    assert f"moe_hybridep_num_dispatch_output_buffers={need - 1} is below the planner's minimum {need}" in err
    assert "schedule interleaved, PP rank 0 of 2, VPP 2, 4 microbatch(es)" in err and "dispatch.fwd(mb" in err
