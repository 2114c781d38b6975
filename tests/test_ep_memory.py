"""scripts/ep_memory.py: its summaries on hand-made inputs, and one real 2-process CPU run over gloo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from script_module import SCRIPTS, load_script

ep_memory = load_script("ep_memory")


def _report(file: str, reserved_mib: int, moe_mib: float, other_mib: float, peak_mib: float) -> str:
    mib = 2**20
    return json.dumps({
        "file": file, "max_reserved_bytes": reserved_mib * mib,
        "pending_free_at_max_active_bytes": int((moe_mib + other_mib) * mib),
        "pending_free_by_category_at_max_active": {"dispatch_output": int(moe_mib * mib), "expert_output": 0,
                                                   "other": int(other_mib * mib)},
        "max_pending_free_bytes": int(peak_mib * mib),
    })  # fmt: skip


def test_combine_sums_ranks_per_arm(tmp_path: Path, capsys) -> None:
    lines = [
        _report("/x/ep2/control/rank0.pickle", 200, 8.0, 1.0, 24.0),
        _report("/x/ep2/control/rank1.pickle", 216, 0.0, 0.0, 30.0),
        _report("/x/ep2/rings-kept/rank0.pickle", 500, 0.0, 0.0, 2.0),
    ]
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join(lines) + "\n")
    assert ep_memory.main(["--combine", str(f)]) == 0
    out = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:3]}
    # by hand: control 200 + 216 = 416 MiB together; MoE pending 8 + 0; all pending 9; the largest peak 30
    assert out["control"][1:] == ["2", "200/216", "416", "8.0", "9.0", "30.0"]
    assert out["rings-kept"][1:] == ["1", "500", "500", "0.0", "0.0", "2.0"]


def _rank(root: Path, arm: str, rank: int, digest: list[float]) -> None:
    d = root / arm
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{rank}.json").write_text(json.dumps({"arm": arm, "rank": rank, "step_s": [1.0, 0.01, 0.02],
                                                    "digest": digest}))  # fmt: skip


def test_summarize_fails_when_an_arm_differs_from_the_control(tmp_path: Path, capsys) -> None:
    for r in (0, 1):
        _rank(tmp_path, "control", r, [1.0, 2.0])
        _rank(tmp_path, "rings-kept", r, [1.0, 2.0])
    assert ep_memory.main(["--summarize", str(tmp_path)]) == 0
    _rank(tmp_path, "rings-kept", 1, [1.0, 2.0000001])  # positive control: one value off on one rank
    assert ep_memory.main(["--summarize", str(tmp_path)]) == 1
    assert "DIFFERS: rings-kept rank 1" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun is not installed")  # fmt: skip
def test_two_processes_over_gloo_on_cpu(tmp_path: Path) -> None:
    """The production arm leaves both rings unused at EP = 2 (nothing waits pending-free); the kept arm hooks
    both; its outputs and input gradients are bit-equal to the control's on every rank."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (bash scripts/ci/install-megatron.sh)")
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    shape = ["--hidden", "32", "--ffn", "64", "--tokens", "32", "--experts", "4", "--dtype", "fp32", "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for arm in (["control"], ["rings"], ["rings", "--keep-unused"]):
        cmd = [torchrun, "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "ep_memory.py"), "--out",
               str(tmp_path), "--arm", *arm, *shape]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    read = {(p.parent.name, p.name): json.loads(p.read_text()) for p in tmp_path.glob("*/rank*.json")}
    assert {k[0] for k in read} == {"control", "rings", "rings-kept"}
    for r in (0, 1):
        rings, kept, control = (read[(a, f"rank{r}.json")] for a in ("rings", "rings-kept", "control"))
        assert rings["rings"] == [] and set(rings["unused"]) == {"dispatch_output", "expert_fc2_output"}
        assert kept["rings"] == ["dispatch_output", "expert_fc2_output"] and kept["unused"] == {}
        assert kept["ring_stats"]["dispatch_output"]["acquisitions"] == 8  # 4 forwards x 2 steps, every one ringed
        assert kept["digest"] == control["digest"] == rings["digest"] and len(control["digest"]) == 8
        assert kept["bounds"]["dispatch"]["source"].startswith("dropless worst case: EP 2 x 32 tokens")
    assert ep_memory.main(["--summarize", str(tmp_path)]) == 0
