"""The schedule harness, CPU half: every ``local`` and ``te-fake`` row of ``schedule_harness.ROWS``.

Real megatron-core 0.19.2 ``MoELayer`` (all-to-all dispatcher, gloo world of one, pad-to-capacity so
no device-to-host sync), driven through its own stage methods with a fixed routing (the router moves
its weight to CUDA). ``local``: ``SequentialMLP``. ``te-fake``: megatron's real ``TEGroupedMLP``
(non-fused forward) over ``tests/fakes/te_grouped_linear.py``'s TE ``GroupedLinear`` stand-in, so the
expert ring goes through the ``out=`` route. Recompute wraps the layer's stages in a reentrant
checkpoint (``torch.utils.checkpoint``, the mechanism of megatron's ``tensor_parallel.checkpoint``,
which needs CUDA). Each row: control vs rings, production mode and debug mode, bit for bit.
The real-TE and FP8 rows are in ``tests/test_schedule_harness_gpu.py``.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_cpu import install_exercising_rings as install  # noqa: E402  (EP = 1: see its docstring)
from schedule_harness import MODES, ORDERS, Row, compare, control_is_deterministic, guard, mode_env, rows_for  # noqa: E402

from bufreuse.config import BufReuseConfig  # noqa: E402
from bufreuse.errors import ConfigError  # noqa: E402
from bufreuse.integrations.core import ConfigView, effective_config  # noqa: E402
from bufreuse.integrations.requirements import validate  # noqa: E402
from bufreuse.plan.rules import release_rule  # noqa: E402
from bufreuse.pool import BufferPool, EarlyReuseError  # noqa: E402

HIDDEN, SEQ, MBS = 32, 8, 2
TOKENS = SEQ * MBS
CPU_ROWS = rows_for("local", "te-fake")


def build_layer(row: Row):
    """The row's MoE layer on CPU (weights in the row's dtype)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    dtype = getattr(torch, row.dtype)
    topk = 1 if row.probs_on_input else min(2, row.experts)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=row.experts,
        moe_router_topk=topk,
        moe_router_pre_softmax=topk == 1,
        moe_token_dispatcher_type="alltoall",
        moe_apply_probs_on_input=row.probs_on_input,
        use_cpu_initialization=True,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
    )
    layer = get_gpt_layer_local_spec(num_experts=row.experts, moe_grouped_gemm=False).submodules.mlp(config=cfg)
    if row.delayed_wgrad:
        # megatron refuses it at construction without EP overlap (EP > 1); set before the (fake) TE
        # experts are built, as megatron's TEGroupedLinear reads it there
        setattr(cfg, row.delayed_wgrad, True)
    if "graphs" in row.tags:
        cfg.cuda_graph_impl = "full_iteration"
    if row.spec == "te-fake":
        from fakes import te_grouped_linear as te

        linear = te.MegatronTEGroupedLinear
        if row.fp8 == "copy":
            linear = type("QuantizingTEGroupedLinear", (linear,), {"quantized": True})
        subs = GroupedMLPSubmodules(linear_fc1=linear, linear_fc2=linear)
        layer.experts = TEGroupedMLP(
            row.experts, cfg, subs, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        )
        cfg.moe_grouped_gemm = True
    return layer.to(dtype)


def _forward(layer, x, i: int):
    cfg = layer.config
    g = torch.Generator().manual_seed(1000 + i)
    scores = torch.softmax(torch.randn(x.shape[0] * x.shape[1], cfg.num_moe_experts, generator=g), -1)
    top = scores.topk(cfg.moe_router_topk)
    routing = torch.zeros(top.values.shape[0], cfg.num_moe_experts, dtype=torch.bool).scatter(1, top.indices, True)
    # The router's probs carry a gradient in training (moe_apply_probs_on_input's multiply then saves the slot).
    probs = torch.zeros(routing.shape).scatter(1, top.indices, top.values).requires_grad_(True)

    def stages(x):
        h, p = layer.preprocess(x, probs, routing)
        d, p = layer.dispatch(h, p)
        out, _ = layer.routed_experts_compute(d, p)
        return layer.postprocess(layer.combine(out), None)

    if cfg.recompute_granularity == "selective" and "moe" in (cfg.recompute_modules or []):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(stages, x, use_reentrant=True)
    return stages(x)


def run_order(layer, xs: list, order: str) -> tuple[list, list, dict]:
    """Run ``order`` over ``xs``; outputs, input grads, parameter grads."""
    layer.zero_grad(set_to_none=True)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    outs: dict[int, torch.Tensor] = {}
    for step in ORDERS[order]:
        i = int(step[1:])
        if step[0] == "F":
            outs[i] = _forward(layer, leaves[i], i)
        elif step[0] == "W":
            layer.backward_dw()  # delayed weight gradients of microbatch i (TE's store is a FIFO)
        else:
            g = torch.Generator().manual_seed(2000 + i)
            outs[i].backward(torch.randn(outs[i].shape, generator=g).to(outs[i].dtype))
    params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return [outs[i].detach() for i in sorted(outs)], [x.grad for x in leaves], params


