"""HybridEP and Transformer Engine adapters against fakes whose signatures match cited upstream text.

Neither backend installs here (no DeepEP with HybridEP on PyPI; TE's torch part needs a CUDA
build). The fakes in ``tests/fakes`` carry the upstream parameter lists (DeepEP hybrid-ep commit
94a9f8f6, checked against megatron-core 0.19.2's calls in ``test_fake_deep_ep_contract``; TE names
as megatron-core 0.19.2 uses them) plus exactly the seed's additions, and the
tests show the adapters hand the ring slot itself to the callee (``data_ptr`` equality).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from fakes import deep_ep_hybrid as dep
from fakes import te_grouped_linear as te

from bufreuse.errors import BackendContractError, ConfigError
from bufreuse.integrations.features import deepep_output_token, te_grouped_output
from bufreuse.integrations.hybridep.output_token import dispatch_into_pool, dispatch_with_output_token
from bufreuse.integrations.te.out_route import grouped_linear_into, output_buffer_op_kwargs
from bufreuse.pool import BufferPool

HIDDEN, EXPERTS, TOKENS, BOUND = 16, 4, 12, 32


def _routing():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g)
    idx = torch.randint(0, EXPERTS, (TOKENS, 2), generator=g)
    routing = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.rand(TOKENS, EXPERTS, generator=g) * routing
    return hidden, routing, probs


def _pool(name: str, rows: int, cols: int) -> BufferPool:
    pool = BufferPool("cpu")
    pool.register(name, policy="ring", num_slots=2, max_shape=(rows, cols), dtype=torch.float32)
    return pool


def test_fake_deepep_seed_signature_is_upstream_plus_output_token() -> None:
    upstream = inspect.signature(dep.HybridEPBufferUpstream.dispatch_with_permute)
    params = dict(inspect.signature(dep.HybridEPBuffer.dispatch_with_permute).parameters)
    extra = params.pop("output_token")
    assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is None
    assert inspect.Signature(list(params.values())) == upstream  # upstream vs megatron: test_fake_deep_ep_contract


def test_fake_te_signature_is_upstream_plus_out() -> None:
    assert str(inspect.signature(te.GroupedLinearUpstream.forward)) == te.UPSTREAM_MODULE_FORWARD
    assert str(inspect.signature(te.GroupedLinear.forward)) == te.TE_2_20_MODULE_FORWARD
    assert str(inspect.signature(te.TEGroupedLinearBase.forward)) == te.TE_2_20_MODULE_FORWARD
    params = dict(inspect.signature(te.GroupedLinear.forward).parameters)
    assert params.pop("out").default is None and params.pop("dgrad_out").default is None
    assert str(inspect.Signature(list(params.values()))) == te.UPSTREAM_MODULE_FORWARD


def test_detect_features_by_signature_and_key() -> None:
    assert deepep_output_token(dep.HybridEPBuffer)[0]
    ok, detail = deepep_output_token(dep.HybridEPBufferUpstream)
    assert not ok and "no output_token" in detail
    assert te_grouped_output(ops_module=te.ops_grouped_linear)[0]
    assert te_grouped_output(grouped_linear_cls=te.GroupedLinear, ops_module=te.ops_without_key)[0]
    assert not te_grouped_output(grouped_linear_cls=te.GroupedLinearUpstream, ops_module=te.ops_without_key)[0]
    assert deepep_output_token()[0] is False  # no DeepEP with HybridEP in this environment


def test_hybridep_adapter_hands_the_slot_to_deepep() -> None:
    hidden, routing, probs = _routing()
    pool = _pool("dispatch_output", BOUND, HIDDEN)
    (out, out_probs, _, counts, handle), slot = dispatch_into_pool(
        pool,
        dep.HybridEPBuffer(None, 0, 0, 0),
        hidden=hidden,
        num_permuted_tokens=BOUND,
        routing_map=routing,
        probs=probs,
    )
    assert out.data_ptr() == slot.data_ptr() and pool.is_ring_storage(out)
    ref, ref_probs, _, ref_counts, _ = dep.HybridEPBufferUpstream(None, 0, 0, 0).dispatch_with_permute(
        hidden=hidden, num_permuted_tokens=BOUND, routing_map=routing, probs=probs
    )
    # Only the dispatched rows are written: no padding here, and the rows past them keep the slot's old contents
    # (upstream's own output holds torch::empty garbage there).
    rows = handle[0][handle[0] >= 0]
    assert rows.numel() == int(routing.sum())
    assert torch.equal(out[rows], ref[rows]) and torch.equal(out_probs, ref_probs) and torch.equal(counts, ref_counts)
    pool.release("dispatch_output", slot)


def test_hybridep_adapter_fails_early_without_output_token() -> None:
    hidden, routing, _ = _routing()
    pool = _pool("dispatch_output", BOUND, HIDDEN)
    with pytest.raises(ConfigError, match="output_token"):
        dispatch_into_pool(pool, dep.HybridEPBufferUpstream(None, 0, 0, 0), hidden=hidden, num_permuted_tokens=BOUND,
                           routing_map=routing)  # fmt: skip
    with pytest.raises(BackendContractError, match="ignored output_token") as err:
        dispatch_with_output_token(
            dep.HybridEPBufferIgnoringOutput(None, 0, 0, 0), torch.empty(BOUND, HIDDEN), hidden=hidden,
            num_permuted_tokens=BOUND, routing_map=routing,
        )  # fmt: skip
    assert (err.value.backend, err.value.call) == ("HybridEP", "dispatch_with_permute")


def test_te_module_out_receives_the_slot() -> None:
    hidden, _, _ = _routing()
    splits = [3, 5, 0, 4]
    fc2 = te.GroupedLinear(len(splits), HIDDEN, 8)
    pool = _pool("expert_fc2_output", BOUND, 8)
    slot = pool.acquire("expert_fc2_output", (TOKENS, 8))
    y = grouped_linear_into(fc2, hidden, splits, slot)
    assert y.data_ptr() == slot.data_ptr()
    assert torch.equal(y, te.GroupedLinearUpstream.forward(fc2, hidden, splits))
    with pytest.raises(ConfigError, match="out="):
        grouped_linear_into(te.GroupedLinearUpstream(4, HIDDEN, 8), hidden, splits, slot)
    with pytest.raises(ConfigError, match="shape"):
        grouped_linear_into(fc2, hidden[:5], [5, 0, 0, 0], slot)


def test_te_op_kwargs_route_fc2_output_into_a_detached_alias() -> None:
    hidden, _, _ = _routing()
    splits = torch.tensor([3, 5, 0, 4])
    mlp = te.FusedGroupedMLP(te.GroupedLinear(4, HIDDEN, 32), te.GroupedLinear(4, 32, HIDDEN))
    probs = torch.rand(TOKENS)
    ref = mlp(hidden, splits.tolist(), probs, splits.tolist())
    pool = _pool("expert_fc2_output", BOUND, HIDDEN)
    slot = pool.acquire("expert_fc2_output", (TOKENS, HIDDEN)).requires_grad_(True)  # like an autograd output
    kwargs = output_buffer_op_kwargs(te.ops_grouped_linear, slot, (TOKENS, HIDDEN))
    out = mlp(hidden, splits.tolist(), probs, splits.tolist(), op_kwargs=kwargs)
    assert out.data_ptr() == slot.data_ptr() and torch.equal(out, ref)
    assert not kwargs[-1][te.ops_grouped_linear.OUTPUT_BUFFER_KEY].requires_grad
    with pytest.raises(ConfigError, match="OUTPUT_BUFFER_KEY"):
        output_buffer_op_kwargs(te.ops_without_key, slot, (TOKENS, HIDDEN))
    with pytest.raises(ConfigError, match="contiguous"):
        output_buffer_op_kwargs(te.ops_grouped_linear, torch.empty(HIDDEN, TOKENS).t(), (TOKENS, HIDDEN))


class _MegatronTEGroupedLinear(te.GroupedLinear):
    """megatron-core 0.19.2's ``TEGroupedLinear.forward(x, m_splits)``: ``super().forward`` without ``out=``."""

    def forward(self, x, m_splits):  # type: ignore[override]
        return super().forward(x, m_splits, is_first_microbatch=None), None


