"""The hooks' per-call work, counted (not timed): regions, copies, and what production leaves alone.

Real megatron-core ``MoELayer`` on CPU (gloo world of one, EP = 1, pad-to-capacity: megatron's dropless
path needs CUDA streams). Production mode unless a test says otherwise. At EP x ETP = 1 production leaves
both rings unused (the first tests check that); the rest ring the expert FC2 output anyway
(``ring_single_rank_expert``), as it runs where it is used. Timings belong to ``bufreuse bench layer``
(docs/benchmarks.md), not here.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cpu import cpu_moe_layer, install_exercising_rings

from bufreuse.config import BufReuseConfig, identity_dispatch, single_rank_expert, static_bounds, unused_rings
from bufreuse.errors import BackendContractError
from bufreuse.integrations.alltoall import functions
from bufreuse.integrations.alltoall.hooks import passthrough_combine_stages
from bufreuse.integrations.core import DISPATCH, EXPERT, shared_patches_applied
from bufreuse.integrations.megatron import install as production_install
from bufreuse.pool import BufferPool
from bufreuse.pool._device import saved_hooks_push_pop

HIDDEN, SEQ, MBS = 32, 8, 2
TOKENS = SEQ * MBS


def install(*args, ring_identity_dispatch: bool = False, **kwargs):
    """``install()`` with the EP x ETP = 1 expert ring in use (production leaves it alone; see the first tests)."""
    return install_exercising_rings(*args, ring_identity_dispatch=ring_identity_dispatch, **kwargs)


def _layer(num_experts: int = 8, deterministic: bool = False, probs_on_input: bool = False):
    extra = {"moe_apply_probs_on_input": True} if probs_on_input else {}
    return cpu_moe_layer(num_experts, "alltoall", HIDDEN, deterministic_mode=deterministic, **extra)


def _forward(layer, seed: int):
    """One layer forward; returns (output, input)."""
    n = layer.config.num_moe_experts
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, MBS, HIDDEN, generator=g).requires_grad_(True)
    top = torch.softmax(torch.randn(SEQ * MBS, n, generator=g), -1).topk(layer.config.moe_router_topk)
    routing = torch.zeros(top.values.shape[0], n, dtype=torch.bool).scatter(1, top.indices, True)
    probs = torch.zeros(routing.shape).scatter(1, top.indices, top.values)
    h, p = layer.preprocess(x, probs, routing)
    d, p = layer.dispatch(h, p)
    out, _ = layer.routed_experts_compute(d, p)
    return layer.postprocess(layer.combine(out), None), x


def _step(layer, seed: int):
    """One layer call, forward and backward; returns (output, input grad)."""
    y, x = _forward(layer, seed)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad


def _knobs(dispatch: bool = True, expert: int = 2) -> BufReuseConfig:
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=dispatch,
        moe_hybridep_num_dispatch_output_buffers=2,
        moe_hybridep_num_expert_output_buffers=expert,
    )


class _Calls:
    """Counts calls of ``RingAllToAll.forward`` (the copy into the dispatch slot)."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        orig = functions.RingAllToAll.forward

        def counting(ctx, *args):
            self.n += 1
            return orig(ctx, *args)

        monkeypatch.setattr(functions.RingAllToAll, "forward", staticmethod(counting))


def test_ep1_dispatch_is_left_alone_and_copies_nothing(parallel, monkeypatch) -> None:
    calls = _Calls(monkeypatch)
    layer = _layer()
    ref = [_step(layer, s) for s in range(3)]
    # positive control: asked to, the hooks do copy the EP = 1 dispatch into the ring, once per call
    pool = BufferPool("cpu")
    with install(layer, pool, _knobs(), tokens=TOKENS, ring_identity_dispatch=True):
        got = [_step(layer, s) for s in range(3)]
    assert calls.n == 3 and pool.stats()[DISPATCH].acquisitions == 3
    assert all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    # production default: no dispatch ring, no copy, and the installation says why
    calls.n = 0
    pool = BufferPool("cpu")
    with install(layer, pool, _knobs(), tokens=TOKENS) as inst:
        got = [_step(layer, s) for s in range(3)]
    assert calls.n == 0
    assert DISPATCH not in pool.names() and pool.stats()[EXPERT].acquisitions == 3
    assert "EP = 1" in inst.unused[DISPATCH]
    assert all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))


