"""The DeepEP HybridEP fake takes exactly what megatron-core 0.19.2 passes, derived from megatron's code.

No parameter list is stored as text anywhere. Two derivations, both from the installed megatron-core:
its ``fused_a2a.py`` call sites read with ``ast`` (keyword names, ``**`` expansions resolved,
positional counts), bound to the fake's real signatures; and megatron's own ``hybrid_ep_dispatch``
/ ``hybrid_ep_combine`` / ``HybridEPDispatch`` / ``HybridEPCombine`` / ``init_hybrid_ep_buffer``
calling the fake on every branch (fused permute, block counts, static budget, padding, backward),
warnings as errors so megatron's "Falling back to unfused" path cannot hide a signature gap. The
fake's signatures mirror DeepEP hybrid-ep @ 94a9f8f6 (see ``tests/fakes/deep_ep_hybrid.py``).
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from fakes import deep_ep_hybrid as dep  # noqa: E402
from megatron_hybridep import call_sites, megatron_wrappers, unbindable  # noqa: E402

TOKENS, HIDDEN, EXPERTS, TOPK = 24, 8, 4, 2


@pytest.fixture
def fused_a2a(monkeypatch):
    """megatron-core's fused_a2a as if DeepEP with HybridEP were the fake; megatron's own wrappers."""
    from megatron.core.transformer.moe import fused_a2a as mod

    monkeypatch.setattr(mod, "HAVE_HYBRIDEP", True)
    monkeypatch.setattr(mod, "HybridEPBuffer", dep.HybridEPBuffer, raising=False)
    monkeypatch.setattr(mod, "_hybrid_ep_buffer", None)
    for name, fn in megatron_wrappers(mod).items():
        monkeypatch.setattr(mod, name, fn)
    return mod


def _sites():
    from megatron.core.transformer.moe import fused_a2a

    return call_sites(Path(inspect.getfile(fused_a2a)))


class _Drifted(dep.HybridEPBufferUpstream):
    """The fake as it was before (DeepEP hybrid-ep @ 098da2a6): no block counts, no permute fusion."""

    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts, use_fp8=False,
                 num_sms_dispatch_api=None, num_sms_combine_api=None, num_sms_preprocessing_api=None,
                 num_sms_permute_api=None, num_of_ranks_per_nvlink_domain=None, use_mnnvl=None):  # fmt: skip
        super().__init__(group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts)

    def dispatch_with_permute(self, *, hidden, topk_idx=None, topk_weights=None, num_of_experts_per_rank=None,
                              num_of_experts=None, use_fp8=None, routing_map=None, probs=None, scaling_factor=None,
                              num_permuted_tokens=None, pad_multiple=None, handle=None,
                              non_blocking=False):  # fmt: skip
        return super().dispatch_with_permute(hidden=hidden, routing_map=routing_map, probs=probs, handle=handle)

    def combine_with_unpermute(self, *, hidden, probs=None, handle=None, pad_multiple=None):
        return super().combine_with_unpermute(hidden=hidden, probs=probs, handle=handle)


def test_megatron_call_sites_found_and_fully_resolved() -> None:
    sites = _sites()
    assert {s.target for s in sites} == {"__init__", "dispatch_with_permute", "combine_with_unpermute"}
    assert [s for s in sites if s.unresolved] == []
    assert all(s.positional == 0 for s in sites)  # megatron passes everything by keyword today


def test_megatron_call_sites_bind_to_the_fakes_signatures() -> None:
    sites = _sites()
    assert unbindable(sites, dep.HybridEPBuffer) == []
    assert unbindable(sites, dep.HybridEPBufferUpstream) == []


def test_call_site_check_fails_on_the_drifted_fake() -> None:
    problems = "\n".join(unbindable(_sites(), _Drifted))
    for keyword in ("num_blocks_permute", "fuse_permute_dispatch", "fuse_unpermute_combine"):
        assert keyword in problems


def test_call_site_check_reports_unknown_arity_and_unresolved_expansion() -> None:
    src = (
        "def f(x):\n"
        "    _hybrid_ep_buffer.combine_with_unpermute(x, hidden=x, output=x)\n"
        "    _hybrid_ep_buffer.dispatch_with_permute(hidden=x, **make())\n"
        "    _hybrid_ep_buffer.reset()\n"
    )
    sites = call_sites(src)
    assert sites[1].unresolved == ("**make()",)
    assert unbindable(sites, dep.HybridEPBuffer) == [
        "line 2: HybridEPBuffer.combine_with_unpermute takes no keyword output",
        "line 2: HybridEPBuffer.combine_with_unpermute: too many positional arguments",
        "line 3: cannot read **make() (extend call_sites)",
        "line 4: HybridEPBuffer has no reset",
    ]


def _routing():
    g = torch.Generator().manual_seed(3)
    top = torch.rand(TOKENS, EXPERTS, generator=g).topk(TOPK)
    routing = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, top.indices, True)
    return routing, torch.zeros(routing.shape).scatter(1, top.indices, top.values)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("num_blocks", [None, 8])
@pytest.mark.parametrize(("budget", "pad"), [(None, None), (None, 16), (128, None), (128, 16)])
def test_megatron_dispatch_combine_and_backward_run_through_the_fake(fused_a2a, fused, num_blocks, budget, pad) -> None:
    routing, probs = _routing()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4), requires_grad=True)
    probs.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # megatron's fallback to the unfused path is a UserWarning
        d, d_probs, _, counts, handle = fused_a2a.hybrid_ep_dispatch(
            x, routing, probs, None, EXPERTS, num_blocks_permute=num_blocks, num_blocks_unpermute=num_blocks,
            fused=fused, num_permuted_tokens=budget, pad_multiple=pad,
        )  # fmt: skip
        rows = counts.sum() if budget is None else budget
        y = fused_a2a.hybrid_ep_combine(d * 1.0, handle, rows, pad, fused=fused)
        (y * 3.0).sum().add(d_probs.sum()).backward()
    buf = fused_a2a._hybrid_ep_buffer
    assert isinstance(buf, dep.HybridEPBuffer) and len(handle) == dep.HANDLE_FIELDS
    calls = dict(buf.received)  # the last call of each kind
    assert calls["dispatch_with_permute"]["fuse_permute_dispatch"] is fused
    assert calls["combine_with_unpermute"]["fuse_unpermute_combine"] is fused
    assert calls["__init__"]["num_blocks_permute"] == calls["__init__"]["num_blocks_unpermute"] == num_blocks
    dispatch, combine = "dispatch_with_permute", "combine_with_unpermute"
    assert [name for name, _ in buf.received] == ["__init__", dispatch, combine, dispatch, combine]
    assert calls["dispatch_with_permute"]["handle"] is handle  # combine's backward re-dispatches with the handle
    assert int(handle[-1]) == 0 and d.shape[0] == int(rows)  # megatron reads handle[-1] as the overflow flag
    fan_out = routing.sum(1, keepdim=True).float()
    assert torch.equal(y, x.detach() * fan_out)
    assert torch.equal(x.grad, torch.full_like(x, 3.0) * fan_out)
    assert torch.equal(probs.grad, routing.float())


def test_megatron_overflow_flag_set_when_the_budget_drops_rows(fused_a2a) -> None:
    routing, probs = _routing()
    x = torch.randn(TOKENS, HIDDEN)
    d, _, _, _, handle = fused_a2a.hybrid_ep_dispatch(x, routing, probs, None, EXPERTS, num_permuted_tokens=16)
    assert d.shape[0] == 16 and int(handle[-1]) == 1


def test_megatron_falls_back_silently_with_the_drifted_fake(fused_a2a, monkeypatch) -> None:
    """Why the check must be a signature binding: megatron degrades instead of failing on the old fake."""
    monkeypatch.setattr(fused_a2a, "HybridEPBuffer", _Drifted)
    routing, probs = _routing()
    with pytest.warns(UserWarning, match="Falling back to unfused"):
        fused_a2a.hybrid_ep_dispatch(torch.randn(TOKENS, HIDDEN), routing, probs, None, EXPERTS, fused=True)