def _fc2_case():
    """Routed tokens, their splits, the expert-output ring's name and pool, a megatron FC2 and TE's output for it."""
    hidden, _, _ = _routing()
    splits = [3, 5, 0, 4]
    name = "expert_fc2_output"
    pool = _pool(name, BOUND, 8)
    fc2 = _MegatronTEGroupedLinear(4, HIDDEN, 8)
    return hidden, splits, name, pool, fc2, te.GroupedLinearUpstream.forward(fc2, hidden, splits)


def test_te_module_route_writes_fc2_into_the_ring_and_leaves_other_modules_alone() -> None:
    from bufreuse.config import BufReuseConfig
    from bufreuse.integrations.core import Installation
    from bufreuse.integrations.te.out_route import ROUTE, Fc2Route, route_into_ring

    hidden, splits, name, pool, fc2, ref = _fc2_case()
    fc1 = _MegatronTEGroupedLinear(4, HIDDEN, 8)
    fc1.weights = fc2.weights
    got: list = []
    inst = Installation(pool=pool, knobs=BufReuseConfig(), tokens=TOKENS)
    route_into_ring(inst, fc2, Fc2Route(pool, name, 8, got, te.GroupedLinear.forward))
    y, _ = fc2(hidden, splits)
    assert len(got) == 1 and y.data_ptr() == got[0].tensor.data_ptr() and pool.owns(name, got[0].tensor)
    assert got[0].read_by(y) and (got[0].lo, got[0].hi) == (y.data_ptr(), y.data_ptr() + y.nbytes)
    assert torch.equal(y, ref) and isinstance(fc2, _MegatronTEGroupedLinear)
    # the other module of the same class (FC1, another layer, the control) runs its own class: no slot
    y1, _ = fc1(hidden, splits)
    assert type(fc1) is _MegatronTEGroupedLinear and not pool.is_ring_storage(y1) and torch.equal(y1, ref)
    # an explicit out= beside the route is two writers: refused, nothing acquired
    with pytest.raises(ConfigError, match="out="):
        type(fc2).__mro__[2].forward(fc2, hidden, splits, out=torch.empty(TOKENS, 8))
    assert pool.get(name).held == 1
    pool.release(name, got.pop().tensor)
    inst.uninstall()
    assert type(fc2) is _MegatronTEGroupedLinear and ROUTE not in vars(fc2)
    y2, _ = fc2(hidden, splits)
    assert not pool.is_ring_storage(y2) and pool.stats()[name].acquisitions == 1