def _instance_state(layer) -> dict:
    """Every submodule's instance attributes and class: what a hook would change."""
    return {name: (type(m), set(vars(m))) for name, m in layer.named_modules()}


def test_production_leaves_both_rings_alone_at_ep_x_etp_1(parallel) -> None:
    layer = _layer()
    ref = [_step(layer, s) for s in range(3)]
    before = _instance_state(layer)
    # positive control: with the validation knobs both rings are registered, hooked and acquired every call
    pool = BufferPool("cpu")
    with production_install(layer, pool, _knobs(), tokens=TOKENS, ring_identity_dispatch=True,
                            ring_single_rank_expert=True) as inst:  # fmt: skip
        hooked = _instance_state(layer)
        patched = shared_patches_applied()
        got = [_step(layer, s) for s in range(3)]
    assert patched and inst.layers == 1 and not shared_patches_applied()
    assert inst.unused == {} and {n: s.acquisitions for n, s in pool.stats().items()} == {DISPATCH: 3, EXPERT: 3}
    assert hooked != before
    assert all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    # production: no ring registered, no submodule touched, and the installation says why for each
    pool = BufferPool("cpu")
    with production_install(layer, pool, _knobs(), tokens=TOKENS) as inst:
        during = _instance_state(layer)
        patched = shared_patches_applied()  # megatron's release paths and graph wrapper: nothing to keep alive
        got = [_step(layer, s) for s in range(3)]
    assert pool.names() == [] and set(inst.unused) == {DISPATCH, EXPERT} and inst.layers == 0 and not patched
    assert "EP = 1" in inst.unused[DISPATCH] and "EP x ETP = 1" in inst.unused[EXPERT]
    (root, (cls, attrs)), rest = next(iter(during.items())), dict(list(during.items())[1:])
    assert cls is before[root][0] and attrs - before[root][1] == {"_bufreuse_hooked"}  # only install()'s mark
    assert rest == {k: v for k, v in before.items() if k != root}
    assert all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    assert _instance_state(layer) == before


