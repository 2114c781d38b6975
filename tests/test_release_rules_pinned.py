"""Four release rules the whole suite let through when broken (issue 45 item 3), each pinned by a hand-derived test.

Each test names its mutation in ``scripts/mutations.toml`` (``python scripts/mutate.py --only pinned``):

- ``mark-not-re-recorded-for-a-second-reader``: a deferred slot's second non-last reader on a stream that already
  holds a (recorded) mark must re-record it, or the final release on another stream waits only for the first;
- ``delayed-wgrad-fifo-queues-no-grad-forwards``: an evaluation forward (``torch.no_grad``) has no ``backward_dw``,
  so it queues nothing in the delayed-wgrad FIFO, or every later ``backward_dw`` finishes the wrong microbatch;
- ``auto-first-depth-planned-for-pp-rank-0``: an ``auto`` ring starts at the planner's depth for the rank it is
  installed on, not rank 0's;
- ``entry-installs-every-rank-as-pp-rank-0``: ``bufreuse-megatron`` passes the pipeline rank megatron reports.
"""

from __future__ import annotations

import argparse
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from test_release_elision import _ring  # noqa: E402  (the recording stand-ins for CUDA streams and events)

from bufreuse.pool import BufferPool  # noqa: E402
from bufreuse.pool.tracking import track_saved  # noqa: E402


def test_a_second_non_last_reader_on_a_marked_stream_re_records_its_mark() -> None:
    """Elision off (as after a producer on a second stream), a deferred slot produced on "s" with two saved references
    autograd frees on "u" one after the other and a delayed-wgrad hold finished last on "t". Derived by hand, in
    order: the producer on "s" waits on the last release (recorded on "t"); the forward reader's mark is recorded on
    "s"; the first saved reference's mark on "u"; the second reader on "u" re-records that same event (an event
    covers what its stream ran before its latest record, so without it "t" would not wait for the second read); "t"
    waits on both marks, then records the release."""
    ring, ops = _ring(slots=1)
    ring.release(ring.acquire((4, 2)))  # produced and released on "s": elided
    ops.stream = "t"
    ring.release(ring.acquire((4, 2)), "t")  # a producer on "t": the late record switches elision off
    assert not ring._elide
    slot = ring._slots[0]
    release_on_t = slot.eager_event
    ops.log.clear()
    ops.stream = "s"
    x = ring.acquire((4, 2))
    w = torch.ones(4, 2, requires_grad=True)
    with track_saved(ring._registry):
        y1, y2 = x * w, x * w  # two nodes, each saving x (a view of the slot) for w's gradient
    hold = ring.hold(x)
    assert not ring.release_when_unsaved(x)  # deferred; the forward reader's mark on "s"
    ops.stream = "u"
    del y1  # the first saved reference, freed on "u": not the last reader
    del y2  # the second, on "u" again: still not the last (the hold)
    assert ring.held == 1
    mark_s, mark_u = (m[1] for m in slot.marks)
    assert [m[0] for m in slot.marks] == ["s", "u"]
    hold.done("t")
    assert ops.log == [
        ("wait", release_on_t, "s"),
        ("record", mark_s, "s"),
        ("record", mark_u, "u"),
        ("record", mark_u, "u"),  # the second reader on "u"
        ("wait", mark_s, "t"),
        ("wait", mark_u, "t"),
        ("record", release_on_t, "t"),
    ], ops.log
    assert ring.held == 0


@pytest.mark.parametrize("mode", ["production", "debug"])
def test_an_evaluation_forward_queues_nothing_in_the_delayed_wgrad_fifo(parallel, mode: str) -> None:
    """TE-style delayed wgrad (one bf16 local expert: FC1's wgrad store keeps the dispatch slot until
    ``backward_dw``). One forward under ``torch.no_grad`` (an evaluation step: no backward, no ``backward_dw``),
    then F0 F1 B0 B1 W0 W1. By hand: after W0 only microbatch 1's slot is held (1), after W1 none (0); a FIFO that
    queued the evaluation forward pops its entry at W0 (2 held) and leaves microbatch 1's slot held after W1 (1),
    off by one for the rest of the run. Outputs and every gradient bit-equal to the control."""
    from schedule_harness import mode_env
    from test_schedule_harness import CPU_ROWS, _forward, _inputs, build_layer, install, knobs_for

    row = next(r for r in CPU_ROWS if r.name == "te-fake-e1-delay_wgrad_compute-1f1b_dw")

    def run(rings: bool) -> tuple[list, list[int]]:
        layer = build_layer(row)
        pool = BufferPool("cpu")
        xs = _inputs(row, 3)
        leaves = [x.clone().requires_grad_(True) for x in xs[:2]]
        held: list[int] = []
        inst = install(layer, pool, knobs_for(row), tokens=16) if rings else None
        try:
            with mode_env(mode):
                with torch.no_grad():
                    evaluated = _forward(layer, xs[2], 2)
                if rings:
                    assert pool.get("dispatch_output").held == 0  # released at once: nothing saved under no_grad
                outs = [_forward(layer, leaves[i], i) for i in (0, 1)]
                for i in (0, 1):
                    g = torch.Generator().manual_seed(2000 + i)
                    outs[i].backward(torch.randn(outs[i].shape, generator=g).to(outs[i].dtype))
                for _ in (0, 1):
                    layer.backward_dw()
                    held.append(pool.get("dispatch_output").held if rings else -1)
        finally:
            if inst is not None:
                inst.uninstall()
        grads = [p.grad.clone() for _, p in sorted(layer.named_parameters()) if p.grad is not None]
        return [evaluated, *(o.detach() for o in outs), *(x.grad for x in leaves), *grads], held

    ref, _ = run(rings=False)
    got, held = run(rings=True)
    assert held == [1, 0], f"slots held after W0, W1: {held} (the evaluation forward was queued)"
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


