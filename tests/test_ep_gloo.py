"""Expert parallelism on CPU: real megatron-core 0.19.2 at EP = 2, EP = 4 and EP x expert TP = 2 x 2 over gloo.

Each world (2 or 4 processes) runs its cases once (``tests/ep_harness.py``: control twice, then each arm installed
as production installs it, in production and debug mode); each arm of each case is one test here, its id ending in
the arm: ``-production``, ``-kept`` (``moe_bufreuse_keep_unused_rings``), and ``-stood-down`` where the arm hooks
no ring at all (install's rule leaves every ring unused there: the arm runs the control's own code, so its
bit-equality says nothing about the rings and is not counted as evidence). The arms that hook rings are the
correctness evidence, and every schedule order has some in every world, compared output by output and gradient
by gradient (``test_every_order_has_ring_evidence_in_every_world``). ``BUFREUSE_EP_FULL=1`` adds the cross
product of orders, local experts, routings, policies and dtypes to every world. The release rule broken on purpose
(``ep_harness.break_release_rule``) must turn the report red.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from ep_harness import (  # noqa: E402
    MICROBATCHES,
    RINGS,
    Case,
    World,
    WorldResult,
    arm_rings,
    arms,
    break_cases,
    build_layer,
    cpu_cases,
    expected_dispatch,
    knobs_for,
    routing,
    run_world,
)

from bufreuse.integrations.megatron import install  # noqa: E402
from bufreuse.plan.rules import ReleasePoint, release_rule  # noqa: E402
from bufreuse.pool import BufferPool  # noqa: E402

FULL = os.environ.get("BUFREUSE_EP_FULL", "") not in ("", "0")
WORLDS = {"ep2": (2, 1), "ep4": (4, 1), "ep2xetp2": (2, 2)}
CASES = {key: cpu_cases(ep, etp, full=FULL) for key, (ep, etp) in WORLDS.items()}
_RESULTS: dict[str, WorldResult] = {}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Runs a world the first time one of its cases is asked for; every later case reads its report."""

    def get(key: str) -> WorldResult:
        if key not in _RESULTS:
            if key == "break":
                ep, etp, cases = 2, 1, break_cases()
            else:
                (ep, etp), cases = WORLDS[key], CASES[key]
            _RESULTS[key] = run_world(ep, etp, cases, workdir=Path(tmp_path_factory.mktemp(key)), timeout_s=600)
        return _RESULTS[key]

    return get


ARMS = {(k, c.name): arm_rings(c, *WORLDS[k]) for k, cases in CASES.items() for c in cases}
"""The arms of each case and the rings each hooks, by install's rule (known before any world runs)."""


def _arm_id(key: str, case: Case, arm: str, rings: list[str]) -> str:
    return f"{key}-{case.name}-{arm}" + ("" if rings else "-stood-down")


@pytest.mark.parametrize(
    ("key", "case", "arm", "rings"),
    [pytest.param(k, c, a, r, id=_arm_id(k, c, a, r)) for k, cases in CASES.items() for c in cases
     for a, r in ARMS[(k, c.name)]],
)  # fmt: skip
def test_ep_arm_bit_equal_to_control_with_derived_splits_and_releases(
    worlds, key: str, case: Case, arm: str, rings: list[str]
) -> None:
    result = worlds(key)
    failure = result.failure(case.name, arm)
    assert failure is None, failure
    runs = 2 if case.sync_check else 1  # the steady-state protocol runs each layer twice
    for rep in result.by_case[case.name]:
        modes = rep["info"]["arms"][arm]
        assert set(modes) == {"production", "debug"}
        for mode, r in modes.items():
            assert r["rings"] == rings and r["hooked_layers"] == (1 if rings else 0), (arm, mode, r)  # as the id says
            assert r["bit_equal"] and r["compared"]["outputs"] == MICROBATCHES, (arm, mode, r)
            assert r["compared"]["grads"] == 2 * MICROBATCHES and r["compared"]["param_grads"] > 0, r["compared"]
            assert all(r["stats"][n]["acquisitions"] == runs * MICROBATCHES for n in rings), r["stats"]
            if not rings:  # stood down: nothing of the layer replaced (the control's code ran)
                assert not [s for s in r["sites"] if not s.startswith("experts.linear_fc2")], r["sites"]