def test_the_expert_ring_is_used_wherever_its_output_leaves_the_stream() -> None:
    cfg = {"expert_model_parallel_size": 1, "hidden_size": 8, "num_moe_experts": 4, "moe_router_topk": 2,
           "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}  # fmt: skip
    assert single_rank_expert(cfg, "alltoall")
    for other in (
        {"expert_model_parallel_size": 2},
        {"expert_tensor_parallel_size": 2},
        {"tensor_model_parallel_size": 2},
    ):  # fmt: skip  (ETP defaults to TP in megatron)
        assert not single_rank_expert({**cfg, **other}, "alltoall"), other
    assert single_rank_expert({**cfg, "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1}, "alltoall")
    assert not single_rank_expert(cfg, "hybridep")  # HybridEP's combine reads it on its own stream
    at1 = static_bounds(cfg, _knobs(), path="alltoall", tokens=16)
    assert at1["expert"].persistent_bytes == 0 and "EP x ETP = 1" in at1["expert"].source
    # the EP x ETP > 1 stream rule (nothing pending-free without EP overlap: tests/test_ep_stream_rule.py) kept out
    keep = dataclasses.replace(_knobs(), moe_bufreuse_keep_unused_rings=True)
    for other, path in (({"expert_model_parallel_size": 2}, "alltoall"), ({"expert_tensor_parallel_size": 2},
                        "alltoall"), ({}, "hybridep")):  # fmt: skip
        used = static_bounds({**cfg, **other}, keep, path=path, tokens=16)["expert"]
        assert used.persistent_bytes == 2 * used.slot_bytes > 0, (other, path)
    knob = dataclasses.replace(_knobs(), moe_bufreuse_ring_single_rank_expert=True)
    assert static_bounds(cfg, knob, path="alltoall", tokens=16)["expert"].persistent_bytes > 0
    assert set(unused_rings(cfg, _knobs(), "alltoall")) == {"dispatch", "expert"}
    assert unused_rings(cfg, _knobs(dispatch=False, expert=0), "alltoall") == {}  # only enabled buffers


def test_bounds_count_no_dispatch_ring_bytes_at_ep1() -> None:
    cfg = {"expert_model_parallel_size": 1, "hidden_size": 8, "num_moe_experts": 4, "moe_router_topk": 2,
           "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}  # fmt: skip
    assert identity_dispatch(cfg, "alltoall") and not identity_dispatch({**cfg, "expert_model_parallel_size": 2},
                                                                        "alltoall")  # fmt: skip
    at1 = static_bounds(cfg, _knobs(), path="alltoall", tokens=16)
    keep = dataclasses.replace(_knobs(), moe_bufreuse_keep_unused_rings=True)  # the EP >= 2 stream rule kept out
    at2 = static_bounds({**cfg, "expert_model_parallel_size": 2}, keep, path="alltoall", tokens=16)
    assert at1["dispatch"].persistent_bytes == 0 and "EP = 1" in at1["dispatch"].source
    assert at2["dispatch"].persistent_bytes == 2 * at2["dispatch"].slot_bytes > 0
    assert at1["expert"].persistent_bytes == 0  # EP x ETP = 1: the expert ring is unused too (above)
    assert not identity_dispatch(cfg, "hybridep")


def test_view_only_combine_stages_are_not_hooked_in_production(parallel) -> None:
    layer = _layer(8)
    disp = layer.token_dispatcher
    assert passthrough_combine_stages(disp) == {"combine_preprocess", "token_combine"}
    with install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS):
        hooked = {n for n in ("combine_preprocess", "token_combine", "combine_postprocess") if n in vars(disp)}
    assert hooked == {"combine_postprocess"}
    # debug mode hooks (and checks) every stage
    with install(layer, BufferPool("cpu", debug=True), _knobs(), tokens=TOKENS):
        hooked = {n for n in ("combine_preprocess", "token_combine", "combine_postprocess") if n in vars(disp)}
    assert hooked == {"combine_preprocess", "token_combine", "combine_postprocess"}
    # at EP x TP > 1 nothing is a passthrough
    disp.ep_size = 2
    try:
        assert passthrough_combine_stages(disp) == frozenset()
    finally:
        disp.ep_size = 1


def test_deterministic_unpermute_still_defers_the_fc2_release(parallel) -> None:
    """The one saving combine stage stays tracked: its index_add_ saves the slot (release after backward)."""
    torch.use_deterministic_algorithms(True)
    try:
        layer = _layer(8, deterministic=True)
        pool = BufferPool("cpu")
        with install(layer, pool, _knobs(dispatch=False), tokens=TOKENS):
            for s in range(3):
                _step(layer, s)
        deferred = pool.stats()[EXPERT].deferred_releases
        # positive control: without deterministic algorithms the same stage saves nothing
        torch.use_deterministic_algorithms(False)
        layer = _layer(8)
        pool2 = BufferPool("cpu")
        with install(layer, pool2, _knobs(dispatch=False), tokens=TOKENS):
            for s in range(3):
                _step(layer, s)
    finally:
        torch.use_deterministic_algorithms(False)
    assert deferred == 3 and pool2.stats()[EXPERT].deferred_releases == 0


def _saving_cat(monkeypatch) -> None:
    """Make the experts save their FC2 output inside their forward (what production assumes never happens)."""
    orig = functions.CatIntoRing.apply
    scale = torch.ones((), requires_grad=True)

    def apply(pool, name, box, *parts):
        return orig(pool, name, box, *parts) * scale  # the multiply saves the slot for scale's gradient

    monkeypatch.setattr(functions.CatIntoRing, "apply", apply)


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_a_save_of_the_fc2_output_inside_the_experts_defers_its_release(parallel, monkeypatch, debug: bool) -> None:
    """The experts save their FC2 output (the slot) inside their forward: ``routed_experts_compute`` runs in the
    region whenever the FC2 ring is in use, so the save is counted and the release waits for the backward, in
    production as in debug mode. Positive control: without the save the slot is free before the backward."""
    layer = _layer(8)
    ref = _step(layer, 0)

    def held_before_backward(pool: BufferPool) -> tuple[int, tuple]:
        with install(layer, pool, _knobs(dispatch=False), tokens=TOKENS):
            y, x = _forward(layer, 0)
            held = pool.get(EXPERT).held
            y.backward(torch.ones_like(y))
            assert pool.get(EXPERT).held == 0
        return held, (y.detach(), x.grad)

    clean, got = held_before_backward(BufferPool("cpu", debug=debug))
    assert clean == 0 and all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    _saving_cat(monkeypatch)
    pool = BufferPool("cpu", debug=debug)
    saving, got = held_before_backward(pool)
    assert saving == 1 and pool.stats()[EXPERT].deferred_releases == 1
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))  # the multiply is by one


def test_debug_mode_raises_when_a_view_only_combine_stage_saves_the_fc2_slot(parallel, monkeypatch) -> None:
    """Production leaves the EP x TP = 1 ``token_combine`` unhooked (it returns its input); a megatron-core whose
    ``token_combine`` saved the FC2 slot after all would be released early there, so debug mode tracks the stage and
    raises naming it. Positive control: the unchanged stage passes in debug mode."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    layer = _layer(8)
    with install(layer, BufferPool("cpu", debug=True), _knobs(dispatch=False), tokens=TOKENS):
        _step(layer, 0)
    scale = torch.ones((), requires_grad=True)
    orig = MoEAlltoAllTokenDispatcher.token_combine
    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "token_combine", lambda self, h: orig(self, h) * scale)
    with (
        install(layer, BufferPool("cpu", debug=True), _knobs(dispatch=False), tokens=TOKENS),
        pytest.raises(BackendContractError, match=r"token_combine.*saved the expert FC2 slot"),
    ):
        _step(layer, 0)


def test_saved_hooks_push_pop_contract() -> None:
    """The private push/pop pair behaves like ``saved_tensors_hooks`` (what SavedTracker relies on)."""
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    push, pop = saved_hooks_push_pop(pack, lambda t: t)
    w = torch.ones(3, requires_grad=True)
    push()
    try:
        y = (w * torch.full((3,), 2.0)).sum()
    finally:
        pop()
    (w * 3).sum()  # outside: not packed
    assert len(seen) >= 1
    n = len(seen)
    (w * torch.ones(3)).sum()
    assert len(seen) == n
    y.backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_a_stage_called_by_keyword_is_still_tracked(parallel) -> None:
    """``tracked`` looks at the first keyword when nothing is passed positionally (megatron passes positionally)."""
    from bufreuse.integrations.core import Held, reads_live, tracked

    pool = BufferPool("cpu")
    pool.register("r", policy="ring", num_slots=2, max_shape=(4, 4), dtype=torch.float32)
    slot = pool.acquire("r")
    held = Held(pool, "r", slot)
    w = torch.ones(4, 4, requires_grad=True)

    def stage(hidden):
        return hidden * w  # saves hidden (the slot) for w's gradient

    hooked = tracked(pool, stage, reads_live(lambda: held))
    y = hooked(hidden=slot)
    assert pool.saved_references("r", slot) == 1
    # positive control: a copy is not ring storage, nothing is counted
    z = hooked(hidden=slot.clone())
    assert pool.saved_references("r", slot) == 1
    del y, z
    assert pool.saved_references("r", slot) == 0


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_a_combine_stage_returning_a_view_keeps_the_fc2_slot(parallel, monkeypatch, debug: bool) -> None:
    """Every combine stage hooked, as at EP > 1 where none is a passthrough: in pad mode ``combine_preprocess``
    and the EP = 1 ``token_combine`` return views of the FC2 slot, so the release waits for
    ``combine_postprocess`` (the copy). One slot: an early release would let the next forward take the slot
    while the first microbatch's combine still reads it (production: an ``EarlyReuseError`` is the only thing that
    may not happen here; debug: the poison would reach the output)."""
    from bufreuse.integrations.alltoall import hooks

    monkeypatch.setattr(hooks, "passthrough_combine_stages", lambda disp: frozenset())
    layer = _layer()
    ref = [_step(layer, s) for s in range(3)]
    pool = BufferPool("cpu", debug=debug)
    released_at: list[str] = []
    with install(layer, pool, _knobs(dispatch=False, expert=1), tokens=TOKENS):
        disp = layer.token_dispatcher
        for name in ("combine_preprocess", "token_combine", "combine_postprocess"):
            stage = vars(disp)[name]

            def watched(*args, _stage=stage, _name=name, **kwargs):
                before = pool.stats()[EXPERT].releases
                out = _stage(*args, **kwargs)
                if pool.stats()[EXPERT].releases > before:
                    released_at.append(_name)
                return out

            setattr(disp, name, watched)
        got = [_step(layer, s) for s in range(3)]
    assert released_at == ["combine_postprocess"] * 3  # the first stage whose output is a copy
    assert all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))


def _counting_packs(monkeypatch) -> list[int]:
    """Count the calls of the pool's pack hook (every tensor autograd saves inside a region), for pools made after."""
    from bufreuse.pool import tracking

    n = [0]
    orig = tracking._pack_unpack

    def counting(*args, **kwargs):
        pack, unpack = orig(*args, **kwargs)

        def counted(t):
            n[0] += 1
            return pack(t)

        return counted, unpack

    monkeypatch.setattr(tracking, "_pack_unpack", counting)
    return n


