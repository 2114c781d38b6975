"""``bufreuse check-config`` end to end: checklist, ring memory, --json, exit codes 0 / 1 / 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bufreuse.cli import app

DATA = Path(__file__).parent / "data" / "megatron"
runner = CliRunner()


def test_check_config_args_file_can_be_enabled() -> None:
    result = runner.invoke(app, ["check-config", str(DATA / "alltoall-ring-overlap.args")])
    assert result.exit_code == 0, result.output
    assert "can be enabled" in result.output and "128.0 MiB persistent" in result.output


def test_check_config_says_rings_replace_nothing_at_ep2_without_overlap() -> None:
    # The same layer without EP overlap: both all-to-alls run in order with the compute stream (torch >= 2.8),
    # nothing waits pending-free, so neither ring is used and no memory is reserved for them.
    result = runner.invoke(app, ["check-config", "--json", str(DATA / "alltoall-ring.args")])
    data = json.loads(result.output)
    assert data["ok"] and data["persistent_bytes_total"] == 0
    assert data["rings"]["dispatch"]["rows"] == 2 * 4096 * 2  # the bound is still reported
    assert all("nothing waits pending-free" in r["bound_source"] for r in data["rings"].values())


def test_check_config_json_lists_rings_and_requirements() -> None:
    result = runner.invoke(app, ["check-config", "--json", str(DATA / "alltoall-ring-overlap.args")])
    data = json.loads(result.output)
    assert data["ok"] and data["path"] == "alltoall"
    # slots x rows x hidden x bytes: 2 x (EP 2 x 4096 tokens x min(topk 2, 4 local)) x 2048 x 2
    assert data["rings"]["dispatch"]["persistent_bytes"] == 2 * 16384 * 2048 * 2
    # four local experts: the combine reads the sorted copy, the FC2 ring replaces nothing
    assert data["rings"]["expert"]["persistent_bytes"] == 0
    assert data["persistent_bytes_total"] == data["rings"]["dispatch"]["persistent_bytes"]
    assert {r["key"] for r in data["requirements"]} >= {"dispatcher", "unfused_permute"}
    assert "expert_output_writer" not in {r["key"] for r in data["requirements"]}  # an unused ring requires nothing


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
    p.write_text(
        "moe_token_dispatcher_type: alltoall\nhidden_size: 64\nnum_moe_experts: 8\nbf16: true\n"
        "expert_model_parallel_size: 8\noverlap_moe_expert_parallel_comm: true\n"
    )  # fmt: skip  (at EP x ETP = 1, or without EP overlap, no ring would be used)
    off = runner.invoke(app, ["check-config", "--json", str(p)])
    assert off.exit_code == 1 and "no buffer is enabled" in json.loads(off.output)["error"]
    on = runner.invoke(app, ["check-config", "--json", "--assume-enabled", "--seq-length", "128",
                             "--micro-batch-size", "1", str(p)])  # fmt: skip
    assert on.exit_code == 0, on.output
    assert json.loads(on.output)["rings"]["expert"]["slots"] == 4


def test_check_config_requires_nothing_of_rings_that_would_be_unused(tmp_path: Path) -> None:
    # moe_permute_fusion is unmet for the all-to-all rings; at EP x ETP = 1 install() uses neither ring, so
    # check-config (like install() and plan) asks nothing of them: met, both listed with 0 slots
    p = tmp_path / "fused.yaml"
    base = ("moe_token_dispatcher_type: alltoall\nhidden_size: 64\nnum_moe_experts: 8\nbf16: true\n"
            "moe_permute_fusion: true\nmoe_hybridep_reuse_dispatch_output_buffers: true\n"
            "moe_hybridep_num_expert_output_buffers: 2\n")  # fmt: skip
    args = ["check-config", "--json", "--seq-length", "128", "--micro-batch-size", "1", str(p)]
    p.write_text(base + "expert_model_parallel_size: 1\n")
    unused = runner.invoke(app, args)
    assert unused.exit_code == 0, unused.output
    data = json.loads(unused.output)
    assert {b: r["slots"] for b, r in data["rings"].items()} == {"dispatch": 0, "expert": 0}
    assert all(r["ok"] for r in data["requirements"]) and data["requirements"]  # the dispatcher row stays
    # at EP = 2 without EP overlap nothing waits pending-free either: still nothing asked
    p.write_text(base + "expert_model_parallel_size: 2\n")
    assert runner.invoke(app, args).exit_code == 0
    # positive control: EP 8 (one local expert) under EP overlap uses both rings, and the field is unmet for them
    p.write_text(base + "expert_model_parallel_size: 8\noverlap_moe_expert_parallel_comm: true\n")
    used = runner.invoke(app, args)
    assert used.exit_code == 1, used.output
    unmet = [r for r in json.loads(used.output)["requirements"] if not r["ok"]]
    assert unmet and all("permute" in (r["text"] + r["fix"]).lower() for r in unmet), unmet


def test_check_config_unreadable_input_exits_2(tmp_path: Path) -> None:
    assert runner.invoke(app, ["check-config", str(tmp_path / "missing.yaml")]).exit_code == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("moe_bufreuse_dispatch_policy: lifo\nmoe_hybridep_reuse_dispatch_output_buffers: true\n")
    result = runner.invoke(app, ["check-config", str(bad)])
    assert result.exit_code == 2 and "moe_bufreuse_dispatch_policy" in result.output


HOSTILE_FIELDS = [
    ("offload_modules: 3", "offload_modules is an int, expected a list of module names"),  # scalar for a list
    ("recompute_modules: 5", "recompute_modules is an int, expected a list of module names"),
    ("offload_modules: [fused_group_mlp, 7]", "offload_modules holds an int, expected module names"),
    ("recompute_modules: 1.5", "recompute_modules is a float, expected a list of module names"),
    ("num_layers: [1, 2]", "num_layers is a list, expected an integer"),  # list for a scalar
    ("pipeline_model_parallel_size: '[/]'", "pipeline_model_parallel_size is a str, expected an integer"),
    ("moe_router_topk: [{a: 1}]", "moe_router_topk is a list, expected an integer"),
    ("hidden_size: .inf", "hidden_size is a float, expected an integer"),
    ("moe_expert_rank_capacity_factor: .nan", "moe_expert_rank_capacity_factor is out of range"),
]


def _hostile_config(tmp_path: Path, line: str) -> Path:
    base = (DATA / "hybridep-ready.yaml").read_text()
    key = line.split(":")[0]
    kept = [ln for ln in base.splitlines() if not ln.strip().startswith(f"{key}:")]
    p = tmp_path / "hostile.yaml"
    p.write_text("\n".join([*kept, "fine_grained_activation_offloading: true", line]) + "\n")
    return p


@pytest.mark.parametrize(("line", "message"), HOSTILE_FIELDS)
def test_check_config_and_plan_refuse_a_field_of_the_wrong_type_in_one_line(
    tmp_path: Path, line: str, message: str
) -> None:
    """The fuzz run's uncaught cases (``argument of type 'int' is not iterable``) and their kin."""
    p = _hostile_config(tmp_path, line)
    for args in (["check-config", str(p)], ["plan", str(p)]):
        res = runner.invoke(app, args)
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1, (args, res.output)
        assert lines[0].startswith(f"error: {p}: ") and message in lines[0], lines[0]


