"""The megatron-core hooks on CPU, against a real ``MoELayer`` (gloo, world size 1).

megatron's router moves its weight to CUDA and the dropless all-to-all dispatcher synchronises
through a CUDA stream, so on CPU the layer is driven through its own methods (preprocess,
dispatch, routed_experts_compute, combine, postprocess) with a fixed routing, in pad-to-capacity
mode (no device-to-host sync). The dispatcher's class-level side stream is replaced by a
placeholder for the duration of the module (restored after). The GPU suite runs the full layer.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_cpu import cpu_moe_layer, moe_forward  # noqa: E402
from megatron_cpu import install_exercising_rings as install  # noqa: E402  (EP = 1: see its docstring)
from schedule_harness import MODES, guard, mode_env  # noqa: E402

from bufreuse.config import BufReuseConfig  # noqa: E402
from bufreuse.errors import ConfigError  # noqa: E402
from bufreuse.integrations._compat_megatron import skip_ring_forced_release  # noqa: E402
from bufreuse.integrations.alltoall.functions import RingAllToAll  # noqa: E402
from bufreuse.integrations.core import Held, acquire_with_hint  # noqa: E402
from bufreuse.plan.rules import ReleasePoint  # noqa: E402
from bufreuse.pool import BufferPool, EarlyReuseError, SavedForBackwardError, StaticShapeError  # noqa: E402

HIDDEN, SEQ, MBS = 32, 8, 2
TOKENS = SEQ * MBS


def _layer(num_experts: int, dispatcher: str = "alltoall"):
    return cpu_moe_layer(num_experts, dispatcher, HIDDEN)


def _forward(layer, x):
    return moe_forward(layer, x)


def _interleaved(layer, xs):
    """F0 F1 B0 F2 B1 B2: two microbatches in flight."""
    leaves = [x.clone().requires_grad_(True) for x in xs]
    outs = {}
    for step in ("F0", "F1", "B0", "F2", "B1", "B2"):
        i = int(step[1])
        if step[0] == "F":
            outs[i] = _forward(layer, leaves[i])
        else:
            outs[i].backward(torch.full_like(outs[i], 0.5 + i))
    return [outs[i].detach() for i in range(3)], [x.grad for x in leaves]


def _knobs(slots: int = 2, policy: str = "ring") -> BufReuseConfig:
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=slots,
        moe_hybridep_num_expert_output_buffers=slots,
        moe_bufreuse_dispatch_policy=policy,
        moe_bufreuse_expert_policy=policy,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_experts", [8, 1])
def test_install_matches_control_interleaved(parallel, num_experts: int, mode: str) -> None:
    layer = _layer(num_experts)
    xs = [torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref_out, ref_grad = _interleaved(layer, xs)
    ref_params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    again_out, again_grad = _interleaved(layer, xs)  # the control's own determinism, else equality means nothing
    assert all(torch.equal(a, b) for a, b in zip(ref_out + ref_grad, again_out + again_grad, strict=True))
    assert all(torch.equal(p.grad, ref_params[n]) for n, p in layer.named_parameters() if p.grad is not None)
    layer.zero_grad(set_to_none=True)
    with mode_env(mode):
        pool = BufferPool("cpu")
        with install(layer, pool, _knobs(), tokens=TOKENS) as inst, guard(pool, mode):
            out, grad = _interleaved(layer, xs)
    assert all(torch.equal(a, b) for a, b in zip(ref_out, out, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref_grad, grad, strict=True))
    got_params = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    assert got_params.keys() == ref_params.keys() and ref_params
    assert all(torch.equal(got_params[n], g) for n, g in ref_params.items())
    stats = pool.stats()
    assert {s.acquisitions for s in stats.values()} == {3} and {s.releases for s in stats.values()} == {3}
    # pad mode at EP = 1: the local-expert sort is a no-op view, so the experts read the dispatch
    # slot directly and their (fp32) GEMMs save it: by fact, held until its backward, two in flight.
    assert stats["dispatch_output"].peak_held == 2 and stats["dispatch_output"].deferred_releases == 3
    # the unpermute saves nothing from the FC2 slot here (not deterministic): released in forward.
    assert stats["expert_fc2_output"].peak_held == 1 and stats["expert_fc2_output"].deferred_releases == 0
    # ... which is where the planner's rules put them (pad-to-capacity at EP = 1: the sort is a view).
    points = {name: rule.point for name, rule in inst.expected_release.items()}
    assert points == {"dispatch_output": ReleasePoint.BACKWARD, "expert_fc2_output": ReleasePoint.FORWARD}
    assert inst.release_check() == []


def test_install_logs_each_rings_release_rule_once_at_debug(parallel, caplog) -> None:
    import logging

    with caplog.at_level(logging.DEBUG, logger="bufreuse.integrations"):
        inst = install(_layer(1), BufferPool("cpu"), _knobs(), tokens=TOKENS)
    lines = [r.getMessage() for r in caplog.records if "expected release" in r.getMessage()]
    inst.uninstall()
    assert len(lines) == 2 and all(r.levelno == logging.DEBUG for r in caplog.records if "expected" in r.getMessage())
    assert "'dispatch_output' expected release at backward" in lines[0] and "fp8" in lines[0]
    assert "'expert_fc2_output' expected release at forward" in lines[1]


@pytest.mark.parametrize("policy", ["stream-ordered", "record-stream"])
def test_install_allocator_policies_match_control(parallel, policy: str) -> None:
    layer = _layer(8)
    x = torch.randn(SEQ, MBS, HIDDEN)
    ref = _forward(layer, x).detach()
    assert torch.equal(ref, _forward(layer, x).detach())  # the control is deterministic
    pool = BufferPool("cpu")
    with install(layer, pool, _knobs(0, policy), tokens=TOKENS):
        got = _forward(layer, x)
    assert torch.equal(ref, got.detach())
    assert pool.persistent_bytes() == 0 and pool.stats()["dispatch_output"].releases == 1


def test_uninstall_restores_everything(parallel) -> None:
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import ChunkOffloadHandler
    from megatron.core.pipeline_parallel.utils import ScheduleNode

    layer = _layer(8)
    before = (ScheduleNode.__dict__["_forward"], ChunkOffloadHandler.__dict__["bulk_offload"])
    inst = install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS)
    assert "token_dispatch" in vars(layer.token_dispatcher) and "forward" in vars(layer.experts)
    assert ScheduleNode.__dict__["_forward"] is not before[0]
    with pytest.raises(ConfigError, match="already installed"):
        install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS)
    second = install(_layer(8), BufferPool("cpu"), _knobs(), tokens=TOKENS)  # another model chunk
    inst.uninstall()
    assert ScheduleNode.__dict__["_forward"] is not before[0]  # still needed by the second chunk
    second.uninstall()
    inst.uninstall()  # idempotent
    assert not {"token_dispatch", "dispatch_postprocess", "token_combine"} & set(vars(layer.token_dispatcher))
    assert "forward" not in vars(layer.experts) and not {"routed_experts_compute", "_bufreuse_hooked"} & set(
        vars(layer)
    )
    assert (ScheduleNode.__dict__["_forward"], ChunkOffloadHandler.__dict__["bulk_offload"]) == before


def test_install_refuses_other_dispatchers(parallel) -> None:
    layer = _layer(8, dispatcher="allgather")
    with pytest.raises(ConfigError, match="MoEAlltoAllTokenDispatcher"):
        install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS)


def test_schedule_node_free_input_skips_ring_storage(parallel) -> None:
    from megatron.core.pipeline_parallel.utils import ScheduleNode

    class CpuNode(ScheduleNode):  # the real node, minus the CUDA stream context
        @contextlib.contextmanager
        def stream_acquire_context(self, name=None):
            yield

    def node() -> ScheduleNode:
        return CpuNode(lambda t: t * 2, None, None, free_input=True)

    pool = BufferPool("cpu")
    with install(_layer(8), pool, _knobs(), tokens=TOKENS):
        slot = pool.acquire("dispatch_output", (4, HIDDEN))
        slot.fill_(1.0)
        out = node().forward((slot,))
        assert slot.untyped_storage().size() > 0 and bool((slot == 1).all()) and bool((out == 2).all())
        pool.release("dispatch_output", slot)
    victim_pool = BufferPool("cpu")
    victim_pool.register("dispatch_output", policy="ring", num_slots=1, max_shape=(4, HIDDEN), dtype=torch.float32)
    victim = victim_pool.acquire("dispatch_output")
    with pytest.raises(RuntimeError):  # unhooked megatron calls record_stream/resize_ on the slot
        node().forward((victim,))


def test_offload_forced_release_filters_ring_storage() -> None:
    pool = BufferPool("cpu")
    pool.register("dispatch_output", policy="ring", num_slots=1, max_shape=(4, 8), dtype=torch.float32)
    slot, plain = pool.acquire("dispatch_output"), torch.zeros(4, 8)
    seen = []
    wrapped = skip_ring_forced_release(pool.is_ring_storage)(lambda self, *a, **k: seen.append((a, k)))
    wrapped(None, "fused_group_mlp", [slot, plain])  # 0.19 signature (name, tensors)
    wrapped(None, [slot, plain])  # 0.16 signature (tensors)
    wrapped(None, "expert_fc1", forced_released_tensors=[slot, plain])
    kept = [k.get("forced_released_tensors", a[-1] if a else None) for a, k in seen]
    assert all(len(t) == 1 and t[0] is plain for t in kept)
    assert pool.owns("dispatch_output", slot)  # the probe changed no ring state


def test_release_of_saved_slot_waits_for_its_backward_by_fact() -> None:
    pool = BufferPool("cpu", debug=False)
    pool.register("dispatch_output", policy="ring", num_slots=2, max_shape=(8, 4), dtype=torch.float32)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(8, 4, requires_grad=True)
    box: list[Held] = []
    with pool.track_saved():
        y = RingAllToAll.apply(x, pool, "dispatch_output", None, None, None, False, box)
        z = y @ w  # saves y (ring storage) for backward, like a bf16 expert GEMM
    with pytest.raises(SavedForBackwardError):
        pool.release("dispatch_output", box[0].tensor)  # a plain release would let the slot be overwritten
    box[0].release()
    assert box[0].deferred and pool.get("dispatch_output").held == 1
    z.sum().backward()
    assert pool.get("dispatch_output").held == 0 and pool.stats()["dispatch_output"].releases == 1


def test_early_reuse_error_names_the_knob() -> None:
    pool = BufferPool("cpu")
    pool.register("expert_fc2_output", policy="ring", num_slots=1, max_shape=(8, 4), dtype=torch.float32)
    acquire_with_hint(pool, "expert_fc2_output", (8, 4))
    with pytest.raises(EarlyReuseError, match="moe_hybridep_num_expert_output_buffers to at least 2"):
        acquire_with_hint(pool, "expert_fc2_output", (8, 4))


def test_deterministic_unpermute_defers_fc2_release_by_fact(parallel) -> None:
    """Under deterministic algorithms the unpermute's index_add_ saves the FC2 slot (seen on the H200)."""
    layer = _layer(1)
    xs = [torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ref_out, ref_grad = _interleaved(layer, xs)
        pool = BufferPool("cpu")
        with install(layer, pool, _knobs(), tokens=TOKENS) as inst:  # production mode: no guard
            out, grad = _interleaved(layer, xs)
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(a, b) for a, b in zip(ref_out + ref_grad, out + grad, strict=True))
    stats = pool.stats()["expert_fc2_output"]
    assert stats.peak_held == 2 and stats.deferred_releases == 3  # index_add_ saved it: by fact, not by config
    # The rule (deterministic_mode, read as torch's deterministic flag) says the same: after backward.
    rule = inst.expected_release["expert_fc2_output"]
    assert rule.point is ReleasePoint.BACKWARD and "deterministic_mode" in rule.fields
    assert inst.release_check() == []


