"""The comparison the H200 HybridEP test relies on (``tests/hybridep_compare.py``), shown to pass and to fail on CPU.

The "real" side here is the fake itself, untouched (nothing may be reported) or altered the way a real
kernel could differ: rows of one expert in another order, other padding, a changed combine row.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fakes import deep_ep_hybrid as dep  # noqa: E402
from hybridep_compare import compare_combine, compare_dispatch, make_inputs, token_ids  # noqa: E402

TOKENS, HIDDEN, EXPERTS, TOPK = 40, 16, 4, 2


def _dispatch(pad=None, budget=None, seed=1):
    x, rm, probs = make_inputs(TOKENS, HIDDEN, EXPERTS, TOPK, seed=seed)
    buf = dep.HybridEPBufferUpstream(None, HIDDEN, TOKENS, EXPERTS)
    out = buf.dispatch_with_permute(
        hidden=x, routing_map=rm, probs=probs, num_of_experts_per_rank=EXPERTS, pad_multiple=pad,
        num_permuted_tokens=budget, non_blocking=budget is not None,
    )  # fmt: skip
    return buf, x, rm, out


def test_inputs_name_their_tokens_exactly() -> None:
    x, rm, probs = make_inputs(600, HIDDEN, EXPERTS, TOPK, seed=0)
    assert token_ids(x) == list(range(600))
    assert x.dtype == torch.bfloat16 and rm.sum(1).eq(TOPK).all() and probs.dtype == torch.float32
    assert torch.equal(probs > 0, rm)


@pytest.mark.parametrize(("pad", "budget"), [(None, None), (16, None), (16, 256), (None, 24)])
def test_the_fake_against_itself_reports_nothing(pad, budget) -> None:
    _, _, rm, out = _dispatch(pad, budget)
    facts, bad = compare_dispatch(out, _dispatch(pad, budget)[3])
    assert bad == []
    assert all(e["order_equal"] and e["rows_bit_equal"] and e["probs_equal"] for e in facts["per_expert"])
    # the recorded order is the fake's claim: tokens ascending within each expert
    kept = [e["tokens_fake"] for e in facts["per_expert"]]
    assert all(t == sorted(t) for t in kept)
    if budget is None:
        assert [sorted(t) for t in kept] == [rm[:, e].nonzero().flatten().tolist() for e in range(EXPERTS)]
    assert facts["handle_last_overflow"]["real"] == [int(budget == 24)]


def test_rows_of_one_expert_in_another_order_are_reported() -> None:
    _, _, _, out = _dispatch()
    real = list(out)
    first = int(out[3][0])
    assert first >= 2
    perm = torch.arange(out[0].shape[0])
    perm[[0, 1]] = perm[[1, 0]]
    real[0], real[1] = out[0][perm], out[1][perm]
    facts, bad = compare_dispatch(tuple(real), out)
    assert bad == [f"expert 0: {k} is False" for k in ("order_equal", "rows_bit_equal", "probs_equal")]
    assert facts["per_expert"][0]["same_token_set"] is True


def test_other_padding_and_counts_are_reported() -> None:
    _, _, _, padded = _dispatch(pad=16)
    _, _, _, plain = _dispatch()
    facts, bad = compare_dispatch(padded, plain)
    assert any(m.startswith("rows:") for m in bad)
    assert any(m.startswith("tokens_per_expert_padded:") for m in bad)
    assert not any("handle7" in m for m in bad)  # raw counts agree: only the padding differs
    assert facts["real_padding_rows_zero"] == [True] * EXPERTS


def test_padding_rows_that_are_not_zero_are_reported() -> None:
    _, _, _, out = _dispatch(pad=16)
    counts, padded = out[4][7], out[3]
    e = int(torch.nonzero(padded > counts)[0, 0])  # the first expert with padding rows
    row = int(padded[:e].sum() + counts[e])  # its first padding row
    real = list(out)
    real[0] = out[0].clone()
    real[0][row, 3] = 1
    facts, bad = compare_dispatch(tuple(real), out)
    assert bad == [f"expert {e}: padding rows are not zero"]
    assert facts["real_padding_rows_zero"] == [i != e for i in range(EXPERTS)]


def test_combine_rows_compared_bit_for_bit_routed_and_unrouted_apart() -> None:
    buf, _, _, out = _dispatch(budget=24)  # drops rows: some tokens keep no expert
    y = buf.combine_with_unpermute(hidden=out[0] * 2, handle=out[4])[0]
    kept = (out[4][0] >= 0).any(1)
    assert 0 < int(kept.sum()) < TOKENS
    assert compare_combine("y", y, y.clone(), kept)[1] == []
    changed = y.clone()
    changed[kept.nonzero()[0, 0], 2] += 1
    assert compare_combine("y", changed, y, kept)[1] == ["y: routed tokens differ (max abs diff 1.0)"]
    garbage = y.clone()
    garbage[(~kept).nonzero()[0, 0]] = 7
    facts, bad = compare_combine("y", garbage, y, kept)
    assert bad == ["y: rows of tokens with no kept expert differ (the fake returns zeros)"]
    assert facts["y"]["unrouted_tokens"] == TOKENS - int(kept.sum())
    assert compare_combine("p", None, y, kept)[1] == ["p: one side is None"]


def test_the_overflow_flag_is_compared_only_with_a_budget() -> None:
    """Upstream leaves handle[-1] unwritten on the dynamic path (megatron reads it only with a static budget)."""
    out = _dispatch(16, 1024)[3]
    real = list(out)
    real[4] = (*out[4][:-1], torch.tensor(16256))  # what an H100 returned on the dynamic path
    assert any("overflow" in m for m in compare_dispatch(tuple(real), out)[1])  # with a budget: a mismatch
    facts, bad = compare_dispatch(tuple(real), out, budget=False)
    assert not any("overflow" in m for m in bad) and facts["handle_last_overflow"]["compared"] is False
