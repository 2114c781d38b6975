"""The release-rule table: each row's point and the config field it names (megatron-core 0.19.2 reading)."""

from __future__ import annotations

import pytest

from bufreuse.plan.rules import ReleasePoint, release_rule, release_rules

HYBRIDEP = {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep", "num_moe_experts": 8}
ALLTOALL = {"moe_token_dispatcher_type": "alltoall", "num_moe_experts": 8, "expert_model_parallel_size": 8}


def test_dispatch_released_at_forward_with_fp8_experts():
    rule = release_rule({**HYBRIDEP, "fp8": "e4m3"}, "dispatch")
    assert rule.point is ReleasePoint.FORWARD and "fp8" in rule.reason


def test_dispatch_released_after_backward_with_bf16_experts():
    rule = release_rule({**HYBRIDEP, "bf16": True}, "dispatch")
    assert rule.point is ReleasePoint.BACKWARD and "fp8" in rule.fields


def test_dispatch_released_after_wgrad_with_delayed_wgrad():
    rule = release_rule({**HYBRIDEP, "delay_wgrad_compute": True}, "dispatch")
    assert rule.point is ReleasePoint.WGRAD and "delay_wgrad_compute" in rule.reason


def test_probs_on_input_saves_the_slot_even_with_fp8():
    rule = release_rule({**HYBRIDEP, "fp8": "e4m3", "moe_apply_probs_on_input": True}, "dispatch")
    assert rule.point is ReleasePoint.BACKWARD and rule.fields == ("moe_apply_probs_on_input",)


def test_fused_group_mlp_offload_refuses_the_dispatch_ring():
    cfg = {
        **HYBRIDEP,
        "fp8": "e4m3",
        "fine_grained_activation_offloading": True,
        "offload_modules": ["fused_group_mlp"],
    }
    rule = release_rule(cfg, "dispatch")
    assert rule.point is ReleasePoint.REFUSED and "offload_modules" in rule.fields


def test_alltoall_copy_in_dispatch_postprocess_releases_at_forward():
    several_local = {**ALLTOALL, "expert_model_parallel_size": 2}  # 4 local experts: sorted into a copy
    assert release_rule(several_local, "dispatch").point is ReleasePoint.FORWARD
    expert_tp = {**ALLTOALL, "expert_tensor_parallel_size": 2}
    assert release_rule(expert_tp, "dispatch").point is ReleasePoint.FORWARD


def test_alltoall_one_local_expert_bf16_saves_the_slot():
    cfg = {"moe_token_dispatcher_type": "alltoall", "num_moe_experts": 4, "expert_model_parallel_size": 4}
    assert release_rule(cfg, "dispatch").point is ReleasePoint.BACKWARD


def test_expert_output_released_at_combine_forward():
    assert release_rule(HYBRIDEP, "expert").point is ReleasePoint.FORWARD
    assert release_rule(ALLTOALL, "expert").point is ReleasePoint.FORWARD


def test_expert_output_waits_for_backward_under_deterministic_mode():
    rule = release_rule({**ALLTOALL, "deterministic_mode": True}, "expert")
    assert rule.point is ReleasePoint.BACKWARD and rule.fields == ("deterministic_mode",)


@pytest.mark.parametrize(
    "cfg",
    [
        {"recompute_granularity": "full"},
        {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
        {"recompute_granularity": "selective", "recompute_modules": "moe"},
    ],
)
def test_moe_recompute_marks_a_second_acquisition(cfg):
    rules = release_rules({**HYBRIDEP, **cfg})
    assert all(r.recompute for r in rules.values())
    assert "recompute_granularity" in rules["dispatch"].fields


def test_unknown_buffer_is_rejected():
    with pytest.raises(ValueError, match="unknown buffer"):
        release_rule(HYBRIDEP, "weights")


def test_rule_to_dict_is_plain_json():
    d = release_rule(HYBRIDEP, "dispatch").to_dict()
    assert d["point"] == "backward" and isinstance(d["fields"], list)


def test_plan_package_imports_no_torch_and_nothing_above_config():
    import subprocess
    import sys

    code = (
        "import sys, bufreuse.plan; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('bufreuse.integrations', 'bufreuse.pool', "
        "'bufreuse.cli', 'bufreuse.analysis', 'bufreuse.bench', 'bufreuse.launch'))]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
