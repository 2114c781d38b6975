"""The planner asked at install(): a fixed slot count below the schedule's minimum is refused up front.

The issue's run (Megatron-LM pretrain_gpt.py on the H200: TE spec, 4 MoE layers, 16 experts top-4, EP 1,
full-iteration graphs, capacity factor 1.0 with pad-to-capacity, 2 dispatch slots) started and died in its
first forward with "needs at least 3 slots" (too low: raised to 3 it died one layer later). Here the same
schedule through the planner (the args file) and through install() of a real megatron-core 0.19.2 model on
CPU (local spec: TE is not installed here; the release rule is the same, bf16 GEMMs save the slot).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_cpu import install_exercising_rings as install  # noqa: E402  (EP = 1: see its docstring)

from bufreuse.config import BufReuseConfig, load_megatron_file  # noqa: E402
from bufreuse.errors import ConfigError  # noqa: E402
from bufreuse.integrations import planned as planned_mod  # noqa: E402
from bufreuse.integrations.megatron import install as install_default  # noqa: E402
from bufreuse.plan import plan_config  # noqa: E402
from bufreuse.pool import BufferPool, EarlyReuseError  # noqa: E402

HIDDEN, SEQ, MBS, EXPERTS, TOPK, LAYERS = 32, 8, 2, 16, 4, 4
TOKENS = SEQ * MBS

ISSUE_ARGS = """\
--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --micro-batch-size 1
--global-batch-size 8 --data-parallel-size 1 --num-experts 16 --moe-router-topk 4 --expert-model-parallel-size 1
--moe-token-dispatcher-type alltoall --transformer-impl transformer_engine --bf16
--cuda-graph-impl full_iteration --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity
--moe-hybridep-reuse-dispatch-output-buffers --moe-hybridep-num-dispatch-output-buffers 2
"""


def _model():
    return _moe_layers(LAYERS, num_layers=LAYERS, cuda_graph_impl="full_iteration")


def _moe_layers(count: int, **config: object):
    """``count`` MoE layers of the local spec (seeded, CPU-initialised, padded all-to-all) with ``config`` on top."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(
        hidden_size=HIDDEN,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True,
        add_bias_linear=False,
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
        **config,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False).submodules.mlp
    return torch.nn.ModuleList([spec(config=cfg) for _ in range(count)])


def _knobs(slots: int) -> BufReuseConfig:
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True, moe_hybridep_num_dispatch_output_buffers=slots
    )


def _forward(model, x, seed: int = 1):
    """One microbatch through every MoE layer (fixed routing: the router needs CUDA in megatron)."""
    g = torch.Generator().manual_seed(seed)
    for layer in model:
        scores = torch.softmax(torch.randn(SEQ * MBS, EXPERTS, generator=g), -1).topk(TOPK)
        routing = torch.zeros(SEQ * MBS, EXPERTS, dtype=torch.bool).scatter(1, scores.indices, True)
        probs = torch.zeros(routing.shape).scatter(1, scores.indices, scores.values)
        h, p = layer.preprocess(x, probs, routing)
        d, p = layer.dispatch(h, p)
        out, _ = layer.routed_experts_compute(d, p)
        x = layer.postprocess(layer.combine(out), None)
    return x


def _x(seed: int = 0):
    return torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def test_planner_says_minimum_4_for_the_issue_run(tmp_path):
    path = tmp_path / "issue.args"
    path.write_text(ISSUE_ARGS)
    # At EP = 1 the all-to-all dispatch is an identity: install() registers no dispatch ring, so the plan says
    # "not used" and 2 slots cannot be too few (the minimum is still planned, for the record).
    (unused,) = plan_config(load_megatron_file(path)).buffers
    assert unused.unused and unused.ok and unused.cycle is None and unused.minimum == LAYERS
    # With the ring exercised at EP = 1 (the validation knob), the issue's run: minimum 4, cycle through layer 2.
    path.write_text(ISSUE_ARGS + "--moe-bufreuse-ring-identity-dispatch\n")
    (dispatch,) = plan_config(load_megatron_file(path)).buffers
    assert dispatch.unused is None
    assert dispatch.rule.point.value == "backward" and dispatch.minimum == LAYERS  # one slot per MoE layer
    assert not dispatch.ok and dispatch.cycle is not None
    assert dispatch.cycle.waiter.name == "dispatch.fwd" and dispatch.cycle.waiter.layer == 2


def test_install_refuses_two_slots_naming_minimum_knob_and_cycle(parallel):
    model = _model()
    pool = BufferPool("cpu")
    with pytest.raises(ConfigError) as info:
        install(model, pool, _knobs(2), tokens=TOKENS, num_microbatches=8)
    text = str(info.value)
    assert "moe_hybridep_num_dispatch_output_buffers=2 is below the planner's minimum 4" in text
    assert "set moe_hybridep_num_dispatch_output_buffers to at least 4" in text
    assert "dispatch.fwd(mb 0, chunk 0, layer 2)" in text  # the cycle `bufreuse plan` prints
    assert "8 microbatch(es)" in text and "MoE layers per chunk [4]" in text
    assert pool.names() == [] and not any("_bufreuse_hooked" in vars(m) for m in model.modules())


