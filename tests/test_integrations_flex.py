"""The HybridEP flex-dispatcher wiring on CPU: real megatron-core 0.19.2 layer code, fake DeepEP and TE.

What is real: ``TransformerConfig`` (flex dispatcher, ``hybridep`` backend, rank capacity factor or pad-to-capacity,
op fuser), ``MoELayer`` methods, ``MoEFlexTokenDispatcher`` and ``_HybridEPManager``
(``setup_metadata`` / ``dispatch`` / ``combine``), ``fused_a2a.HybridEPDispatch`` /
``HybridEPCombine`` (autograd) and ``init_hybrid_ep_buffer``, ``TEGroupedMLP.forward`` /
``_fused_forward``. What is fake (none installs here): DeepEP's ``HybridEPBuffer``
(``tests/fakes/deep_ep_hybrid.py``, the signatures of DeepEP hybrid-ep @ 94a9f8f6 plus exactly
``output_token=``, checked against megatron's calls in ``tests/test_fake_deep_ep_contract.py``),
TE's op-fuser sequence and grouped linears (``tests/fakes/te_grouped_linear.py``, the names
megatron-core 0.19.2 uses). Shims, all restored after each test: fused_a2a's
``HAVE_HYBRIDEP`` / ``HybridEPBuffer`` / ``_hybrid_ep_buffer``, the two thin ``hybrid_ep_dispatch`` /
``hybrid_ep_combine`` wrappers megatron defines only when DeepEP imports (megatron's own source of
that block, run in ``fused_a2a``'s namespace), ``experts.OUTPUT_BUFFER_KEY``, and
``torch.zeros(device='cuda')`` while ``_HybridEPManager`` is constructed (its overflow flag). Set
after construction because megatron refuses them without TE: ``fp8`` on the config and
``TEGroupedMLP``'s op-fuser switch. The router is bypassed with a fixed routing (it moves its weight to CUDA).
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from fakes import deep_ep_hybrid as dep  # noqa: E402
from fakes import te_grouped_linear as te  # noqa: E402
from megatron_cpu import single_process_model_parallel  # noqa: E402
from megatron_hybridep import megatron_wrappers  # noqa: E402

from bufreuse.config import BufReuseConfig, static_bounds  # noqa: E402
from bufreuse.errors import ConfigError  # noqa: E402
from bufreuse.integrations.hybridep.output_token import OutputTokenInjector  # noqa: E402
from bufreuse.integrations.megatron import install  # noqa: E402
from bufreuse.plan.rules import REFUSALS  # noqa: E402
from bufreuse.pool import BufferPool, EarlyReuseError  # noqa: E402

HIDDEN, SEQ, MBS, EXPERTS, TOPK, FACTOR = 32, 16, 4, 4, 2, 8.0
TOKENS = SEQ * MBS  # 64 tokens; budget int(64 x 2 x 8) = 1024 rows = 4 experts x 256 (op-fuser alignment)


@pytest.fixture(scope="module")
def parallel():
    with single_process_model_parallel():
        yield


@pytest.fixture
def hybridep(monkeypatch, parallel):
    """megatron-core's fused_a2a as if DeepEP with HybridEP (the fake) were installed; undone after."""
    from megatron.core.transformer.moe import experts, fused_a2a
    from megatron.core.transformer.moe import token_dispatcher as td

    monkeypatch.setattr(fused_a2a, "HAVE_HYBRIDEP", True)
    monkeypatch.setattr(fused_a2a, "HybridEPBuffer", dep.HybridEPBuffer, raising=False)
    monkeypatch.setattr(fused_a2a, "_hybrid_ep_buffer", None)
    for name, fn in megatron_wrappers(fused_a2a).items():  # megatron's own `if HAVE_HYBRIDEP:` definitions
        for mod in (fused_a2a, td):
            monkeypatch.setattr(mod, name, fn)
    monkeypatch.setattr(experts, "OUTPUT_BUFFER_KEY", te.ops_grouped_linear.OUTPUT_BUFFER_KEY)
    return fused_a2a