def knobs_for(row: Row) -> BufReuseConfig:
    """Both rings at the row's depth, exercised at EP = 1 (validate() and install() read the same knobs)."""
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=row.depth,
        moe_hybridep_num_expert_output_buffers=row.depth,
        moe_bufreuse_ring_identity_dispatch=True,
        moe_bufreuse_ring_single_rank_expert=True,
    )


def _inputs(row: Row, n: int = 4) -> list:
    dtype = getattr(torch, row.dtype)
    return [torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(n)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("row", CPU_ROWS, ids=lambda r: r.name)
def test_schedule_row_matches_control_or_is_refused_by_name(parallel, row: Row, mode: str) -> None:
    layer = build_layer(row)
    if row.recompute:
        layer.config.recompute_granularity, layer.config.recompute_modules = "selective", ["moe"]
    knobs, xs = knobs_for(row), _inputs(row)
    if row.expect.startswith("refused:"):
        key = row.expect.split(":", 1)[1]
        with pytest.raises(ConfigError, match=key) as e:
            validate(layer.config, knobs, seq_length=SEQ, micro_batch_size=MBS)
        assert row.delayed_wgrad in str(e.value)
        assert key in release_rule(layer.config, "dispatch").refusals  # the refusal is the release rule's
        with pytest.raises(ConfigError, match=row.delayed_wgrad):
            install(layer, BufferPool("cpu"), knobs, tokens=TOKENS)
        assert "token_dispatch" not in vars(layer.token_dispatcher)  # nothing stayed replaced
        return
    ref = run_order(layer, xs, row.order)
    control_is_deterministic(row.name, mode, ref, run_order(layer, xs, row.order))
    with mode_env(mode):
        pool = BufferPool("cpu")
        assert pool.debug is (mode == "debug")
        with install(layer, pool, knobs, tokens=TOKENS) as inst, guard(pool, mode):
            if row.fp8 == "copy":  # the fake emulates FP8 GEMMs that megatron cannot run on CPU: rules read fp8
                inst.expected_release.clear()
                inst.expect(layer, "alltoall", ConfigView(effective_config(layer.config), fp8="e4m3"))
            if row.expect.startswith("early-reuse:"):
                depth = row.expect.split(":", 1)[1]
                with pytest.raises(EarlyReuseError, match=f"to at least {depth}"):
                    run_order(layer, xs, row.order)
                pool.reset()
                return
            got = run_order(layer, xs, row.order)
    problems = compare(row.name, mode, ref, got)
    assert not problems, "\n".join(problems)
    stats = pool.stats()
    assert set(stats) == {"dispatch_output", "expert_fc2_output"}
    for name, s in stats.items():
        mult = 2 if row.recompute else 1  # a recomputed forward acquires again in backward
        assert s.acquisitions == s.releases == mult * len(xs), (row.name, name, s)
        assert s.peak_held <= row.depth, (row.name, name, s)
    # The release observed (by fact) is where the planner's rule says (bufreuse.plan.rules): a rules
    # change the integration contradicts fails here.
    assert set(inst.expected_release) == set(stats)
    disagreements = inst.release_check()
    assert not disagreements, "\n".join(map(str, disagreements))


def test_allocation_probes_count_by_the_megatron_site_not_by_bufreuse_names() -> None:
    """The GPU tests' probes (schedule_harness) on hand-made snapshot stacks: what counts, what does not."""
    from schedule_harness import alloc_stacks, dispatch_stage_allocs, expert_output_allocs, layer_allocs

    mc = "/site-packages/megatron/core/transformer/moe/"

    def ev(*frames: tuple[str, str, int]) -> dict:
        return {"action": "alloc", "frames": [{"filename": f, "name": n, "line": ln} for f, n, ln in frames]}

    cat = ev(
        ("/torch/functional.py", "cat", 1),
        (mc + "experts.py", "forward", 108),
        (mc + "moe_layer.py", "routed_experts_compute", 558),
    )
    fc1 = ev(
        (mc + "../../mlp.py", "forward", 140),
        (mc + "experts.py", "forward", 104),
        (mc + "moe_layer.py", "routed_experts_compute", 558),
    )
    ours = ev(
        ("/x/bufreuse/integrations/alltoall/functions.py", "forward", 70),
        ("/x/bufreuse/integrations/core.py", "wrapper", 9),
        (mc + "moe_layer.py", "routed_experts_compute", 558),
    )  # a replacement experts.forward allocating per call
    a2a = ev(
        ("/m/megatron/core/tensor_parallel/mappings.py", "forward", 441),
        (mc + "token_dispatcher.py", "token_dispatch", 698),
        (mc + "moe_layer.py", "dispatch", 498),
    )
    cxx = ev(("??", "at::empty", 0))
    snap = {"device_traces": [[cat, fc1, ours, a2a, cxx, {"action": "free_requested", "frames": []}]]}
    stacks = alloc_stacks(snap)
    assert len(stacks) == 5 and stacks[4] == []  # C++-only frames are dropped, the event still counts
    assert expert_output_allocs(stacks) == 2  # the control's cat and the replacement's own allocation
    assert expert_output_allocs([stacks[1]]) == 0  # an expert MLP's FC1 output is not the expert output
    assert dispatch_stage_allocs(stacks) == 1 and layer_allocs(stacks) == 4


def test_delayed_wgrad_fifo_stays_aligned_when_a_microbatch_holds_nothing(parallel, monkeypatch) -> None:
    """One entry per forward: a microbatch whose slot needs no hold (no saved reference, e.g. no tokens on
    this rank) must not make its ``backward_dw`` finish the next microbatch's hold."""
    row = next(r for r in CPU_ROWS if r.name == "te-fake-e1-delay_wgrad_compute-1f1b_dw")
    layer = build_layer(row)
    xs = _inputs(row)
    pool = BufferPool("cpu")
    real = pool.saved_references
    calls = {"n": 0}

    def first_saves_nothing(name, tensor):
        calls["n"] += 1
        return 0 if calls["n"] == 1 else real(name, tensor)

    with install(layer, pool, knobs_for(row), tokens=TOKENS):
        leaves = [x.clone().requires_grad_(True) for x in xs]
        monkeypatch.setattr(pool, "saved_references", first_saves_nothing)
        outs = {i: _forward(layer, leaves[i], i) for i in (0, 1)}  # mb 0: no hold (faked), mb 1: held
        monkeypatch.setattr(pool, "saved_references", real)
        ring = pool.get("dispatch_output")
        outs[0].sum().backward()
        outs[1].sum().backward()
        layer.backward_dw()  # mb 0's entry: nothing to finish; mb 1's slot must stay held
        assert ring.held == 1, "backward_dw of microbatch 0 finished microbatch 1's hold"
        layer.backward_dw()  # mb 1's entry: its hold is done, the slot is released
        assert ring.held == 0


@pytest.mark.parametrize("mode", MODES)
def test_delayed_wgrad_fifo_with_microbatches_that_held_nothing_interleaved(parallel, mode: str) -> None:
    """Microbatches whose slot was released before the experts (``dispatch_postprocess`` copied it, as the sort does
    or as for a rank that got no tokens: nothing held) interleaved with ones whose FC1 saved the slot into TE's wgrad
    store (held until ``backward_dw``). Each forward queues one entry, ``None`` or a hold, so each ``backward_dw``
    finishes its own microbatch's hold: F0 (nothing) F1 (held) B0 B1 W0 must leave microbatch 1's slot held for W1,
    whose FC1 wgrad reads it. Outputs and every gradient (FC1's weight's from ``backward_dw``) bit-equal to the
    control."""
    row = next(r for r in CPU_ROWS if r.name == "te-fake-e1-delay_wgrad_compute-1f1b_dw")
    copies = {0, 2}  # microbatches whose dispatch_postprocess copies the slot

    def run(rings: bool) -> tuple[list, list]:
        layer = build_layer(row)
        disp = layer.token_dispatcher
        orig = disp.dispatch_postprocess
        current = [0]

        def dispatch_postprocess(hidden, probs):  # megatron's, copying for the microbatches in ``copies``
            out = orig(hidden, probs)
            return (out[0].clone(), *out[1:]) if current[0] in copies else out

        disp.dispatch_postprocess = dispatch_postprocess
        pool = BufferPool("cpu")
        leaves = [x.clone().requires_grad_(True) for x in _inputs(row)]
        held: list[int] = []
        ctx = install(layer, pool, knobs_for(row), tokens=TOKENS) if rings else contextlib.nullcontext()
        with mode_env(mode), ctx:
            outs = {}

            def f(i: int) -> None:
                current[0] = i
                outs[i] = _forward(layer, leaves[i], i)

            def b(i: int) -> None:
                g = torch.Generator().manual_seed(2000 + i)
                outs[i].backward(torch.randn(outs[i].shape, generator=g).to(outs[i].dtype))

            def w() -> None:
                layer.backward_dw()
                held.append(pool.get("dispatch_output").held if rings else -1)

            f(0), f(1), b(0), b(1), w(), w()  # nothing, held, then their backward_dw in order
            f(2), f(3), b(2), w(), b(3), w()  # and the other way round
        params = [p.grad.clone() for _, p in sorted(layer.named_parameters()) if p.grad is not None]
        if rings:
            # W0: microbatch 0 held nothing, microbatch 1's slot stays held for W1; W2 finished nothing again
            assert held == [1, 0, 1, 0], held
            assert pool.stats()["dispatch_output"].deferred_releases >= 2
        return [outs[i].detach() for i in sorted(outs)] + [x.grad for x in leaves], params

    ref, ref_params = run(rings=False)
    got, got_params = run(rings=True)
    assert len(ref_params) == len(got_params) > 0
    assert all(torch.equal(a, b) for a, b in zip(ref + ref_params, got + got_params, strict=True))
