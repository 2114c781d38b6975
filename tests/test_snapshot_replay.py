"""Replay: series against a brute-force allocator model, truncation, pending-free groups, sites."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from snapshot_synth import TORCH, USER, Sim, block, entry, frame, segment

from bufreuse.analysis.snapshot.load import normalise
from bufreuse.analysis.snapshot.replay import pending_blocks_at, replay
from bufreuse.analysis.snapshot.report import ReportConfig, analyze
from bufreuse.analysis.snapshot.sites import SiteRules

MiB = 1 << 20

ops = st.lists(st.tuples(st.integers(0, 4), st.integers(1, 64 * MiB), st.sampled_from([0, 7])), min_size=1, max_size=60)


def _run(op_list: list[tuple[int, int, int]]) -> Sim:
    sim = Sim()
    for kind, size, stream in op_list:
        sim.op(kind, size, stream)
    return sim


@given(op_list=ops, cut=st.integers(0, 40))
def test_replay_matches_brute_force_model_with_truncated_trace(op_list, cut) -> None:
    sim = _run(op_list)
    cut = min(cut, len(sim.trace))
    if 0 < cut < len(sim.trace) and sim.trace[cut - 1]["action"] == "free_requested":
        cut += sim.trace[cut]["action"] == "free_completed"  # a cut inside a plain free leaves a lone completion
    data = normalise({"segments": sim.segments(), "device_traces": [sim.trace[cut:]]})
    if cut == len(sim.trace):
        assert data.traces == {}
        return
    r = replay(data.traces[0], data.final[0])
    truth = np.array(sim.series[cut:])
    assert np.array_equal(r.reserved, truth[:, 0])
    assert np.array_equal(r.allocated, truth[:, 1])
    assert np.array_equal(r.pending, truth[:, 2])
    before = sim.series[cut - 1] if cut else (0, 0, 0)
    assert r.reserved_baseline == before[0]
    assert r.max_reserved == max(before[0], int(truth[:, 0].max()))
    assert r.max_active == max(before[1] + before[2], int((truth[:, 1] + truth[:, 2]).max()))
    if cut == 0:
        assert r.frees_without_alloc == 0


@given(op_list=ops)
def test_pending_blocks_at_max_active_sum_to_pending_bytes(op_list) -> None:
    sim = _run(op_list)
    if not sim.trace:
        return
    data = normalise({"segments": sim.segments(), "device_traces": [sim.trace]})
    r = replay(data.traces[0], data.final[0])
    if r.max_active_index < 0:
        return
    blocks = pending_blocks_at(data.traces[0], r.max_active_index)
    assert sum(b.size for b in blocks) == r.pending[r.max_active_index]
    assert all(b.alloc_index >= 0 and b.alloc_index < b.free_index for b in blocks)


def _pending_snapshot() -> dict:
    """Weights allocated before recording, then 3 dispatch outputs and 1 expert output left pending."""
    disp = [TORCH, frame("/w/megatron/core/transformer/moe/token_dispatcher.py", "token_permutation"), USER]
    expert = [frame("/w/megatron/core/transformer/moe/experts.py", "expert_fc2")]
    tr = [entry("segment_alloc", 100, 64 * MiB, 7)]
    for i in range(3):
        tr += [entry("alloc", 100 + i * 8 * MiB, 8 * MiB, 7, disp)]
    tr += [entry("alloc", 200, 4 * MiB, 0, expert)]
    for i in range(3):
        tr += [entry("free_requested", 100 + i * 8 * MiB, 8 * MiB, 7)]
    tr += [entry("free_requested", 200, 4 * MiB, 0), entry("alloc", 300, 1 * MiB, 0)]
    tr += [entry("free_completed", 100 + i * 8 * MiB, 8 * MiB, 7) for i in range(3)]
    tr += [entry("free_completed", 200, 4 * MiB, 0)]
    segs = [
        segment(1, 512 * MiB, [block(1, 512 * MiB, "active_allocated", 512 * MiB)]),  # weights
        segment(100, 64 * MiB, [block(100, 64 * MiB, "inactive")], stream=7),
        segment(200, 2 * MiB, [block(200, 2 * MiB, "inactive")]),
        segment(300, 2 * MiB, [block(300, 2 * MiB, "active_allocated", 1 * MiB)]),
    ]
    return {"segments": segs, "device_traces": [tr]}


def test_report_groups_pending_free_by_site_size_stream() -> None:
    rep, _ = analyze(normalise(_pending_snapshot()), ReportConfig())
    assert rep["reserved_at_trace_start_bytes"] == 4 * MiB + 512 * MiB  # final 580 MiB - 64 MiB segment
    assert rep["max_active_bytes"] == 512 * MiB + 29 * MiB
    assert rep["pending_free_at_max_active_bytes"] == 28 * MiB
    groups = rep["pending_free_groups_at_max_active"]
    assert groups[0] == {
        "site": "moe/token_dispatcher.py:1:token_permutation",
        "size_bytes": 8 * MiB,
        "count": 3,
        "total_bytes": 24 * MiB,
        "stream": 7,
        "category": "dispatch_output",
    }
    assert groups[1]["category"] == "expert_output" and groups[1]["count"] == 1
    assert rep["pending_free_by_category_at_max_active"] == {
        "moe_other": 0,  # MoE memory no ring replaces (gradients, combine outputs): none in this trace
        "dispatch_output": 24 * MiB,
        "expert_output": 4 * MiB,
        "other": 0,
    }
    assert rep["streams"]["7"]["pending_free_at_max_active_bytes"] == 24 * MiB
    assert rep["fragmentation"]["rounding_waste_bytes"] == 1 * MiB


def test_user_category_rule_wins_over_builtin() -> None:
    rep, _ = analyze(normalise(_pending_snapshot()), ReportConfig(categories={"perm": "token_permutation"}))
    assert rep["pending_free_by_category_at_max_active"]["perm"] == 24 * MiB
    assert rep["pending_free_by_category_at_max_active"]["dispatch_output"] == 0


def test_site_skips_torch_stdlib_frozen_and_pool_frames() -> None:
    frames = [
        TORCH,
        frame("/usr/lib/python3.11/contextlib.py", "__enter__"),
        frame("<frozen runpy>", "_run_code"),
        frame("/src/bufreuse/pool/ring.py", "acquire"),
        frame("/src/bufreuse/pool/buffer_pool.py", "acquire"),
        frame("/src/model/layer.py", "forward", 42),
        frame("/src/model/train.py", "step", 7),
    ]
    assert SiteRules().site(frames) == "model/layer.py:42:forward"
    assert SiteRules(site_frame=1).site(frames) == "model/train.py:7:step"
    assert SiteRules(site_skip=[r"layer\.py$"]).site(frames) == "model/train.py:7:step"
    assert SiteRules(site_frame=5).site(frames) == "<no user frame>"


def test_frees_without_alloc_are_counted_not_fatal() -> None:
    tr = [entry("free_requested", 5, 100), entry("free_completed", 5, 100), entry("alloc", 9, 10)]
    segs = [segment(9, SEG_TOTAL, [block(9, SEG_TOTAL, "active_allocated", 10)])]
    rep, _ = analyze(normalise({"segments": segs, "device_traces": [tr]}), ReportConfig())
    assert rep["frees_without_alloc"] == 1
    assert rep["max_active_bytes"] == 100  # the block was live before the trace began
    assert any("ring buffer" in w for w in rep["warnings"])
    assert any("memory that predates recording" in w for w in rep["warnings"])


SEG_TOTAL = 2 * MiB


_any_entry = st.fixed_dictionaries(
    {
        "action": st.sampled_from(
            ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map", "oom", "x"]
        ),
        "addr": st.sampled_from([0, 64, 128, 4096]),
        "size": st.integers(0, 1 << 40),
        "stream": st.sampled_from([0, 1, 2]),
    },
    optional={"time_us": st.integers(0, 1 << 50), "frames": st.lists(st.just(USER), max_size=2)},
)
_any_block = st.fixed_dictionaries(
    {"size": st.integers(0, 1 << 30), "state": st.sampled_from(["active_allocated", "active_pending_free", "inactive"])}
)
_any_segment = st.fixed_dictionaries(
    {"total_size": st.integers(0, 1 << 32), "blocks": st.lists(_any_block, max_size=3)},
    optional={"device": st.integers(0, 2), "segment_pool_id": st.tuples(st.integers(0, 3), st.integers(0, 3))},
)


@given(
    segs=st.lists(_any_segment, max_size=4),
    traces=st.lists(st.lists(_any_entry, max_size=30), max_size=3),
)
def test_replay_fuzz_inconsistent_traces_never_crash(segs, traces) -> None:
    rep, _ = analyze(normalise({"segments": segs, "device_traces": traces}), ReportConfig(timeline_points=8))
    json.dumps(rep, allow_nan=False)
    assert rep["pending_free_at_max_active_bytes"] >= 0 or rep["warnings"]


def _impossible() -> dict:
    """A trace that allocates 200 MiB with no segment entry, against a final state of one 100 MiB segment
    (segment entries skipped, or the snapshot of another device): replayed, active tops reserved."""
    a = 1 << 32
    trace = [entry("alloc", a, 200 * MiB), entry("free_requested", a, 200 * MiB), entry("free_completed", a, 200 * MiB)]
    segs = [segment(1 << 30, 100 * MiB, [block(1 << 30, 100 * MiB, "inactive")])]
    return {"segments": segs, "device_traces": [trace]}


def test_the_headline_never_shows_max_active_above_max_reserved(tmp_path) -> None:
    from typer.testing import CliRunner

    from bufreuse.cli import app

    raw = _impossible()
    rp = replay(normalise(raw).traces[0], normalise(raw).final[0])
    assert rp.max_active == 200 * MiB  # the allocations are what the trace shows; reserved must hold them
    assert rp.max_reserved == 200 * MiB and rp.max_reserved_index == rp.max_active_index
    assert rp.max_reserved_in_segments == 100 * MiB
    assert any("max reserved is shown as max active" in w and "100.0 MiB" in w for w in rp.warnings), rp.warnings
    report, _ = analyze(normalise(raw), ReportConfig())
    assert report["max_active_bytes"] <= report["max_reserved_bytes"] == 200 * MiB
    assert report["max_reserved_in_segments_bytes"] == 100 * MiB
    import pickle

    p = tmp_path / "impossible.pickle"
    p.write_bytes(pickle.dumps(raw))
    out = CliRunner().invoke(app, ["snapshot-report", str(p)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("max reserved"))
    assert "200 MiB" in line and "at least" in line, line
    # positive control: a consistent trace (the segment allocated and freed in it) keeps its own figures
    raw["device_traces"][0][:0] = [entry("segment_alloc", 1 << 32, 200 * MiB)]
    raw["device_traces"][0].append(entry("segment_free", 1 << 32, 200 * MiB))
    ok = replay(normalise(raw).traces[0], normalise(raw).final[0])
    assert ok.max_reserved == 300 * MiB and ok.max_reserved_in_segments == ok.max_reserved
    assert not any("shown as max active" in w for w in ok.warnings)