def test_release_rule_disagreement_is_reported_loudly_in_debug_mode(parallel, caplog) -> None:
    """A rule the observed release contradicts: release_check names it, debug uninstall warns with the counts."""
    import logging

    from bufreuse.integrations.core import ReleaseRuleWarning

    layer = _layer(1)
    xs = [torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # the unpermute saves the FC2 slot ...
    try:
        inst = install(layer, BufferPool("cpu", debug=True), _knobs(), tokens=TOKENS)
        inst.expected_release.clear()
        inst.expect(layer, "alltoall", {**vars(layer.config), "deterministic_mode": False})  # ... a rule says not
        _interleaved(layer, xs)
    finally:
        torch.use_deterministic_algorithms(was)
    (bad,) = inst.release_check()
    assert (bad.ring, bad.rule.point, bad.acquisitions, bad.deferred, bad.expected_deferred) == (
        "expert_fc2_output", ReleasePoint.FORWARD, 3, 3, 0,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="bufreuse.integrations"), pytest.warns(ReleaseRuleWarning) as w:
        inst.uninstall()
    text = str(w[0].message)
    assert "'expert_fc2_output'" in text and "at forward" in text and "3 of 3" in text and "predicts 0" in text
    assert "planner's depth" in text and "Fewer releases waited" not in text  # more deferrals: only the depth
    assert "expert_fc2_output" in caplog.text


def test_data_dependent_rule_accepts_an_earlier_release_but_not_a_later_one(parallel) -> None:
    """A data-dependent backward rule (TE's Fp8Unpadding) agrees with releases at forward; a forward rule
    never agrees with a deferral."""
    import dataclasses

    layer = _layer(1)
    xs = [torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    inst = install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS)  # deterministic off: FC2 released at forward
    try:
        _interleaved(layer, xs)
        rule = inst.expected_release["expert_fc2_output"]
        assert rule.point is ReleasePoint.FORWARD and inst.release_check() == []
        inst.expected_release["expert_fc2_output"] = dataclasses.replace(rule, point=ReleasePoint.BACKWARD)
        (bad,) = inst.release_check()
        assert (bad.deferred, bad.expected_deferred) == (0, 3)
        # fewer deferrals than the rule: a missed save in production is one explanation, and the text says so
        assert "Fewer releases waited" in str(bad) and "BUFREUSE_DEBUG=1" in str(bad)
        inst.expected_release["expert_fc2_output"] = dataclasses.replace(
            rule, point=ReleasePoint.BACKWARD, data_dependent=True
        )
        assert inst.release_check() == []
    finally:
        inst.uninstall()


def test_dtype_mismatch_is_refused_not_cast() -> None:
    pool = BufferPool("cpu")
    pool.register("dispatch_output", policy="ring", num_slots=1, max_shape=(8, 4), dtype=torch.bfloat16)
    with pytest.raises(StaticShapeError, match="params_dtype"):
        acquire_with_hint(pool, "dispatch_output", (8, 4), torch.float32)
    assert pool.stats()["dispatch_output"].releases == 1  # nothing left held


# --- num_slots='auto' through install(): the planner's first depth, the user's cap -------------------

AUTO_TOKENS = 8192  # a 1 MiB slot (8192 rows x 32 x fp32), so the MiB cap counts slots


def _auto_knobs(cap_mib: int = 0) -> BufReuseConfig:
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers="auto",
        moe_hybridep_num_expert_output_buffers="auto",
        moe_bufreuse_auto_max_mib=cap_mib,
    )