def test_field_types_are_checked_for_library_mappings_too() -> None:
    """A YAML mapping value is a section (flattened); a caller's own mapping can hold a dict anywhere."""
    from bufreuse.config import check_field_types
    from bufreuse.errors import ConfigError

    with pytest.raises(ConfigError, match="cfg: moe_router_topk is a dict, expected an integer"):
        check_field_types({"moe_router_topk": {"a": 1}}, "cfg")
    with pytest.raises(ConfigError, match="cfg: offload_modules is a dict, expected a list"):
        check_field_types({"offload_modules": {"a": 1}}, "cfg")
    ok = {"offload_modules": "fused_group_mlp", "recompute_modules": ["moe"], "num_layers": 61, "hidden_size": None}
    assert check_field_types(ok, "cfg") is ok


def test_plan_refuses_a_moe_layer_freq_of_zero() -> None:
    from bufreuse.errors import InputError
    from bufreuse.plan.report import moe_layers_per_chunk
    from bufreuse.plan.schedule import ScheduleKind, ScheduleSpec

    spec = ScheduleSpec(kind=ScheduleKind.NONE, microbatches=4)
    with pytest.raises(InputError, match="moe_layer_freq=0 does not describe"):
        moe_layers_per_chunk({"num_layers": 4, "moe_layer_freq": 0}, spec)
    with pytest.raises(InputError, match="moe_layer_freq='\\[\\[\\[' is not an integer or a list"):
        moe_layers_per_chunk({"num_layers": 4, "moe_layer_freq": "[[["}, spec)