class _CpuZeros(types.SimpleNamespace):
    """``torch`` for token_dispatcher while a manager is built: ``zeros(device='cuda')`` lands on CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)


def _layer(monkeypatch, fp8: str | None = "e4m3", fused: bool = True, sequential: bool = False, **bound: object):
    """A flex/HybridEP ``MoELayer`` with ``TEGroupedMLP`` experts: the op fuser (sm100) or, ``fused=False``, the
    unfused module whose FC2 is megatron's ``TEGroupedLinear`` over TE's ``GroupedLinear(out=)`` (Hopper)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import token_dispatcher as td
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="hybridep",
        use_transformer_engine_op_fuser=True,
        moe_grouped_gemm=True,
        use_cpu_initialization=True,
        add_bias_linear=False,
        **(bound or {"moe_expert_rank_capacity_factor": FACTOR}),
    )
    with monkeypatch.context() as m:
        m.setattr(td, "torch", _CpuZeros())
        layer = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False).submodules.mlp(config=cfg)
    if sequential:  # the local spec's SequentialMLP experts, as built
        cfg.fp8 = fp8
        return layer
    cfg.use_transformer_engine_op_fuser = False  # TEGroupedMLP asserts TE's fused ops exist when True
    linear = te.MegatronGroupedLinear if fused else te.MegatronTEGroupedLinear
    subs = GroupedMLPSubmodules(linear_fc1=linear, linear_fc2=linear)
    mlp = TEGroupedMLP(EXPERTS, cfg, subs, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    if fused:
        cfg.use_transformer_engine_op_fuser = True
        mlp._with_fused_impl = True
        mlp._fused_ops = (te.TrainableFusedGroupedMLP(mlp.linear_fc1, mlp.linear_fc2),)
    layer.experts = mlp
    cfg.fp8 = fp8  # megatron refuses fp8 at construction without TE
    return layer


def _routing(i: int):
    g = torch.Generator().manual_seed(100 + i)
    top = torch.softmax(torch.randn(TOKENS, EXPERTS, generator=g), -1).topk(TOPK)
    routing = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, top.indices, True)
    return routing, torch.zeros(routing.shape).scatter(1, top.indices, top.values)


def _balanced_routing(i: int):
    """Every expert gets exactly TOKENS x TOPK / EXPERTS = 32 tokens (token t: experts t and t + 1 mod 4): with
    capacity factor 1.0 each expert's capacity is 32, so megatron's pad-to-capacity splits (capacity x EP per
    expert) line up with HybridEP's layout (each expert's rows padded to pad_multiple, packed). With uneven
    routing they do not: megatron-core 0.19.2 hands the unfused experts capacity-sized splits over rows that
    HybridEP packed per expert, the tail unwritten (docs/megatron.md)."""
    g = torch.Generator().manual_seed(200 + i)
    t = torch.arange(TOKENS)
    idx = torch.stack([t % EXPERTS, (t + 1) % EXPERTS], 1)
    routing = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, idx, True)
    return routing, torch.zeros(routing.shape).scatter(1, idx, torch.rand(TOKENS, TOPK, generator=g))


ROUTING = {"random": _routing, "balanced": _balanced_routing}


def _dispatch(layer, x, i, routing: str = "random"):
    routing, probs = ROUTING[routing](i)
    h, p = layer.preprocess(x, probs, routing)
    return layer.dispatch(h, p)


def _forward(layer, x, i, routing: str = "random"):
    d, p = _dispatch(layer, x, i, routing)
    out, _ = layer.routed_experts_compute(d, p)
    return layer.postprocess(layer.combine(out), None)


def _interleaved(layer, xs, routing: str = "random"):
    """F0 F1 B0 F2 B1 B2: two microbatches in flight."""
    leaves = [x.clone().requires_grad_(True) for x in xs]
    outs = {}
    for step in ("F0", "F1", "B0", "F2", "B1", "B2"):
        i = int(step[1])
        if step[0] == "F":
            outs[i] = _forward(layer, leaves[i], i, routing)
        else:
            outs[i].backward(torch.full_like(outs[i], 0.5 + i))
    return [outs[i].detach() for i in range(3)], [x.grad for x in leaves]


def _knobs(slots: int = 2) -> BufReuseConfig:
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=slots,
        moe_hybridep_num_expert_output_buffers=slots,
    )