def test_every_order_has_ring_evidence_in_every_world() -> None:
    """The correctness evidence: in every world, every schedule order has a case whose ring-policy arm hooks both
    rings (``kept`` where production's rule leaves them unused), so both rings' slots are reused across that order's
    interleaving and compared output by output and gradient by gradient (``test_ep_arm_...``, which also checks the
    arm ran on them). Stood-down arms are not counted."""
    from schedule_harness import ORDERS

    for key, cases in CASES.items():
        covered = {c.order for c in cases if c.policy == "ring" and c.expect == "bit-equal"
                   for _, rings in ARMS[(key, c.name)] if rings == sorted(RINGS)}  # fmt: skip
        assert covered == set(ORDERS), (key, set(ORDERS) - covered)
    stood = [_arm_id(k, c, a, r) for (k, name), arm in ARMS.items() for c in CASES[k] if c.name == name
             for a, r in arm if not r]  # fmt: skip
    assert stood and all(i.endswith("-production-stood-down") for i in stood), stood  # only production stands down


def _ringed(rep: dict) -> dict:
    """The modes of the arm that hooked the dispatch ring (``kept`` where production's rule leaves it unused)."""
    arms = rep["info"]["arms"]
    return next(m for a, m in sorted(arms.items(), reverse=True) if "dispatch_output" in m["production"]["rings"])


def _deferred(reports: list, mode: str) -> list[int]:
    return [_ringed(r)[mode]["stats"]["dispatch_output"]["deferred_releases"] for r in reports]


def test_routing_features_happen_on_some_rank(worlds) -> None:
    """The uneven routings did what they are for (read from megatron's own counts in the control): a rank that
    received nothing, a local expert with no token beside one with tokens, uneven splits; and the empty dispatch
    released at once where the slot is otherwise saved (fewer deferrals than microbatches)."""
    ep2 = worlds("ep2")
    empty = ep2.by_case["l1-dropless-empty"]
    assert any(0 in r["info"]["dispatch_rows"] for r in empty)
    assert all(0 < d < MICROBATCHES for d in _deferred(empty, "production"))  # 1 local expert: saved unless empty
    skewed = ep2.by_case["l2-dropless-skewed"]
    per_expert = [counts for r in skewed for counts in r["info"]["tokens_per_local_expert"]]
    assert any(0 in c and max(c) > 0 for c in per_expert), per_expert
    rows = [n for r in ep2.by_case["l2-dropless-random"] for n in r["info"]["dispatch_rows"]]
    assert len(set(rows)) > 1, rows  # uneven splits
    pad = [n for r in ep2.by_case["l2-pad-1f1b"] for n in r["info"]["dispatch_rows"]]
    assert len(set(pad)) == 1  # positive control: pad-to-capacity sends equal rows
    assert _deferred(ep2.by_case["l1-pad-1f1b"], "production") == [MICROBATCHES] * 2
    assert _deferred(ep2.by_case["l2-pad-1f1b"], "production") == [0, 0]  # the local sort copies the slot


def test_broken_release_rule_goes_red(worlds) -> None:
    """Break the release rule at EP = 2 (``break_release_rule``: the dispatch slot is released at the end of the
    experts stage although FC1 saved it): missing deferrals at the planned depth, and at a shallow depth the next
    dispatch overwrites what a backward reads (FC1's weight gradient differs). Positive controls: the unbroken twin
    passes, and the unbroken shallow ring refuses with EarlyReuseError instead of corrupting."""
    res = worlds("break")
    assert res.failure("unbroken-1f1b") is None
    assert res.failure("unbroken-shallow-fwd_bwd") is None
    for rep in res.by_case["unbroken-shallow-fwd_bwd"]:
        assert all("early_reuse" in r for r in _ringed(rep).values())

    broken = res.by_case["broken-1f1b"]
    for rep in broken:
        prod = [p for p in rep["problems"] if "/production]" in p]
        assert any(f"0 deferred releases, derived from the routing: {MICROBATCHES}" in p for p in prod), prod
        assert any("release check" in p and "observed 0 of 4" in p for p in prod), prod
        assert not [p for p in rep["problems"] if "/debug]" in p]  # the debug guard still counts the save
    assert _deferred(broken, "production") == [0, 0] and _deferred(broken, "debug") == [MICROBATCHES] * 2

    # dropless: half the acquisitions are empty (never deferred), the rest saved by FC1; the release check is exact
    # over the non-empty ones, so the broken rule's 0 deferrals go red there too
    assert res.failure("unbroken-dropless-empty-1f1b") is None
    half = MICROBATCHES // 2
    unbroken = res.by_case["unbroken-dropless-empty-1f1b"]
    assert [r["info"]["dispatch_rows"].count(0) for r in unbroken] == [half] * 2  # positive control: empties happen
    assert _deferred(unbroken, "production") == [half] * 2
    for rep in res.by_case["broken-dropless-empty-1f1b"]:
        prod = [p for p in rep["problems"] if "/production]" in p]
        assert any("release check" in p and f"observed 0 of {MICROBATCHES}" in p and f"predicts {half}" in p
                   for p in prod), prod  # fmt: skip
        assert not [p for p in rep["problems"] if "/debug]" in p]

    for rep in res.by_case["broken-shallow-fwd_bwd"]:
        prod = [p for p in rep["problems"] if "/production]" in p]
        assert any("param grad" in p and "linear_fc1" in p for p in prod), prod  # overwritten before its backward
        assert any("deferred releases" in p for p in prod), prod
        debug = [p for p in rep["problems"] if "/debug]" in p]
        assert any("EarlyReuseError" in p for p in debug), debug  # counted: the shallow ring refuses instead