def test_install_refuses_three_slots_too(parallel):
    with pytest.raises(ConfigError, match="minimum 4"):
        install(_model(), BufferPool("cpu"), _knobs(3), tokens=TOKENS, num_microbatches=8)


def test_planned_minimum_runs_and_without_the_check_two_slots_die_at_layer_2(parallel, monkeypatch):
    model = _model()
    with install(model, BufferPool("cpu"), _knobs(4), tokens=TOKENS, num_microbatches=8):  # positive control
        _forward(model, _x()).sum().backward()
    # What the issue's run did: no plan at install, the ring dies in the first forward, advice too low.
    monkeypatch.setattr("bufreuse.integrations.megatron.check_depths", lambda *a, **k: {})
    pool = BufferPool("cpu")
    with install(model, pool, _knobs(2), tokens=TOKENS, num_microbatches=8):
        with pytest.raises(EarlyReuseError, match="at least 3") as info:
            _forward(model, _x())
        assert "planner" not in str(info.value)
        pool.reset()


def test_early_reuse_error_quotes_the_planned_minimum(parallel):
    model = _model()
    pool = BufferPool("cpu")
    with install(model, pool, _knobs(4), tokens=TOKENS, num_microbatches=8):
        assert planned_mod.planned_minimum(pool, "dispatch_output")[0] == LAYERS
        first = _forward(model, _x(0))  # a second microbatch in flight: deeper than the planned schedule
        with pytest.raises(EarlyReuseError) as info:
            _forward(model, _x(1))
        assert "the planner's minimum for this schedule is 4" in str(info.value)
        assert "at least 5" in str(info.value)  # held + 1 here, above the plan: the larger one is named
        del first
        pool.reset()
    assert planned_mod.planned_minimum(pool, "dispatch_output") is None  # forgotten at uninstall


def test_auto_and_allocator_policies_are_not_refused(parallel):
    model = _model()
    knobs = BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=2,
        moe_bufreuse_dispatch_policy="record-stream",
    )
    with install(model, BufferPool("cpu"), knobs, tokens=TOKENS, num_microbatches=8) as inst:
        assert inst.layers == LAYERS


def test_an_unused_ep1_dispatch_ring_is_not_planned_or_refused(parallel):
    """At EP = 1 production registers no dispatch ring, so its slot count is not checked against the plan."""
    model = _model()
    with pytest.raises(ConfigError):  # positive control: the exercised dispatch ring is planned and refused
        install(model, BufferPool("cpu"), _knobs(2), tokens=TOKENS, num_microbatches=8)
    pool = BufferPool("cpu")
    with install_default(model, pool, _knobs(2), tokens=TOKENS, num_microbatches=8) as inst:
        assert "dispatch_output" in inst.unused and "dispatch_output" not in pool.names()


def _stage_model(pp: int, layers_per_stage: int):
    """One pipeline stage's MoE layers of a ``pp``-stage model (the config says PP = ``pp``; a gloo world of one
    runs them)."""
    return _moe_layers(
        layers_per_stage,
        num_layers=pp * layers_per_stage,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )


def test_install_plans_the_pipeline_rank_it_is_given(parallel):
    """PP = 4, 1F1B, 8 microbatches, 2 MoE layers per stage: the last stage (rank 3) keeps one microbatch in flight,
    so 2 dispatch slots are its minimum, where rank 0 needs 8 (``bufreuse plan --pp-rank``, the same rows). Installed
    with ``pp_rank=3``, 2 slots are planned and accepted, and a forward and backward run on them; the same install
    for rank 0 is refused naming 8 (the positive control: the rank changes the verdict)."""
    pp, per_stage, m = 4, 2, 8
    fields = {
        "num_layers": pp * per_stage,
        "pipeline_model_parallel_size": pp,
        "num_moe_experts": EXPERTS,
        "moe_router_topk": TOPK,
        "moe_token_dispatcher_type": "alltoall",
        "hidden_size": HIDDEN,
        "seq_length": SEQ,
        "micro_batch_size": MBS,
        "moe_expert_capacity_factor": 1.0,
        "moe_pad_expert_input_to_capacity": True,
        "moe_hybridep_reuse_dispatch_output_buffers": True,
        "moe_hybridep_num_dispatch_output_buffers": 2,
        "moe_bufreuse_ring_identity_dispatch": True,
    }
    minima = {r: plan_config(fields, num_microbatches=m, pp_rank=r).buffers[0].minimum for r in (0, 3)}
    assert minima == {0: pp * per_stage, 3: per_stage}, minima
    model = _stage_model(pp, per_stage)
    pool = BufferPool("cpu")
    with install(model, pool, _knobs(2), tokens=TOKENS, num_microbatches=m, pp_rank=3) as inst:
        assert inst.pp_rank == 3
        assert planned_mod.planned_minimum(pool, "dispatch_output")[0] == minima[3]
        _forward(model, _x()).sum().backward()
    assert pool.stats()["dispatch_output"].acquisitions == per_stage and pool.get("dispatch_output").held == 0
    with pytest.raises(ConfigError, match=f"below the planner's minimum {minima[0]} .*PP rank 0 of {pp}"):
        install(_stage_model(pp, per_stage), BufferPool("cpu"), _knobs(2), tokens=TOKENS, num_microbatches=m)
