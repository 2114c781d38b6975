"""`bufreuse plan`, the `auto` slot knob, and `bufreuse sweep --slots plan,plan+2` (CLI end to end)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bufreuse.cli.app import app
from bufreuse.config import AUTO, BufReuseConfig, add_arguments, static_bounds
from bufreuse.errors import ConfigError, InputError
from bufreuse.launch.sweep import parse_slot_list
from bufreuse.plan import plan_config, resolve_slot_spec

runner = CliRunner()

BASE = """\
num_layers: {layers}
hidden_size: 1024
num_moe_experts: 16
moe_router_topk: 2
moe_token_dispatcher_type: flex
moe_flex_dispatcher_backend: hybridep
expert_model_parallel_size: 8
moe_expert_rank_capacity_factor: 1.0
pipeline_model_parallel_size: {pp}
bf16: true
seq_length: 1024
micro_batch_size: 1
num_microbatches: 8
moe_hybridep_reuse_dispatch_output_buffers: true
moe_hybridep_num_dispatch_output_buffers: {slots}
"""


def _cfg(tmp_path: Path, *, layers: int = 8, pp: int = 4, slots: int | str = 8, extra: str = "") -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(BASE.format(layers=layers, pp=pp, slots=slots) + extra)
    return p


def test_plan_passes_when_slots_cover_the_1f1b_depth(tmp_path):
    res = runner.invoke(app, ["plan", str(_cfg(tmp_path, slots=8)), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    d = data["buffers"][0]
    assert data["schedule"]["kind"] == "1f1b" and data["moe_layers_per_chunk"] == [2]
    assert (d["minimum"], d["formula"], d["release"]["point"]) == (8, "L x min(m, p - r)", "backward")
    assert d["persistent_bytes"] == 8 * 1024 * 2 * 1024 * 2  # slots x rows (tokens x topk x 1.0) x hidden x 2 B


def test_plan_exits_1_and_names_the_cycle_when_slots_are_short(tmp_path):
    res = runner.invoke(app, ["plan", str(_cfg(tmp_path, slots=4))])
    assert res.exit_code == 1
    assert "stuck at 4 slot(s)" in res.output and "ring 'dispatch_output'" in res.output
    assert "4 slot(s) < minimum 8" in res.output


def test_plan_pp_rank_changes_the_depth(tmp_path):
    res = runner.invoke(app, ["plan", str(_cfg(tmp_path)), "--pp-rank", "3", "--json"])
    assert json.loads(res.stdout)["buffers"][0]["minimum"] == 2  # L x (p - r) = 2 x 1


def test_plan_fp8_is_constant_one_slot(tmp_path):
    res = runner.invoke(app, ["plan", str(_cfg(tmp_path, slots=1, extra="fp8: e4m3\n")), "--json"])
    b = json.loads(res.stdout)["buffers"][0]
    assert res.exit_code == 0 and (b["minimum"], b["constant"]) == (1, True)


def test_plan_auto_slots_pass_and_report_the_minimum(tmp_path):
    res = runner.invoke(app, ["plan", str(_cfg(tmp_path, slots="auto")), "--json"])
    b = json.loads(res.stdout)["buffers"][0]
    assert res.exit_code == 0 and (b["configured"], b["minimum"]) == ("auto", 8)


def test_plan_refused_buffer_exits_1(tmp_path):
    extra = "fine_grained_activation_offloading: true\noffload_modules: [fused_group_mlp]\n"
    res = runner.invoke(app, ["plan", str(_cfg(tmp_path, extra=extra))])
    assert res.exit_code == 1 and "refused" in res.output


def test_plan_bad_input_exits_2_with_one_line(tmp_path):
    missing = runner.invoke(app, ["plan", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and missing.output.count("error:") == 1 and "Traceback" not in missing.output
    p = tmp_path / "m.yaml"
    p.write_text(BASE.format(layers=8, pp=4, slots=4).replace("num_microbatches: 8\n", ""))
    res = runner.invoke(app, ["plan", str(p)])
    assert res.exit_code == 2 and "--num-microbatches" in res.output
    assert runner.invoke(app, ["plan", str(p), "--global-batch-size", "64", "--data-parallel-size", "8"]).exit_code == 1
    assert runner.invoke(app, ["plan", str(_cfg(tmp_path)), "--pp-rank", "9"]).exit_code == 2
    uneven = runner.invoke(app, ["plan", str(_cfg(tmp_path, layers=7))])
    assert uneven.exit_code == 2 and "--moe-layers-per-chunk" in uneven.output


def test_plan_nothing_enabled_exits_2_unless_assumed(tmp_path):
    p = tmp_path / "off.yaml"
    p.write_text(BASE.format(layers=8, pp=1, slots=4).replace("moe_hybridep_reuse_dispatch_output_buffers: true\n", ""))
    assert runner.invoke(app, ["plan", str(p)]).exit_code == 2
    res = runner.invoke(app, ["plan", str(p), "--assume-enabled", "--json"])
    assert [b["buffer"] for b in json.loads(res.stdout)["buffers"]] == ["dispatch", "expert"]


def test_plan_interleaved_reports_each_chunk(tmp_path):
    cfg = _cfg(tmp_path, layers=16, slots=16, extra="virtual_pipeline_model_parallel_size: 2\n")
    data = json.loads(runner.invoke(app, ["plan", str(cfg), "--json"]).stdout)
    b = data["buffers"][0]
    assert data["schedule"]["kind"] == "interleaved" and b["per_chunk"] == {"0": 16, "1": 8}
    # one ring for both chunks: 2 MoE layers x (rank 0's warm-up 2 (4 - 1) + (2 - 1) 4 = 10, plus one)
    assert b["minimum"] == 2 * (10 + 1) and b["ok"] is False
    assert b["rings"] == 1 and b["persistent_bytes"] == 22 * b["slot_bytes"]


def test_plan_table_renders(tmp_path):
    res = runner.invoke(app, ["plan", str(_cfg(tmp_path))])
    assert res.exit_code == 0 and "dispatch_output" in res.output and "release after backward" in res.output


def test_plan_config_moe_layer_freq_counts_moe_layers_only():
    fields = {
        "num_layers": 8, "pipeline_model_parallel_size": 2, "moe_layer_freq": 2, "num_microbatches": 4,
        "moe_token_dispatcher_type": "alltoall", "num_moe_experts": 8, "expert_model_parallel_size": 8,
        "moe_hybridep_reuse_dispatch_output_buffers": True,
    }  # fmt: skip
    assert plan_config(fields).layers_per_chunk == [2]
    assert plan_config({**fields, "moe_layer_freq": "[1,1,1,0,0,0,0,1]"}).layers_per_chunk == [3]


def test_auto_knob_is_accepted_by_config_and_argparse():
    knobs = BufReuseConfig(
        moe_hybridep_num_dispatch_output_buffers="AUTO", moe_hybridep_num_expert_output_buffers="auto"
    )
    assert knobs.slots("expert") == AUTO and knobs.expert_enabled
    knobs = BufReuseConfig.from_mapping(
        {"moe_hybridep_reuse_dispatch_output_buffers": True, "moe-hybridep-num-dispatch-output-buffers": "auto"}
    )
    bound = static_bounds({"hidden_size": 8, "moe_expert_rank_capacity_factor": 1.0}, knobs, path="hybridep", tokens=4)
    assert knobs.slots("dispatch") == AUTO and bound["dispatch"].slots == 0
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--moe-hybridep-num-dispatch-output-buffers", "auto"])
    assert BufReuseConfig.from_args(args).moe_hybridep_num_dispatch_output_buffers == AUTO
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-hybridep-num-expert-output-buffers", "many"])
    with pytest.raises(ConfigError, match="'auto'"):
        BufReuseConfig(moe_hybridep_num_dispatch_output_buffers="deep")


def test_check_config_accepts_auto_slots(tmp_path):
    res = runner.invoke(app, ["check-config", str(_cfg(tmp_path, slots="auto")), "--json"])
    data = json.loads(res.stdout)
    assert not any(r["key"] == "dispatch_slots" and not r["ok"] for r in data["requirements"])


@pytest.mark.parametrize("text,want", [("plan", 5), ("plan+2", 7), ("PLAN - 1", 4), ("3", 3)])
def test_slot_spec_resolves_against_the_plan(text, want):
    assert resolve_slot_spec(text, 5) == want


@pytest.mark.parametrize("text", ["plan*2", "p", "-1", "plan-9"])
def test_slot_spec_rejects_bad_text(text):
    with pytest.raises(InputError, match="--slots"):
        resolve_slot_spec(text, lambda: 5)


def test_sweep_slot_list_uses_the_proxy_plan():
    assert parse_slot_list("0,plan,plan+2", params={}, buffers=["dispatch", "expert"]) == [0, 2, 4]
    assert parse_slot_list("plan", params={"microbatches": 1}, buffers=["dispatch"]) == [1]
    assert parse_slot_list("plan", params={}, buffers=["expert"]) == [1]
    assert parse_slot_list("4,10", params={}, buffers=[], plan_minimum=lambda: 1 / 0) == [4, 10]  # lazy


def test_sweep_plan_slots_reach_the_configs(tmp_path):
    res = runner.invoke(
        app,
        ["sweep", "--slots", "plan,plan+2", "--workload", "cpu-smoke", "--root", str(tmp_path), "--name", "p",
         "--steps", "1", "--warmup-steps", "0", "--record-steps", "0", "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    ids = [r["config_id"] for r in json.loads(res.stdout)["rows"]]
    assert ids == ["slots2", "slots4"]


def test_sweep_plan_config_sets_the_plan(tmp_path):
    cfg = _cfg(tmp_path)
    res = runner.invoke(
        app,
        ["sweep", "--slots", "plan", "--plan-config", str(cfg), "--workload", "cpu-smoke", "--root", str(tmp_path),
         "--name", "q", "--steps", "1", "--warmup-steps", "0", "--record-steps", "0", "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert [r["config_id"] for r in json.loads(res.stdout)["rows"]] == ["slots8"]
    bad = runner.invoke(app, ["sweep", "--slots", "plan", "--plan-config", str(tmp_path / "x.yaml")])
    assert bad.exit_code == 2


def test_plan_auto_beside_a_short_ring_still_names_the_short_one(tmp_path):
    cfg = _cfg(tmp_path, slots=2, extra="moe_hybridep_num_expert_output_buffers: auto\n")
    res = runner.invoke(app, ["plan", str(cfg), "--json"])
    data = json.loads(res.stdout)
    by = {b["buffer"]: b for b in data["buffers"]}
    assert res.exit_code == 1 and by["expert"]["ok"] and by["dispatch"]["cycle"]["ring"] == "dispatch_output"


def test_sweep_plan_config_with_a_refused_ring_is_bad_input(tmp_path):
    extra = "fine_grained_activation_offloading: true\noffload_modules: [fused_group_mlp]\n"
    res = runner.invoke(app, ["sweep", "--slots", "plan", "--plan-config", str(_cfg(tmp_path, extra=extra))])
    assert res.exit_code == 2 and "dispatch cannot be a ring" in res.output


def test_auto_memory_cap_knob_reaches_the_config():
    parser = add_arguments(argparse.ArgumentParser())
    knobs = BufReuseConfig.from_args(parser.parse_args(["--moe-bufreuse-auto-max-mib", "512"]))
    assert knobs.auto_max_bytes == 512 * 2**20
    assert BufReuseConfig().auto_max_bytes is None
    with pytest.raises(ConfigError, match="moe_bufreuse_auto_max_mib"):
        BufReuseConfig(moe_bufreuse_auto_max_mib=-1)


def test_initial_slots_is_the_planned_minimum_or_none():
    from bufreuse.plan import initial_slots

    fields = {
        "num_layers": 8, "pipeline_model_parallel_size": 4, "moe_token_dispatcher_type": "flex",
        "moe_flex_dispatcher_backend": "hybridep", "num_moe_experts": 8,
    }  # fmt: skip
    assert initial_slots(fields, "dispatch", num_microbatches=8) == 8  # bf16: L x (p - r) = 2 x 4
    assert initial_slots({**fields, "fp8": "e4m3"}, "dispatch", num_microbatches=8) == 1
    assert initial_slots({**fields, "num_layers": 7}, "dispatch", num_microbatches=8) is None
    off = {**fields, "fine_grained_activation_offloading": True, "offload_modules": ["fused_group_mlp"]}
    assert initial_slots(off, "dispatch", num_microbatches=8) is None


def test_plan_marks_the_ep1_dispatch_ring_unused_as_install_does():
    from bufreuse.config import BufReuseConfig, static_bounds

    fields = {
        "num_layers": 2, "num_microbatches": 4, "seq_length": 128, "micro_batch_size": 1, "hidden_size": 64,
        "moe_token_dispatcher_type": "alltoall", "num_moe_experts": 8, "moe_router_topk": 2,
        "expert_model_parallel_size": 1, "bf16": True, "moe_hybridep_reuse_dispatch_output_buffers": True,
        "moe_hybridep_num_expert_output_buffers": 2,
    }  # fmt: skip
    dispatch = next(b for b in plan_config(fields).buffers if b.buffer == "dispatch")
    # install()'s own bound registers 0 dispatch slots at EP = 1: the plan says the same, with no ring memory; the
    # control's queue stays the model's figure, with the rule's verdict beside it (issue 45: not zeroed by the rule)
    bounds = static_bounds(fields, BufReuseConfig.from_mapping(fields), path="alltoall", tokens=128)
    assert bounds["dispatch"].slots == 0
    assert dispatch.unused and dispatch.persistent_bytes == 0 and dispatch.verdict == f"stands down: {dispatch.unused}"
    assert dispatch.pending_bytes == dispatch.pending_count * dispatch.slot_bytes > 0
    # Positive controls: at EP = 2 under EP overlap the ring exists (the dispatch output crosses streams), and
    # the validation knobs ask for it at EP = 1 and at EP = 2 without overlap (nothing pending-free there).
    for extra in ({"expert_model_parallel_size": 2, "overlap_moe_expert_parallel_comm": True},
                  {"moe_bufreuse_ring_identity_dispatch": True},
                  {"expert_model_parallel_size": 2, "moe_bufreuse_keep_unused_rings": True}):  # fmt: skip
        real = next(b for b in plan_config({**fields, **extra}).buffers if b.buffer == "dispatch")
        assert real.unused is None and real.persistent_bytes == real.minimum * real.slot_bytes > 0


def test_plan_marks_the_single_rank_expert_ring_unused_as_install_does():
    from bufreuse.config import BufReuseConfig, static_bounds

    fields = {
        "num_layers": 2, "num_microbatches": 4, "seq_length": 128, "micro_batch_size": 1, "hidden_size": 64,
        "moe_token_dispatcher_type": "alltoall", "num_moe_experts": 8, "moe_router_topk": 2,
        "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1, "bf16": True,
        "moe_hybridep_num_expert_output_buffers": 2,
    }  # fmt: skip
    expert = next(b for b in plan_config(fields).buffers if b.buffer == "expert")
    bounds = static_bounds(fields, BufReuseConfig.from_mapping(fields), path="alltoall", tokens=128)
    assert bounds["expert"].slots == 0
    assert expert.unused and "one stream" in expert.unused and expert.persistent_bytes == 0 and expert.cycle is None
    # Positive controls: EP 8 under EP overlap (one local expert: the combine reads the FC2 output on the comm
    # stream), expert TP 2 with the keep knob, and the validation knob each give a real ring.
    for extra in ({"expert_model_parallel_size": 8, "overlap_moe_expert_parallel_comm": True},
                  {"expert_tensor_parallel_size": 2, "moe_bufreuse_keep_unused_rings": True},
                  {"moe_bufreuse_ring_single_rank_expert": True}):  # fmt: skip
        real = next(b for b in plan_config({**fields, **extra}).buffers if b.buffer == "expert")
        assert real.unused is None and real.persistent_bytes == real.minimum * real.slot_bytes > 0, extra


def test_an_unused_dispatch_ring_is_never_too_small():
    # One expert, bf16 GEMMs save the slot, PP 4: the dispatch minimum is well above 1 slot -- for a ring that
    # install() never registers at EP = 1, so the plan is fine and exits 0.
    fields = {
        "num_layers": 8, "pipeline_model_parallel_size": 4, "num_microbatches": 8, "num_moe_experts": 1,
        "moe_router_topk": 1, "moe_token_dispatcher_type": "alltoall", "expert_model_parallel_size": 1, "bf16": True,
        "moe_hybridep_reuse_dispatch_output_buffers": True, "moe_hybridep_num_dispatch_output_buffers": 1,
    }  # fmt: skip
    dispatch = next(b for b in plan_config(fields).buffers if b.buffer == "dispatch")
    assert dispatch.unused and dispatch.minimum > 1 and dispatch.ok and dispatch.cycle is None
    # Positive control: the same schedule at EP = 2 with the keep knob is a real ring, too small at 1 slot.
    kept = {**fields, "expert_model_parallel_size": 2, "moe_bufreuse_keep_unused_rings": True}
    real = next(b for b in plan_config(kept).buffers if b.buffer == "dispatch")
    assert real.unused is None and not real.ok and real.minimum > 1


EP64 = Path(__file__).resolve().parents[1] / "examples" / "megatron-ep64" / "megatron.args"


@pytest.mark.parametrize("extra", ["--num-lyers 4", "--no-such-flag --moe-frobnicate 2"])
def test_plan_refuses_an_args_file_with_an_unknown_flag_in_one_line(tmp_path, extra):
    """Megatron-LM would refuse the file (its argparse), so there is no run to plan: one error line, exit 2,
    also when another problem (the microbatch count) would be reported too."""
    ok = runner.invoke(app, ["plan", str(EP64), "--data-parallel-size", "64"])
    assert ok.exit_code in (0, 1) and not ok.stderr.strip(), ok.output  # positive control: the example plans
    bad = tmp_path / "run.args"
    bad.write_text(EP64.read_text() + extra + "\n")
    for argv in (["--data-parallel-size", "64"], []):
        res = runner.invoke(app, ["plan", str(bad), *argv])
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), res.output
        assert extra.split()[0] in lines[0] and "Megatron would refuse" in lines[0]
    if extra.startswith("--num-lyers"):
        assert "did you mean --num-layers?" in lines[0]