def test_install_hooks_no_ring_at_ep1_with_the_same_knobs(parallel) -> None:
    """Positive control of the EP >= 2 cases' "both rings hooked": the same layer and knobs at EP = 1 hook nothing."""
    import dataclasses

    from bufreuse.config import BufReuseConfig

    keep = {"moe_bufreuse_keep_unused_rings": True}  # the EP >= 2 kept arm's knob keeps nothing at EP = 1
    assert dataclasses.replace(BufReuseConfig(), **keep).moe_bufreuse_keep_unused_rings  # the knob exists by this name
    for policy, extra in (("ring", {}), ("stream-ordered", {}), ("ring", keep)):
        case = Case(name="ep1", experts=2, policy=policy, dropless=True)
        layer = build_layer(case, 1, 1, "cpu")
        pool = BufferPool("cpu")
        with install(layer, pool, dataclasses.replace(knobs_for(case), **extra), tokens=16) as inst:
            assert inst.layers == 0 and set(inst.unused) == set(RINGS), inst.unused
            assert pool.names() == []
            assert not {"token_dispatch", "combine_preprocess", "token_combine"} & set(vars(layer.token_dispatcher))
            assert "forward" not in vars(layer.experts)


def test_overlap_cases_say_they_set_only_the_flag() -> None:
    """The harness drives the layer's stages itself, not megatron's combined-1F1B schedule, so
    ``overlap_moe_expert_parallel_comm`` is only a config flag here (install's rule reads it;
    ``ScheduleNode.free_input`` and the comm stream never run): every case that sets it for its own sake says so in
    its name."""
    cases = [c for ep, etp in WORLDS.values() for c in cpu_cases(ep, etp, full=True) if c.overlap]
    assert cases and all("flag-only" in c.name for c in cases), [c.name for c in cases]


def test_the_kept_arm_sets_the_keep_knob_where_the_rule_leaves_a_ring_unused() -> None:
    """``arms``: where install's rule leaves a ring unused at EP 2 (no EP overlap), a ``kept`` arm with
    ``moe_bufreuse_keep_unused_rings`` set; where it leaves none unused (EP overlap with one FP8 local expert), the
    production arm alone. The knob is set by name, so a rename fails here instead of dropping the arm."""
    w = World(ep=2, etp=1, rank=0, device="cpu", ep_group=[0, 1], tp_ep_group=[0])
    got = arms(Case(name="plain", experts=2, topk=1), w)
    assert [a for a, _ in got] == ["production", "kept"]
    assert not got[0][1].moe_bufreuse_keep_unused_rings and got[1][1].moe_bufreuse_keep_unused_rings
    both_used = arms(Case(name="overlap-fp8", experts=2, topk=1, overlap=True, fp8="hybrid"), w)
    assert [a for a, _ in both_used] == ["production"]