def _inputs():
    return [torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def test_install_hands_ring_slots_to_deepep_and_te_and_matches_control(hybridep, monkeypatch) -> None:
    layer = _layer(monkeypatch)
    xs = _inputs()
    ref_out, ref_grad = _interleaved(layer, xs)
    ref_params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    again_out, again_grad = _interleaved(layer, xs)  # the control's own determinism, else equality means nothing
    assert all(torch.equal(a, b) for a, b in zip(ref_out + ref_grad, again_out + again_grad, strict=True))
    assert all(torch.equal(p.grad, ref_params[n]) for n, p in layer.named_parameters() if p.grad is not None)
    layer.zero_grad(set_to_none=True)
    buffer = hybridep._hybrid_ep_buffer
    assert isinstance(buffer, dep.HybridEPBuffer) and buffer.output_tokens == []
    ops = layer.experts._fused_ops[0]
    ops.received_buffers.clear()
    pool = BufferPool("cpu")
    with install(layer, pool, _knobs(), tokens=TOKENS) as inst, pool.autograd_guard():
        assert inst.layers == 1 and isinstance(hybridep._hybrid_ep_buffer, OutputTokenInjector)
        out, grad = _interleaved(layer, xs)
    assert all(torch.equal(a, b) for a, b in zip(ref_out, out, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref_grad, grad, strict=True))
    assert {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}.keys() == ref_params.keys()
    assert all(torch.equal(p.grad, ref_params[n]) for n, p in layer.named_parameters() if p.grad is not None)
    # DeepEP got the dispatch slots, TE got (detached aliases of) the FC2 slots; 2 slots rotate.
    tokens_in = [t.data_ptr() for t in buffer.output_tokens]
    fc2_in = [b.data_ptr() for b in ops.received_buffers]
    assert len(tokens_in) == 3 and tokens_in[0] != tokens_in[1] and tokens_in[2] == tokens_in[0]
    assert len(fc2_in) == 3 and fc2_in[0] != fc2_in[1] and fc2_in[2] == fc2_in[0]
    assert all(pool.is_ring_storage(t) for t in buffer.output_tokens + ops.received_buffers)
    assert not any(b.requires_grad for b in ops.received_buffers)
    assert buffer.calls.count("dispatch+output_token") == 3  # backward dispatches (of combine) stay plain
    stats = pool.stats()
    for name in ("dispatch_output", "expert_fc2_output"):
        assert stats[name].acquisitions == stats[name].releases == 3 and stats[name].peak_held == 1


def _unfused_layer(monkeypatch):
    """The seed's shape of run on Hopper: unfused TEGroupedMLP, pad-to-capacity at factor 1.0 (capacity 32)."""
    return _layer(monkeypatch, fused=False, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
@pytest.mark.parametrize("quantized", [True, False], ids=["fp8-saves-a-copy", "bf16-saves-the-slot"])
def test_unfused_te_grouped_mlp_writes_fc2_into_the_ring_and_matches_control(
    hybridep, monkeypatch, debug, quantized
) -> None:
    """Hopper's route: no op fuser; FC2 (megatron's TEGroupedLinear over TE's GroupedLinear) gets ``out=`` a slot,
    HybridEP's combine reads it and releases it; both rings on, two microbatches in flight, equal to the control.

    FP8 GEMMs save a quantized copy of their input: each dispatch slot is free after its forward (one held at a
    time). bf16 GEMMs save the slot itself: every release waits for FC1's backward (release by fact), so two are
    held while two microbatches are in flight, and the result is still the control's.
    """
    monkeypatch.setattr(te.TEGroupedLinearBase, "quantized", quantized)
    layer = _unfused_layer(monkeypatch)
    assert not layer.experts._with_fused_impl
    xs = _inputs()
    ref_out, ref_grad = _interleaved(layer, xs, "balanced")
    ref_params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    again_out, again_grad = _interleaved(layer, xs, "balanced")  # the control is deterministic, else equality is void
    assert all(torch.equal(a, b) for a, b in zip(ref_out + ref_grad, again_out + again_grad, strict=True))
    layer.zero_grad(set_to_none=True)
    fc2 = layer.experts.linear_fc2
    fc2.received_out.clear()
    pool = BufferPool("cpu", debug=debug)
    with install(layer, pool, _knobs(), tokens=TOKENS) as inst:
        assert inst.layers == 1 and not inst.unused
        if debug:  # every slot starts as NaN: a row the kernels or TE leave unwritten would show
            _poison_all(pool, "dispatch_output", 2)
            _poison_all(pool, "expert_fc2_output", 2)
        out, grad = _interleaved(layer, xs, "balanced")
    assert all(torch.equal(a, b) for a, b in zip(ref_out + ref_grad, out + grad, strict=True))
    params = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    assert params.keys() == ref_params.keys()
    assert all(torch.equal(params[n], ref_params[n]) for n in params)
    received = [o for o in fc2.received_out if o is not None]  # TE got out= on every forward, FC1 never
    assert len(received) == 3 and all(pool.is_ring_storage(o) for o in received)
    assert not any(o is not None for o in layer.experts.linear_fc1.received_out)
    assert received[0].data_ptr() != received[1].data_ptr() and received[2].data_ptr() == received[0].data_ptr()
    stats, poisoned = pool.stats(), 2 if debug else 0
    for name in ("dispatch_output", "expert_fc2_output"):
        assert stats[name].acquisitions - poisoned == stats[name].releases - poisoned == 3
    dispatch = stats["dispatch_output"]  # the peak counts the poisoning's two acquisitions in debug mode
    assert (dispatch.peak_held, dispatch.deferred_releases) == ((max(1, poisoned), 0) if quantized else (2, 3))
    fc2 = stats["expert_fc2_output"]  # FC2 saves its input, never its output: free at combine
    assert (fc2.peak_held, fc2.deferred_releases) == (max(1, poisoned), 0)


def test_unfused_fc2_slot_is_held_until_hybridep_combine(hybridep, monkeypatch) -> None:
    """The FC2 slot's last reader is HybridEP's combine (no unpadding on this path): released there, not before."""
    monkeypatch.setattr(te.TEGroupedLinearBase, "quantized", True)  # FP8: FC1 saves a copy, the slot is free
    layer = _unfused_layer(monkeypatch)
    pool = BufferPool("cpu")
    x = _inputs()[0].requires_grad_(True)
    with install(layer, pool, _knobs(), tokens=TOKENS):
        d, p = _dispatch(layer, x, 0, "balanced")
        held = lambda n: pool.stats()[n].acquisitions - pool.stats()[n].releases  # noqa: E731
        out, _ = layer.routed_experts_compute(d, p)
        assert (held("dispatch_output"), held("expert_fc2_output")) == (0, 1)
        assert pool.is_ring_storage(out)  # combine's input is the slot itself
        y = layer.combine(out)
        assert (held("dispatch_output"), held("expert_fc2_output")) == (0, 0)
        layer.postprocess(y, None).sum().backward()


def test_expert_ring_on_hybridep_with_sequential_experts_is_refused_in_one_line(hybridep, monkeypatch) -> None:
    layer = _layer(monkeypatch, sequential=True)
    assert type(layer.experts).__name__ == "SequentialMLP"
    knobs = BufReuseConfig(moe_hybridep_num_expert_output_buffers=2)
    with pytest.raises(ConfigError, match="needs TEGroupedMLP experts") as err:
        install(layer, BufferPool("cpu"), knobs, tokens=TOKENS)
    assert "\n" not in str(err.value).strip() and "forward" not in vars(layer.experts)


def test_slots_released_at_final_consumers(hybridep, monkeypatch) -> None:
    layer = _layer(monkeypatch)
    pool = BufferPool("cpu")
    x = _inputs()[0].requires_grad_(True)
    with install(layer, pool, _knobs(), tokens=TOKENS):
        d, p = _dispatch(layer, x, 0)
        mgr = layer.token_dispatcher._comm_manager
        assert pool.owns("dispatch_output", d) and d.shape[0] == mgr.num_permuted_tokens
        held = lambda n: pool.stats()[n].acquisitions - pool.stats()[n].releases  # noqa: E731
        assert (held("dispatch_output"), held("expert_fc2_output")) == (1, 0)
        out, _ = layer.routed_experts_compute(d, p)  # experts: final reader of the dispatch slot
        assert (held("dispatch_output"), held("expert_fc2_output")) == (0, 1)
        assert pool.is_ring_storage(out)
        y = layer.combine(out)  # HybridEP combine: final reader of the FC2 slot
        assert (held("dispatch_output"), held("expert_fc2_output")) == (0, 0)
        layer.postprocess(y, None).sum().backward()
    bound = static_bounds(layer.config, _knobs(), path="hybridep", tokens=TOKENS)["dispatch"]
    assert bound.rows == int(TOKENS * TOPK * FACTOR) == d.shape[0]


def test_early_reuse_names_the_knob(hybridep, monkeypatch) -> None:
    layer = _layer(monkeypatch)
    pool = BufferPool("cpu")
    x = _inputs()[0]
    with install(layer, pool, _knobs(slots=1), tokens=TOKENS), torch.no_grad():
        d, p = _dispatch(layer, x, 0)
        with pytest.raises(EarlyReuseError, match="moe_hybridep_num_dispatch_output_buffers to at least 2"):
            _dispatch(layer, x, 1)
        assert hybridep._hybrid_ep_buffer.output_tokens[-1].data_ptr() == d.data_ptr()  # nothing armed leaked
        layer.routed_experts_compute(d, p)
        d2, p2 = _dispatch(layer, x, 1)
        with pytest.raises(EarlyReuseError, match="moe_hybridep_num_expert_output_buffers to at least 2"):
            layer.routed_experts_compute(d2, p2)


def test_install_fails_early_naming_the_missing_api(hybridep, monkeypatch) -> None:
    from megatron.core.transformer.moe import experts

    layer = _layer(monkeypatch)
    mgr = layer.token_dispatcher._comm_manager
    init = hybridep.init_hybrid_ep_buffer
    monkeypatch.setattr(hybridep, "HybridEPBuffer", dep.HybridEPBufferUpstream)
    with pytest.raises(ConfigError, match=r"dispatch_with_permute has no output_token"):
        install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS)
    assert "dispatch" not in vars(mgr) and "forward" not in vars(layer.experts)
    assert hybridep.init_hybrid_ep_buffer is init
    monkeypatch.setattr(hybridep, "HybridEPBuffer", dep.HybridEPBuffer)
    monkeypatch.setattr(experts, "OUTPUT_BUFFER_KEY", None)
    layer.config.fp8 = None
    with pytest.raises(ConfigError, match="FP8/FP4") as err:
        install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS)
    assert "OUTPUT_BUFFER_KEY" in str(err.value)  # every unmet requirement in one error