def _saves_inside(layer, targets: list[tuple[object, str]], seeds: range) -> int:
    """Tensors autograd saves inside the given methods over uninstalled layer calls (counted by torch's own hooks)."""
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    for obj, attr in targets:
        fn = getattr(obj, attr)

        def counting(*args, _fn=fn, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return _fn(*args, **kwargs)

        setattr(obj, attr, counting)
    try:
        for s in seeds:
            _step(layer, s)
    finally:
        for obj, attr in targets:
            delattr(obj, attr)
    return n[0]


def _dispatch_stages(layer) -> list[tuple[object, str]]:
    """The stages the dispatch hook runs in a region when they receive the live slot."""
    return [(layer.token_dispatcher, "dispatch_postprocess"), (layer, "routed_experts_compute")]


@pytest.mark.parametrize("experts", [8, 1])
def test_two_saved_tensor_regions_per_layer_call_with_the_fc2_ring(parallel, monkeypatch, experts: int) -> None:
    """The FC2 ring alone (production's dispatch ring is unused at EP = 1): per layer call one region over
    ``routed_experts_compute`` (the experts make the slot there; every save of it, a module hook's included, is
    counted) and one over the first combine stage that receives it (the unpermute copies it). The tensors that go
    through the pack hook are exactly those torch's own saved-tensor hooks see inside those two stages on the bare
    layer, call by call: more than the combine stage's alone (what a region over the combine only would count)."""
    packs = _counting_packs(monkeypatch)
    layer = _layer(experts)
    seeds = range(4)
    stages = [(layer, "routed_experts_compute"), (layer.token_dispatcher, "combine_postprocess")]
    saves = sum(_saves_inside(layer, stages, [s]) for s in seeds)
    combine_only = sum(_saves_inside(layer, stages[1:], [s]) for s in seeds)
    assert saves > combine_only
    pool = BufferPool("cpu")
    tracker = pool.track_saved()
    with install(layer, pool, _knobs(), tokens=TOKENS) as inst:
        assert pool.names() == [EXPERT] and set(inst.unused) == {DISPATCH}
        before = tracker.regions
        for s in seeds:
            _step(layer, s)
        regions = tracker.regions - before
    assert regions == 2 * len(seeds)
    assert packs[0] == saves


@pytest.mark.parametrize("experts", [1, 8])
@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_a_directly_read_dispatch_slot_is_tracked_over_the_whole_experts_stage(
    parallel, monkeypatch, debug: bool, experts: int
) -> None:
    """The experts read the dispatch slot directly (one local expert; at EP = 1 the sort is a no-op for eight): every
    call, from the first, production runs ``dispatch_postprocess`` and the whole ``routed_experts_compute`` in the
    region, so every tensor they save goes through the pack hook, not only what the experts' first linear saves
    (debug mode: the same). The release waits for what FC1 saved. The counts come from torch's own hooks on the bare
    layer, call by call."""
    packs = _counting_packs(monkeypatch)
    layer = _layer(experts)
    seeds = range(5)
    ref = [_step(layer, s) for s in seeds]
    fc1s = [(mlp.linear_fc1, "forward") for mlp in layer.experts.local_experts]
    whole = [_saves_inside(layer, _dispatch_stages(layer), [s]) for s in seeds]
    first_linear = [_saves_inside(layer, fc1s, [s]) for s in seeds]
    assert all(0 < n < w for n, w in zip(first_linear, whole, strict=True))  # FC1 saves its input; the rest more
    pool = BufferPool("cpu", debug=debug)
    with install(layer, pool, _knobs(expert=0), tokens=TOKENS, ring_identity_dispatch=True):  # the dispatch ring only
        got = [_step(layer, s) for s in seeds]
    assert packs[0] == sum(whole)
    assert pool.stats()[DISPATCH].deferred_releases == len(seeds)  # FC1 saved the slot: every release waited
    assert all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))