def test_dispatch_rule_names_empty_dispatches_and_stays_exact() -> None:
    """At EP > 1 without pad-to-capacity a rank's dispatch can be empty and is then released at the forward: the rule
    says so, and stays exact (not ``data_dependent``: release_check leaves the pool's empty acquisitions out)."""
    base = dict(moe_token_dispatcher_type="alltoall", num_moe_experts=2, expert_model_parallel_size=2)
    dropless = release_rule(dict(base, moe_pad_expert_input_to_capacity=False), "dispatch")
    assert dropless.point is ReleasePoint.BACKWARD and not dropless.data_dependent
    assert "receives no tokens" in dropless.reason and "moe_pad_expert_input_to_capacity" in dropless.fields
    wgrad = release_rule(dict(base, delay_wgrad_compute=True), "dispatch")
    assert wgrad.point is ReleasePoint.WGRAD and not wgrad.data_dependent and "receives no tokens" in wgrad.reason
    padded = release_rule(dict(base, moe_pad_expert_input_to_capacity=True), "dispatch")
    assert padded.point is ReleasePoint.BACKWARD and "receives no tokens" not in padded.reason
    ep1 = release_rule(dict(base, num_moe_experts=1, expert_model_parallel_size=1), "dispatch")
    assert ep1.point is ReleasePoint.BACKWARD and "receives no tokens" not in ep1.reason
    sorted_copy = release_rule(dict(base, num_moe_experts=4), "dispatch")  # two local experts: the sort copies
    assert sorted_copy.point is ReleasePoint.FORWARD and "receives no tokens" not in sorted_copy.reason
    assert not release_rule(dict(base), "expert").data_dependent


def test_expected_splits_are_summed_from_every_ranks_routing(monkeypatch) -> None:
    """``expected_dispatch`` on hand-made routing maps (EP = 2, two local experts, ETP = 1), counted by hand."""
    import ep_harness

    maps = {
        0: torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool),
        1: torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1], [1, 0, 0, 1]], dtype=torch.bool),
    }
    monkeypatch.setattr(ep_harness, "routing", lambda case, ep, sender, mb: (maps[sender], None))
    case = Case(name="hand", experts=4)
    r0 = expected_dispatch(case, 2, [0, 1], [0, 1], 0, 0)
    assert r0.input_splits == [3, 3] and r0.output_splits == [3, 1] and r0.per_local_expert == [3, 1]
    r1 = expected_dispatch(case, 2, [0, 1], [0, 1], 1, 0)
    assert r1.input_splits == [1, 4] and r1.output_splits == [3, 4] and r1.per_local_expert == [2, 5]


def test_routings_are_top_k_and_exclude_what_they_say() -> None:
    case = Case(name="r", experts=4, topk=2)
    for kind in ("random", "skewed", "empty"):
        c = Case(name=kind, experts=4, topk=2, routing=kind)
        for mb in range(MICROBATCHES):
            for sender in (0, 1):
                rmap, probs = routing(c, 2, sender, mb)
                assert (rmap.sum(1) == 2).all() and torch.allclose(probs.sum(1), torch.ones(len(probs)))
                assert ((probs > 0) == rmap).all()
                if kind == "skewed":
                    assert not rmap[:, (mb % 2) * 2 + 1].any()
                if kind == "empty":
                    empty = (mb + 1) % 2
                    assert not rmap[:, empty * 2 : empty * 2 + 2].any()
    with pytest.raises(ValueError, match="leaves 1 experts for top-2"):
        routing(Case(name="x", experts=2, topk=2, routing="empty"), 2, 0, 0)
    assert routing(case, 2, 0, 0)[0].tolist() != routing(case, 2, 1, 0)[0].tolist()  # per-rank seeds


def test_cpu_shims_stand_in_for_megatron_lines_that_still_assume_cuda() -> None:
    """Each shim names a megatron-core line; if that line stops assuming CUDA, the shim is stale and this fails."""
    import inspect

    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    for fn in (mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim, mappings._AllToAll.forward):
        assert "device=torch.cuda.current_device()" in inspect.getsource(fn), fn.__qualname__
    assert "torch.distributed.all_gather(output_tensor_list" in inspect.getsource(mappings._gather_along_first_dim)
    assert "torch.distributed.reduce_scatter(output" in inspect.getsource(mappings._reduce_scatter_along_first_dim)
    dtoh = inspect.getsource(D._maybe_dtoh_and_synchronize)
    assert "torch.cuda.current_stream()" in dtoh and "self.cuda_dtoh_stream" in dtoh and ".synchronize()" in dtoh
    assert "torch.cuda.Stream()" in inspect.getsource(D.__init__)