def test_uninstall_restores_originals_exactly(hybridep, monkeypatch) -> None:
    layer = _layer(monkeypatch)
    with torch.no_grad():
        _forward(layer, _inputs()[0], 0)  # megatron's own per-step attributes exist from here on
    objs = [layer, layer.experts, layer.token_dispatcher, layer.token_dispatcher._comm_manager]
    before = [dict(vars(o)) for o in objs]
    init, buffer = hybridep.init_hybrid_ep_buffer, hybridep._hybrid_ep_buffer
    inst = install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS)
    assert hybridep.init_hybrid_ep_buffer is not init and hybridep._hybrid_ep_buffer.inner is buffer
    with torch.no_grad():
        _forward(layer, _inputs()[0], 1)
    inst.uninstall()
    assert hybridep.init_hybrid_ep_buffer is init and hybridep._hybrid_ep_buffer is buffer
    for obj, b in zip(objs, before, strict=True):
        a = vars(obj)
        assert a.keys() == b.keys()
        assert all(a[k] is v for k, v in b.items() if callable(v) and not isinstance(v, torch.nn.Module))
        for name in ("dispatch", "forward", "token_combine", "routed_experts_compute"):
            if hasattr(type(obj), name):
                assert getattr(obj, name).__func__ is getattr(type(obj), name)
    with torch.no_grad():
        _forward(layer, _inputs()[0], 2)  # plain megatron again
    assert buffer.calls[-2:] == ["dispatch", "combine"]