def _two_in_flight(layer, seeds: tuple[int, int]) -> list[torch.Tensor]:
    """F0 F1 B0 B1: outputs, input gradients and every parameter's gradient (FC1's needs the saved slot)."""
    layer.zero_grad(set_to_none=True)
    runs = [_forward(layer, s) for s in seeds]
    for y, _ in runs:
        y.backward(torch.ones_like(y))
    grads = [p.grad for p in layer.parameters() if p.grad is not None]  # the router's is None (routing is given)
    return [*(y.detach() for y, _ in runs), *(x.grad for _, x in runs), *grads]


@pytest.mark.parametrize("experts", [1, 8])
def test_the_dispatch_release_waits_with_two_microbatches_in_flight(parallel, experts: int) -> None:
    """Two slots, two forwards before either backward: a release that did not wait for FC1's saved slot would let
    the second forward overwrite the first one's FC1 input before its weight gradient reads it."""
    layer = _layer(experts)
    ref = _two_in_flight(layer, (0, 1))
    layer = _layer(experts)
    pool = BufferPool("cpu")
    with install(layer, pool, _knobs(expert=0), tokens=TOKENS, ring_identity_dispatch=True):
        got = _two_in_flight(layer, (0, 1))
    assert pool.stats()[DISPATCH].deferred_releases == 2 and pool.stats()[DISPATCH].peak_held == 2
    assert len(got) == len(ref) > 4 and all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_a_save_before_the_first_linear_is_counted_whenever_it_starts(parallel, monkeypatch, debug: bool) -> None:
    """A megatron-core whose ``SequentialMLP.forward`` saves the slot before FC1 (FC1 then gets a copy), starting
    only after several clean calls: that call's release still waits for the save, with no warning (nothing is
    sampled). Positive control: the clean calls' releases waited for FC1's save, the saving call's for the
    multiply's (FC1 saved a copy), so each call deferred once."""
    import warnings

    from megatron.core.transformer.moe.experts import SequentialMLP

    from bufreuse.integrations.core import ReleaseRuleWarning

    layer = _layer(1)
    orig = SequentialMLP.forward
    scale = torch.ones((), requires_grad=True)
    saving = [False]

    def saving_forward(self, hidden, tokens_per_expert, probs):
        if saving[0]:
            hidden = hidden * scale  # the multiply saves the slot for scale's gradient; FC1 gets a copy
        return orig(self, hidden, tokens_per_expert, probs)

    monkeypatch.setattr(SequentialMLP, "forward", saving_forward)
    pool = BufferPool("cpu", debug=debug)
    with (
        warnings.catch_warnings(),
        install(layer, pool, _knobs(expert=0), tokens=TOKENS, ring_identity_dispatch=True),
    ):
        warnings.simplefilter("error", ReleaseRuleWarning)
        for pair in ((0, 1), (2, 3)):  # clean, two in flight at a time
            runs = [_forward(layer, s) for s in pair]
            for y, _ in runs:
                y.sum().backward()
        saving[0] = True
        y, _ = _forward(layer, 9)
        ring = pool.get(DISPATCH)
        assert ring.held == 1 and ring.stats.deferred_releases == 5  # held for the multiply's saved slot
        y.sum().backward()
        assert ring.held == 0 and scale.grad is not None
    del y


