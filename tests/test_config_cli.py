"""``bufreuse check-config`` end to end: checklist, ring memory, --json, exit codes 0 / 1 / 2."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from bufreuse.cli import app

DATA = Path(__file__).parent / "data" / "megatron"
runner = CliRunner()


def test_check_config_args_file_can_be_enabled() -> None:
    result = runner.invoke(app, ["check-config", str(DATA / "alltoall-ring.args")])
    assert result.exit_code == 0, result.output
    assert "can be enabled" in result.output and "128.0 MiB persistent" in result.output


def test_check_config_json_lists_rings_and_requirements() -> None:
    result = runner.invoke(app, ["check-config", "--json", str(DATA / "alltoall-ring.args")])
    data = json.loads(result.output)
    assert data["ok"] and data["path"] == "alltoall"
    # slots x rows x hidden x bytes: 2 x (EP 2 x 4096 tokens x min(topk 2, 4 local)) x 2048 x 2
    assert data["rings"]["dispatch"]["persistent_bytes"] == 2 * 16384 * 2048 * 2
    assert data["persistent_bytes_total"] == 2 * data["rings"]["dispatch"]["persistent_bytes"]
    assert {r["key"] for r in data["requirements"]} >= {"dispatcher", "unfused_permute", "expert_output_writer"}


def test_check_config_hybridep_needs_backend_apis_here() -> None:
    result = runner.invoke(app, ["check-config", "--json", str(DATA / "hybridep-ready.yaml")])
    assert result.exit_code == 1
    data = json.loads(result.output)
    unmet = {(r["key"], r["buffer"]) for r in data["requirements"] if not r["ok"]}
    assert unmet == {("deepep_output_token", "dispatch"), ("te_grouped_output", "expert")}
    # the seed's rank-capacity bound: int(4096 x 2 x 8 x 1.5) = 98304 rows (already a multiple of 256)
    assert data["rings"]["dispatch"]["rows"] == 98304 and data["rings"]["dispatch"]["slots"] == 4


def test_check_config_checklist_shows_each_failure_and_fix() -> None:
    result = runner.invoke(app, ["check-config", str(DATA / "hybridep-bf16-regular.yaml")], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    for fix in ("moe_expert_rank_capacity_factor", "overlap_moe_expert_parallel_comm", "fp8", "offload_modules"):
        assert fix in result.output
    assert "cannot be enabled (5 unmet)" in result.output


def test_check_config_nothing_enabled_and_assume_enabled(tmp_path: Path) -> None:
    p = tmp_path / "base.yaml"
    p.write_text("moe_token_dispatcher_type: alltoall\nhidden_size: 64\nnum_moe_experts: 8\nbf16: true\n")
    off = runner.invoke(app, ["check-config", "--json", str(p)])
    assert off.exit_code == 1 and "no buffer is enabled" in json.loads(off.output)["error"]
    on = runner.invoke(app, ["check-config", "--json", "--assume-enabled", "--seq-length", "128",
                             "--micro-batch-size", "1", str(p)])  # fmt: skip
    assert on.exit_code == 0, on.output
    assert json.loads(on.output)["rings"]["expert"]["slots"] == 4


def test_check_config_unreadable_input_exits_2(tmp_path: Path) -> None:
    assert runner.invoke(app, ["check-config", str(tmp_path / "missing.yaml")]).exit_code == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("moe_bufreuse_dispatch_policy: lifo\nmoe_hybridep_reuse_dispatch_output_buffers: true\n")
    result = runner.invoke(app, ["check-config", str(bad)])
    assert result.exit_code == 2 and "moe_bufreuse_dispatch_policy" in result.output