def test_uninstall_unwraps_a_buffer_created_while_installed(hybridep, monkeypatch) -> None:
    layer = _layer(monkeypatch)
    assert hybridep._hybrid_ep_buffer is None
    inst = install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS)
    with torch.no_grad():
        _forward(layer, _inputs()[0], 0)  # megatron's init_hybrid_ep_buffer runs inside dispatch: wrapped
    assert isinstance(hybridep._hybrid_ep_buffer, OutputTokenInjector)
    inst.uninstall()
    assert type(hybridep._hybrid_ep_buffer) is dep.HybridEPBuffer
    assert hybridep._hybrid_ep_buffer.calls == ["dispatch+output_token", "combine"]


def test_experts_that_save_the_dispatch_slot_defer_its_release_by_fact(hybridep, monkeypatch) -> None:
    """A bf16-like GEMM saves its input (the slot itself): the release waits for its backward, bit-equal."""
    monkeypatch.setattr(te._QuantizedCopy, "apply", staticmethod(lambda x: x))  # no quantized copy
    layer = _layer(monkeypatch)
    xs = _inputs()
    ref_out, ref_grad = _interleaved(layer, xs)
    pool = BufferPool("cpu", debug=False)
    with install(layer, pool, _knobs(), tokens=TOKENS):
        out, grad = _interleaved(layer, xs)
    assert all(torch.equal(a, b) for a, b in zip(ref_out + ref_grad, out + grad, strict=True))
    s = pool.stats()["dispatch_output"]
    assert s.deferred_releases == 3 and s.peak_held == 2 and s.releases == 3