def test_one_region_per_layer_call_where_the_experts_read_the_dispatch_slot(parallel) -> None:
    """``routed_experts_compute`` runs in a region when it receives the live slot, and ``dispatch_postprocess`` runs
    inside it (megatron-core 0.19.2), its region nested: one per layer call on the dispatch path. Positive control:
    with the FC2 ring too, each call's first copying combine stage adds one."""
    layer = _layer(1)
    for knobs, per_call in ((_knobs(expert=0), 1), (_knobs(), 2)):
        pool = BufferPool("cpu")
        tracker = pool.track_saved()
        with install(layer, pool, knobs, tokens=TOKENS, ring_identity_dispatch=True):
            before = tracker.regions
            for s in range(4):
                _step(layer, s)
            assert tracker.regions - before == per_call * 4


def test_a_dispatch_postprocess_that_copies_releases_the_slot_there(parallel) -> None:
    """A ``dispatch_postprocess`` that copies (here a patched instance) is the slot's last forward reader: it runs in
    the region, the slot is released when it returns, and the experts, which get the copy, open no region."""
    import warnings

    from bufreuse.integrations.core import ReleaseRuleWarning

    layer = _layer(1)
    disp = layer.token_dispatcher
    orig = disp.dispatch_postprocess

    def copying(hidden, probs):
        out = orig(hidden, probs)
        return (out[0].clone(), *out[1:])

    disp.dispatch_postprocess = copying
    try:
        pool = BufferPool("cpu")
        tracker = pool.track_saved()
        with (
            warnings.catch_warnings(),
            install(layer, pool, _knobs(expert=0), tokens=TOKENS, ring_identity_dispatch=True),
        ):
            warnings.simplefilter("error", ReleaseRuleWarning)
            before = tracker.regions
            for s in range(4):
                y, _ = _forward(layer, s)
                assert pool.get(DISPATCH).held == 0  # released before the backward: nothing saved the slot
                y.sum().backward()
            regions = tracker.regions - before
        assert regions == 4  # dispatch_postprocess's, once per call
        assert pool.stats()[DISPATCH].releases == 4 and pool.stats()[DISPATCH].deferred_releases == 0
    finally:
        del disp.dispatch_postprocess