def test_auto_ring_starts_at_the_planners_figure(parallel) -> None:
    from bufreuse.integrations.core import ConfigView
    from bufreuse.plan import initial_slots

    layer = _layer(1)
    layer.config.num_layers, layer.config.pipeline_model_parallel_size = 8, 4  # what the planner reads
    planned = initial_slots(ConfigView(layer.config), "dispatch", num_microbatches=8, pp_rank=0)
    assert planned == 8  # 1F1B rank 0 of 4, bf16/fp32 experts save the slot: 2 layers x 4 in flight
    pool = BufferPool("cpu")
    with install(layer, pool, _auto_knobs(), tokens=TOKENS, num_microbatches=8, pp_rank=0) as inst:
        assert inst.auto_start == {"dispatch_output": 8, "expert_fc2_output": 1}
        ring = pool.get("dispatch_output")
        assert ring.num_slots == 8 and pool.stats()["dispatch_output"].settled_slots == 8
        assert ring.max_bytes is not None  # no cap (0): the pool still gets one, and grows without bound
    default = BufferPool("cpu")
    with install(_layer(1), default, _auto_knobs(), tokens=TOKENS) as inst:  # no schedule: the pool default
        assert inst.auto_start == {"dispatch_output": 2, "expert_fc2_output": 2}