def test_stream_ordered_policy_needs_no_fp8_and_matches_control(hybridep, monkeypatch) -> None:
    """The allocator policy only drops the pool's reference: bf16 experts may save the dispatch output."""
    monkeypatch.setattr(te._QuantizedCopy, "apply", staticmethod(lambda x: x))
    layer = _layer(monkeypatch, fp8=None)
    xs = _inputs()
    ref_out, ref_grad = _interleaved(layer, xs)
    knobs = BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=0,
        moe_hybridep_num_expert_output_buffers=1,
        moe_bufreuse_dispatch_policy="stream-ordered",
        moe_bufreuse_expert_policy="stream-ordered",
    )
    pool = BufferPool("cpu")
    with install(layer, pool, knobs, tokens=TOKENS):
        out, grad = _interleaved(layer, xs)
    assert all(torch.equal(a, b) for a, b in zip(ref_out + ref_grad, out + grad, strict=True))
    assert len(hybridep._hybrid_ep_buffer.output_tokens) == 3
    assert {s.acquisitions for s in pool.stats().values()} == {3}


def test_pad_to_capacity_bound_matches_the_manager(hybridep, monkeypatch) -> None:
    # capacity x EP x local = 64 x 4 = 256 rows: a multiple of the op-fuser pad (256), which DeepEP asserts
    # in non-blocking mode; factor 1.0 (128 rows) trips that assertion in megatron-core 0.19.2 with FP8.
    layer = _layer(monkeypatch, moe_expert_capacity_factor=2.0, moe_pad_expert_input_to_capacity=True)
    knobs = _knobs()
    bound = static_bounds(layer.config, knobs, path="hybridep", tokens=TOKENS)["dispatch"]
    pool = BufferPool("cpu")
    with install(layer, pool, knobs, tokens=TOKENS), torch.no_grad():
        d, _ = _dispatch(layer, _inputs()[0], 0)
        mgr = layer.token_dispatcher._comm_manager
        assert d.shape[0] == mgr.num_permuted_tokens == mgr.capacity * EXPERTS == bound.rows  # capacity x EP x local
        assert hybridep._hybrid_ep_buffer.output_tokens[-1].data_ptr() == d.data_ptr()


@pytest.mark.parametrize(
    ("field", "value", "key"),
    [
        ("moe_apply_probs_on_input", True, "no_hybridep_probs_on_input"),
        ("cuda_graph_impl", "transformer_engine", "no_per_layer_cuda_graphs"),
        ("cuda_graph_impl", "local", "no_per_layer_cuda_graphs"),
        ("moe_paged_stash", True, "no_paged_stash"),
        ("cpu_offloading", True, "no_te_cpu_offload"),
    ],
)
def test_install_refuses_the_hybridep_ring_by_name(hybridep, monkeypatch, field, value, key) -> None:
    """probs * hidden saves the slot the HybridEP adapter releases at the forward (silently wrong gradients);
    per-layer graphs bake slot addresses; paged stash / TE CPU offload push saved-tensor hooks that do not nest."""
    layer = _layer(monkeypatch)
    with install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS) as inst:  # control: the same layer installs
        assert inst.layers == 1
    setattr(layer.config, field, value)
    mgr = layer.token_dispatcher._comm_manager
    with pytest.raises(ConfigError, match=key) as err:
        install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS)
    assert next(r.fix for r in REFUSALS if r.key == key) in str(err.value)
    assert "dispatch" not in vars(mgr) and "forward" not in vars(layer.experts)  # nothing stays hooked


TAIL_FACTOR = 12.0
"""Rank capacity giving a budget of int(64 x 2 x 12) = 1,536 rows: 4 experts x 256 (the op fuser's pad multiple)
= 1,024 rows inside the padded splits, and 512 rows past them that no dispatch writes."""


def _poison_all(pool: BufferPool, name: str, slots: int) -> None:
    """Acquire every slot of ``name`` and release it: debug mode fills each with NaN (the cursor is back at 0)."""
    held = [pool.acquire(name) for _ in range(slots)]
    for t in held:
        pool.release(name, t)