def test_a_hooked_layer_gives_the_bare_layers_results_and_releases_every_slot(parallel) -> None:
    """Both rings exercised, production mode: outputs and input gradients bit-equal to the bare layer's, every slot
    acquired is released."""
    layer = _layer()
    ref = [_step(layer, s) for s in range(5)]
    pool = BufferPool("cpu", debug=False)
    with install(layer, pool, _knobs(), tokens=TOKENS, ring_identity_dispatch=True):
        got = [_step(layer, s) for s in range(5)]
    for (yr, gr), (yg, gg) in zip(ref, got, strict=True):
        assert torch.equal(yr, yg) and torch.equal(gr, gg)
    stats = pool.stats()
    for name in (DISPATCH, EXPERT):
        assert stats[name].acquisitions == stats[name].releases == 5 and pool.get(name).held == 0


@pytest.mark.filterwarnings("ignore")  # pytest keeps every warning megatron emits: objects that would grow here
def test_the_hooked_layer_leaks_no_reference(parallel) -> None:
    """Reference counts of the pool's objects are the same before and after many layer calls, and no object
    accumulates (a saved reference, a ``Held`` or a mark kept past its release would show here)."""
    import gc
    import sys

    layer = _layer()
    pool = BufferPool("cpu", debug=False)
    with install(layer, pool, _knobs(), tokens=TOKENS, ring_identity_dispatch=True):
        ring = pool.get(EXPERT)
        watched = [ring, pool, ring._slots[0], ring._slots[1], pool.track_saved(), ring._ops, pool.get(DISPATCH)]
        for seed in range(40):  # warm: megatron's and torch's own caches fill on the first pass
            _step(layer, seed)
        gc.collect()
        before = [sys.getrefcount(o) for o in watched]
        objects = len(gc.get_objects())
        for seed in range(40):
            _step(layer, seed)
        gc.collect()
        after = [sys.getrefcount(o) for o in watched]
        grown = len(gc.get_objects()) - objects
    assert after == before and grown < 40