def test_te_module_route_refuses_a_te_that_ignores_out_and_gives_the_slot_back() -> None:
    """The route checks the storage TE returned: a TE that ignores ``out=`` is refused, the slot given back."""
    from bufreuse.config import BufReuseConfig
    from bufreuse.integrations.core import Installation
    from bufreuse.integrations.te.out_route import Fc2Route, route_into_ring

    hidden, _, _ = _routing()
    name = "expert_fc2_output"
    pool = _pool(name, BOUND, 8)
    fc2 = _MegatronTEGroupedLinear(4, HIDDEN, 8)

    def ignores_out(self, inp, m_splits, *args, out=None, **kwargs):
        return te.GroupedLinear.forward(self, inp, m_splits, *args, **kwargs)

    got: list = []
    with Installation(pool=pool, knobs=BufReuseConfig(), tokens=TOKENS) as inst:
        route_into_ring(inst, fc2, Fc2Route(pool, name, 8, got, ignores_out))
        with pytest.raises(BackendContractError, match="ignored out="):
            fc2(hidden, [3, 5, 0, 4])
    assert got == [] and pool.get(name).held == 0 and pool.stats()[name].acquisitions == 1


def test_te_module_route_survives_deepcopy_and_a_later_class_switch() -> None:
    """A model deep-copied while hooked shares the route (as it shared the hook closures); a module whose class
    another library switched again after install keeps working after uninstall (TE's own forward, no slot)."""
    import copy

    from bufreuse.config import BufReuseConfig
    from bufreuse.integrations.core import Installation
    from bufreuse.integrations.te.out_route import Fc2Route, route_into_ring

    hidden, splits, name, pool, fc2, ref = _fc2_case()
    got: list = []
    inst = Installation(pool=pool, knobs=BufReuseConfig(), tokens=TOKENS)
    route_into_ring(inst, fc2, Fc2Route(pool, name, 8, got, te.GroupedLinear.forward))
    twin = copy.deepcopy(fc2)
    y, _ = twin(hidden, splits)
    assert torch.equal(y, ref) and len(got) == 1 and pool.is_ring_storage(y)
    pool.release(name, got.pop().tensor)

    wrapped = type("Wrapped", (type(fc2),), {})  # e.g. a sharding library's subclass, made after install
    fc2.__class__ = wrapped
    inst.uninstall()
    y2, _ = fc2(hidden, splits)
    assert type(fc2) is wrapped and torch.equal(y2, ref) and not pool.is_ring_storage(y2) and got == []