def _rows_by_kind(d: torch.Tensor, mgr) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks of ``d``'s rows: dispatched tokens, each expert's padding rows, rows past the padded splits."""
    raw = torch.bincount(mgr.handle[6], minlength=EXPERTS)  # padded rows per expert (dense_to_expert_map)
    counts = mgr.handle[7]  # tokens per expert before padding
    token = torch.zeros(d.shape[0], dtype=torch.bool)
    pad = torch.zeros(d.shape[0], dtype=torch.bool)
    off = 0
    for c, p in zip(counts.tolist(), raw.tolist(), strict=True):
        token[off : off + c] = True
        pad[off + c : off + p] = True
        off += p
    tail = torch.zeros(d.shape[0], dtype=torch.bool)
    tail[off:] = True
    return token, pad, tail


def _run_poisoned(monkeypatch, buffer_cls) -> tuple[list, list, dict, list, list, dict]:
    """The control, then the same interleaved run with debug-mode rings whose every slot starts as NaN."""
    from megatron.core.transformer.moe import fused_a2a

    monkeypatch.setattr(fused_a2a, "HybridEPBuffer", buffer_cls)
    layer = _layer(monkeypatch, moe_expert_rank_capacity_factor=TAIL_FACTOR)
    xs = _inputs()
    ref_out, ref_grad = _interleaved(layer, xs)
    ref_params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    pool = BufferPool("cpu", debug=True)
    with install(layer, pool, _knobs(slots=2), tokens=TOKENS), pool.autograd_guard():
        _poison_all(pool, "dispatch_output", 2)
        _poison_all(pool, "expert_fc2_output", 2)
        out, grad = _interleaved(layer, xs)
    params = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    assert pool.stats()["dispatch_output"].acquisitions == 2 + 3
    return ref_out + ref_grad, ref_params, out + grad, params


def test_debug_poison_in_reused_slots_never_reaches_the_result(hybridep, monkeypatch) -> None:
    """Debug mode fills every freed slot with NaN. HybridEP writes every row the experts read: the dispatched
    rows and, zeroed, each expert's padding rows (as DeepEP's permute kernels do); rows past the padded splits
    keep the NaN, and no reader touches them. Outputs and every gradient equal the control's bit for bit."""
    ref, ref_params, got, params = _run_poisoned(monkeypatch, dep.HybridEPBuffer)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert params.keys() == ref_params.keys() and ref_params
    assert all(torch.equal(params[n], ref_params[n]) for n in ref_params)

    # Positive control: the slot a dispatch writes into held NaN, which stays, whole, in the rows past the padded
    # splits (so the run above handed the experts NaN rows); the padding rows were zeroed by the dispatch.
    probe_pool = BufferPool("cpu", debug=True)
    probe = _layer(monkeypatch, moe_expert_rank_capacity_factor=TAIL_FACTOR)
    with install(probe, probe_pool, _knobs(slots=1), tokens=TOKENS), torch.no_grad():
        _poison_all(probe_pool, "dispatch_output", 1)
        d, _ = _dispatch(probe, _inputs()[0], 0)
        token, pad, tail = _rows_by_kind(d, probe.token_dispatcher._comm_manager)
        assert (int(token.sum()), int(pad.sum()), int(tail.sum())) == (TOKENS * TOPK, 1024 - 128, 1536 - 1024)
        assert torch.isfinite(d[token]).all() and (d[pad] == 0).all() and torch.isnan(d[tail]).all()
        probe_pool.release("dispatch_output", d)


def test_a_backend_that_leaves_padding_rows_unwritten_poisons_the_weight_gradients(hybridep, monkeypatch) -> None:
    """Why the output_token contract includes the padding rows: the grouped GEMMs compute them (zero probs, zero
    output gradient), so a NaN left there reaches the weight gradients as 0 x NaN, which debug mode shows."""
    ref, ref_params, got, params = _run_poisoned(monkeypatch, dep.HybridEPBufferSkippingPadding)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))  # the forward and input grads: unharmed
    assert all(torch.isfinite(g).all() for g in ref_params.values())
    poisoned = sorted(n for n in ref_params if not torch.isfinite(params[n]).all())
    assert poisoned == sorted(ref_params), poisoned  # FC1 and FC2 weights both read the padding rows