class _SaveInput(torch.autograd.Function):
    """``2 * x``, saving ``x`` for backward (whose gradient reads it): a reader of whatever ``x`` views."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_a_module_hook_added_late_that_saves_the_slot_defers_its_release(parallel, debug: bool) -> None:
    """A user's forward pre-hook on the experts, registered after several clean calls, saves their input (the
    dispatch slot itself: one local expert) through an autograd Function whose output stays alive. The slot's
    release waits for that saved tensor: the ring does not hand the slot out again while it lives (two later calls
    use the other slot), and the kept output's backward reads the data it saved. Outputs, input gradients and the
    kept output's gradient are bit-equal to the bare layer's running the same hook."""

    def run(pool: BufferPool | None) -> tuple[list, torch.Tensor, dict]:
        return _late_save_run(
            lambda: _layer(1),
            pool,
            DISPATCH,
            lambda experts, save: experts.register_forward_pre_hook(
                lambda module, args: save(args[0])  # the experts' input: the dispatch slot itself
            ),
            ring_identity_dispatch=True,
        )

    ref, ref_grad, _ = run(None)
    got, grad, seen = run(BufferPool("cpu", debug=debug))
    assert seen["held after the call"] == 1 and seen["still held"] and seen["held"] == 1, seen
    assert seen["held at the end"] == 0 and seen["deferred"] >= 1, seen  # released once the saved tensor went
    assert torch.equal(grad, ref_grad)  # the data the hook saved, not a later call's
    assert all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))


def _late_save_run(
    build, pool: BufferPool | None, buffer: str, register, **install_kw
) -> tuple[list, torch.Tensor, dict]:
    """Six clean calls, then one with a hook (``register(layer.experts, save)``) that saves a tensor through
    :class:`_SaveInput` whose output stays alive, two more calls, then that output's backward; the outputs, the
    saved leaf's gradient and what ``buffer``'s ring showed along the way (bare layer: ``pool`` None)."""
    clean, later = 6, 2
    layer = build()
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def save(t: torch.Tensor) -> None:
        leaf = t.detach().requires_grad_(True)  # the slot's storage, a leaf whose gradient we read
        kept.append((leaf, _SaveInput.apply(leaf)))

    out, seen = [], {}
    ctx = install(layer, pool, _knobs(), tokens=TOKENS, **install_kw) if pool else contextlib.nullcontext()
    with ctx as inst:
        if pool is not None:
            seen["rings"] = sorted(pool.names())
            seen["unused"] = sorted(inst.unused)
        out += [_step(layer, s) for s in range(clean)]
        handle = register(layer.experts, save)
        out.append(_step(layer, clean))
        handle.remove()
        if pool is not None:
            ring = pool.get(buffer)
            index = ring.slot_of(kept[0][0])
            generation = ring._slots[index].generation
            seen["held after the call"] = ring.held
        out += [_step(layer, clean + 1 + s) for s in range(later)]
        if pool is not None:
            slot = ring._slots[index]
            seen["still held"] = slot.live is not None and slot.generation == generation
            seen["held"] = ring.held
        leaf, y = kept.pop()
        y.backward(torch.ones_like(y))  # reads what the hook saved
        del y
        if pool is not None:
            seen["held at the end"] = ring.held
            seen["deferred"] = pool.stats()[buffer].deferred_releases
    return out, leaf.grad, seen


def _te_fake_layer(num_experts: int):
    """:func:`_layer` with megatron's real ``TEGroupedMLP`` (non-fused) over the fake TE ``GroupedLinear``
    (``tests/fakes/te_grouped_linear.py``): the expert ring goes through the TE adapter's ``out=`` route."""
    from fakes import te_grouped_linear as te
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    layer = _layer(num_experts)
    subs = GroupedMLPSubmodules(linear_fc1=te.MegatronTEGroupedLinear, linear_fc2=te.MegatronTEGroupedLinear)
    layer.experts = TEGroupedMLP(
        num_experts, layer.config, subs, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )
    layer.config.moe_grouped_gemm = True
    return layer


@pytest.mark.parametrize("spec", ["local", "te-fake"])
@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_a_module_hook_that_saves_the_fc2_slot_defers_its_release_with_the_expert_ring_alone(
    parallel, debug: bool, spec: str
) -> None:
    """The expert ring without the dispatch ring (production's outcome where the stream rule leaves only the dispatch
    ring unused): a user's forward hook on the experts, registered after several clean calls, saves their output (the
    FC2 slot) through an autograd Function whose output stays alive. The slot stays held while that saved tensor
    lives (later calls take the other slot), and the kept output's backward reads the data it saved. Outputs, input
    gradients and the kept output's gradient are bit-equal to the bare layer's running the same hook."""
    build = _layer if spec == "local" else _te_fake_layer

    def run(pool: BufferPool | None) -> tuple[list, torch.Tensor, dict]:
        # the expert ring only (install's defaults leave the dispatch ring unused here)
        return _late_save_run(
            lambda: build(8),
            pool,
            EXPERT,
            lambda experts, save: experts.register_forward_hook(
                lambda module, args, output: save(output[0])  # the experts' output: the FC2 slot
            ),
        )

    ref, ref_grad, _ = run(None)
    got, grad, seen = run(BufferPool("cpu", debug=debug))
    assert seen["rings"] == [EXPERT] and seen["unused"] == [DISPATCH], seen  # the expert ring alone
    assert seen["held after the call"] == 1 and seen["still held"] and seen["held"] == 1, seen
    assert seen["held at the end"] == 0 and seen["deferred"] == 1, seen  # released once the saved tensor went
    assert torch.equal(grad, ref_grad)  # the data the hook saved, not a later call's
    assert all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