def test_auto_ring_grows_within_the_cap_and_logs_the_settled_depth(parallel, caplog) -> None:
    import logging

    layer = _layer(1)  # one layer, no pipelining: the plan says 1 slot; the interleaved order needs 2
    xs = [torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref_out, ref_grad = _interleaved(layer, xs)
    pool = BufferPool("cpu")
    knobs = _auto_knobs(cap_mib=3)
    with (
        caplog.at_level(logging.INFO, logger="bufreuse"),
        install(layer, pool, knobs, tokens=AUTO_TOKENS, num_microbatches=3) as inst,
    ):
        assert inst.auto_start["dispatch_output"] == 1
        out, grad = _interleaved(layer, xs)
    assert all(torch.equal(a, b) for a, b in zip(ref_out + ref_grad, out + grad, strict=True))
    s = pool.stats()["dispatch_output"]
    assert (s.grown, s.settled_slots) == (1, 2) and pool.persistent_bytes() <= 2 * 3 * 2**20
    settled = [r.getMessage() for r in caplog.records if "settled at" in r.getMessage()]
    assert sum("'dispatch_output'" in m and "settled at 2 slots" in m for m in settled) == 1, settled


def test_auto_ring_cap_is_honoured(parallel, caplog) -> None:
    import logging

    layer = _layer(1)
    xs = [torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    pool = BufferPool("cpu")
    with caplog.at_level(logging.WARNING, logger="bufreuse.integrations"):
        inst = install(layer, pool, _auto_knobs(cap_mib=1), tokens=AUTO_TOKENS)  # 1 MiB: one slot
    assert "holds 1 slot(s), below the default depth 2" in caplog.text
    assert pool.get("dispatch_output").num_slots == 1 and pool.get("dispatch_output").max_bytes == 2**20
    with pytest.raises(EarlyReuseError, match=r"max_bytes=1048576.*moe_bufreuse_auto_max_mib.*at least 2 slots"):
        _interleaved(layer, xs)  # the second microbatch's dispatch while the first is saved for backward
    pool.reset()
    inst.uninstall()
    assert pool.stats()["dispatch_output"].grown == 0


def test_auto_ring_cap_below_one_slot_is_refused_by_name(parallel) -> None:
    layer = _layer(1)
    with pytest.raises(ConfigError, match=r"moe_bufreuse_auto_max_mib=1 holds no 'dispatch_output' slot.*>= 2"):
        install(layer, BufferPool("cpu"), _auto_knobs(cap_mib=1), tokens=2 * AUTO_TOKENS)
    assert "token_dispatch" not in vars(layer.token_dispatcher)  # nothing stayed replaced


@pytest.mark.parametrize(
    ("field", "value", "key"),
    [
        ("cuda_graph_impl", "transformer_engine", "no_per_layer_cuda_graphs"),
        ("moe_paged_stash", True, "no_paged_stash"),
        ("cpu_offloading", True, "no_te_cpu_offload"),
    ],
)
def test_install_refuses_nested_saved_tensor_hooks_and_per_layer_graphs(parallel, field, value, key) -> None:
    layer = _layer(8)
    with install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS) as inst:  # control
        assert inst.layers == 1
    setattr(layer.config, field, value)
    with pytest.raises(ConfigError, match=key):
        install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS)
    assert "token_dispatch" not in vars(layer.token_dispatcher)
