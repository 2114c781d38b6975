"""Which MoE blocks count as ring-replaceable: ``dispatch_output`` / ``expert_output`` only where a ring takes them.

Frames as torch records them on the real HybridEP run (docs/megatron.md, "HybridEP at EP = 2"): the combine's
output and the GroupedLinear backward's gradient are MoE memory, but no ring replaces them (``moe_other``).
"""

from __future__ import annotations

import pytest

from bufreuse.analysis.snapshot.sites import RING_CATEGORIES, SiteRules

HEP = "/site/deep_ep/hybrid_ep_buffer.py"
A2A = "/site/megatron/core/transformer/moe/fused_a2a.py"
GL = "/site/transformer_engine/pytorch/module/grouped_linear.py"
TD = "/site/megatron/core/transformer/moe/token_dispatcher.py"


def _frames(*chain: tuple[str, str]) -> list[dict]:
    return [{"filename": f, "line": 10, "name": n} for f, n in chain]  # innermost first


@pytest.mark.parametrize(
    ("chain", "category"),
    [
        (((HEP, "dispatch_with_permute"), (A2A, "forward"), (TD, "dispatch")), "dispatch_output"),
        (((GL, "_validate_or_alloc_output"), (GL, "forward")), "expert_output"),
        (((HEP, "combine_with_unpermute"), (A2A, "forward"), (TD, "combine")), "moe_other"),
        (((GL, "backward"),), "moe_other"),  # FC2's dgrad: a gradient, no ring replaces it
        (((HEP, "dispatch_with_permute"), (A2A, "backward")), "moe_other"),  # combine's backward dispatch
        (((HEP, "combine_with_unpermute"), (A2A, "backward")), "moe_other"),  # dispatch's backward combine
        (((("/site/train.py", "step")),), "other"),
    ],
    ids=[
        "dispatch",
        "fc2-forward",
        "combine",
        "grouped-linear-backward",
        "backward-dispatch",
        "backward-combine",
        "not-moe",
    ],
)
def test_only_ring_replaceable_blocks_carry_a_ring_category(chain, category) -> None:
    rules = SiteRules()
    assert rules.category(_frames(*chain)) == category
    assert (category in rules.ring_category_names) == (category in RING_CATEGORIES)  # what-if's rings


def test_a_user_rule_still_comes_first() -> None:
    rules = SiteRules(categories={"mine": r"combine_with_unpermute"})
    assert rules.category(_frames((HEP, "combine_with_unpermute"))) == "mine"