# -- the pipeline rank, at install() and through bufreuse-megatron ------------------------------------------

PP, PER_STAGE, MICROBATCHES = 4, 2, 8
"""PP 4, 1F1B, 8 microbatches, 2 MoE layers per stage, the dispatch slot saved by the bf16 expert GEMM (released after
the backward): rank r keeps min(m, PP - r) microbatches in flight, each holding one slot per MoE layer, so rank 3
needs 2 x min(8, 1) = 2 slots and rank 0 needs 2 x min(8, 4) = 8 (``bufreuse plan --pp-rank``)."""
RANK3_MIN, RANK0_MIN = PER_STAGE * min(MICROBATCHES, PP - 3), PER_STAGE * min(MICROBATCHES, PP - 0)


def _stage_model():
    from test_integrations_planned import _stage_model as stage

    return stage(PP, PER_STAGE)


def _dispatch_knobs(slots: int | str):
    from bufreuse.config import BufReuseConfig

    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=slots,
        moe_bufreuse_ring_identity_dispatch=True,  # EP = 1 here: exercise the dispatch ring
    )


@pytest.mark.parametrize(("rank", "start"), [(3, RANK3_MIN), (0, RANK0_MIN)])
def test_an_auto_ring_starts_at_the_depth_planned_for_its_pipeline_rank(parallel, rank: int, start: int) -> None:
    from bufreuse.integrations.megatron import install

    assert (RANK3_MIN, RANK0_MIN) == (2, 8)
    pool = BufferPool("cpu")
    model = _stage_model()
    with install(model, pool, _dispatch_knobs("auto"), tokens=16, num_microbatches=MICROBATCHES, pp_rank=rank) as i:
        assert i.auto_start == {"dispatch_output": start}, i.auto_start
        assert pool.get("dispatch_output").num_slots == start


def _entry_args(slots: int) -> argparse.Namespace:
    """What megatron's parser would hold: our knobs (parsed by our own ``add_arguments``) and the schedule fields."""
    from bufreuse.config import add_arguments

    ns = add_arguments(argparse.ArgumentParser()).parse_args([
        "--moe-hybridep-reuse-dispatch-output-buffers", "--moe-hybridep-num-dispatch-output-buffers", str(slots),
        "--moe-bufreuse-ring-identity-dispatch",
    ])  # fmt: skip
    ns.seq_length, ns.micro_batch_size, ns.global_batch_size, ns.data_parallel_size = 8, 2, 2 * MICROBATCHES, 1
    return ns


@pytest.mark.parametrize("rank", [3, 0])
def test_the_entry_installs_for_the_pipeline_rank_megatron_reports(parallel, monkeypatch, capsys, rank: int) -> None:
    """``Session.install`` (what the wrapped model provider calls) with megatron's pipeline rank 3 of 4: 2 dispatch
    slots are rank 3's minimum, accepted; at rank 0 the same knobs are refused naming 8 (the positive control)."""
    from megatron.core import parallel_state as ps

    from bufreuse.errors import ConfigError
    from bufreuse.integrations import entry

    args = _entry_args(RANK3_MIN)
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: rank)
    assert entry._schedule(args) == (MICROBATCHES, rank)
    session = entry.Session()
    try:
        if rank == 0:
            with pytest.raises(ConfigError, match=f"below the planner's minimum {RANK0_MIN} .*PP rank 0 of {PP}"):
                session.install(_stage_model())
            return
        session.install(_stage_model())
        (inst,) = session.installations
        assert inst.pp_rank == rank and inst.layers == PER_STAGE
        assert "hooked 2 MoE layer(s)" in capsys.readouterr().out
    finally:
        session.close()
