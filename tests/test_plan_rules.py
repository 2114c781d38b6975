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
    one_expert = {**ALLTOALL, "num_moe_experts": 1, "expert_model_parallel_size": 1}  # the experts read the slot
    rule = release_rule({**one_expert, "fp8": "e4m3", "moe_apply_probs_on_input": True}, "dispatch")
    assert rule.point is ReleasePoint.BACKWARD and rule.fields == ("moe_apply_probs_on_input",)


def test_probs_on_input_refuses_the_hybridep_dispatch_ring_by_name():
    rule = release_rule({**HYBRIDEP, "fp8": "e4m3", "moe_apply_probs_on_input": True}, "dispatch")
    assert rule.point is ReleasePoint.REFUSED and rule.refusals == ("no_hybridep_probs_on_input",)
    assert "moe_apply_probs_on_input=False" in rule.reason
    assert release_rule({**HYBRIDEP, "fp8": "e4m3"}, "dispatch").point is ReleasePoint.FORWARD  # control


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"cuda_graph_impl": "transformer_engine"}, "no_per_layer_cuda_graphs"),
        ({"cuda_graph_impl": "local"}, "no_per_layer_cuda_graphs"),
        ({"enable_cuda_graph": True}, "no_per_layer_cuda_graphs"),
        ({"moe_paged_stash": True}, "no_paged_stash"),
        ({"cpu_offloading": True}, "no_te_cpu_offload"),
    ],
)
@pytest.mark.parametrize("base", [HYBRIDEP, ALLTOALL], ids=["hybridep", "alltoall"])
def test_nested_hooks_and_per_layer_graphs_refuse_both_rings(base, fields, key):
    for buffer in ("dispatch", "expert"):
        rule = release_rule({**base, "fp8": "e4m3", **fields}, buffer)
        assert rule.point is ReleasePoint.REFUSED and key in rule.refusals, buffer
        control = release_rule({**base, "fp8": "e4m3", "cuda_graph_impl": "full_iteration"}, buffer)
        assert control.point is not ReleasePoint.REFUSED and not control.refusals


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
    one_rank = {"moe_token_dispatcher_type": "alltoall", "num_moe_experts": 1, "deterministic_mode": True}
    rule = release_rule(one_rank, "expert")
    assert rule.point is ReleasePoint.BACKWARD and rule.fields == ("deterministic_mode",)
    pad_view = {**one_rank, "num_moe_experts": 8, "moe_pad_expert_input_to_capacity": True}
    assert release_rule(pad_view, "expert").point is ReleasePoint.BACKWARD  # the unsort is a view at EP = 1


@pytest.mark.parametrize(
    "extra",
    [
        {"num_moe_experts": 8, "expert_model_parallel_size": 8},  # the combine all-to-all copies
        {"num_moe_experts": 8},  # dropless: the local-expert unsort copies
        {"num_moe_experts": 1, "expert_tensor_parallel_size": 2},  # the reduce-scatter copies
    ],
)
def test_deterministic_unpermute_of_a_copy_releases_the_fc2_slot_at_forward(extra):
    cfg = {"moe_token_dispatcher_type": "alltoall", "deterministic_mode": True, **extra}
    rule = release_rule(cfg, "expert")
    assert rule.point is ReleasePoint.FORWARD and "deterministic_mode" in rule.fields and not rule.data_dependent


def test_deterministic_fp8_te_experts_padding_inside_are_planned_backward_data_dependent():
    # H200, real TE 2.20.2, one expert, 512 tokens (aligned): Fp8Unpadding returned the FC2 output itself and
    # the unpermute's index_add_ saved it (4 of 4 releases deferred); unaligned counts make it copy (forward).
    cfg = {"moe_token_dispatcher_type": "alltoall", "deterministic_mode": True, "num_moe_experts": 1,
           "fp8": "hybrid", "moe_grouped_gemm": True}  # fmt: skip
    rule = release_rule(cfg, "expert")
    assert rule.point is ReleasePoint.BACKWARD and rule.data_dependent and "Fp8Unpadding" in rule.reason
    assert rule.to_dict()["data_dependent"] is True
    padded_by_router = release_rule({**cfg, "moe_router_padding_for_quantization": True}, "expert")
    assert padded_by_router.point is ReleasePoint.BACKWARD and not padded_by_router.data_dependent


def test_alltoall_pad_to_capacity_at_ep1_hands_the_experts_the_slot_itself():
    cfg = {"moe_token_dispatcher_type": "alltoall", "num_moe_experts": 8, "moe_pad_expert_input_to_capacity": True}
    assert release_rule(cfg, "dispatch").point is ReleasePoint.BACKWARD
    assert release_rule({**cfg, "expert_model_parallel_size": 2}, "dispatch").point is ReleasePoint.FORWARD
    assert release_rule({**cfg, "moe_apply_probs_on_input": True, "expert_model_parallel_size": 2}, "dispatch").point \
        is ReleasePoint.FORWARD  # the multiply reads the sorted copy  # fmt: skip


def test_expert_input_offload_refuses_the_dispatch_ring():
    cfg = {**HYBRIDEP, "fine_grained_activation_offloading": True, "offload_modules": ["expert_fc1"]}
    rule = release_rule(cfg, "dispatch")
    assert rule.point is ReleasePoint.REFUSED and rule.refusals == ("no_expert_input_offload",)
    assert "expert_fc1" in rule.reason


@pytest.mark.parametrize("field", ["delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad"])
def test_delayed_wgrad_is_held_to_wgrad_and_refused_only_under_cuda_graphs(field):
    rule = release_rule({**HYBRIDEP, field: True}, "dispatch")
    assert rule.point is ReleasePoint.WGRAD and rule.refusals == ()
    graphed = {**HYBRIDEP, field: True, "cuda_graph_impl": "full_iteration"}
    assert release_rule(graphed, "dispatch").refusals == ("no_graphed_delayed_wgrad",)
    assert release_rule(graphed, "expert").refusals == ()
    # positive control of the narrowing: FP8 experts save a quantized copy, nothing to hold or refuse
    quantized = release_rule({**graphed, "fp8": "e4m3"}, "dispatch")
    assert quantized.point is ReleasePoint.FORWARD and quantized.refusals == ()


def test_install_rows_are_the_rules_refusals():
    from bufreuse.integrations.core import INSTALL_ROWS
    from bufreuse.plan.rules import REFUSALS

    assert [(r.key, r.text, r.fix, r.why) for r in INSTALL_ROWS] == [(r.key, r.text, r.fix, r.why) for r in REFUSALS]


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
