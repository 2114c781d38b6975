"""The committed benchmark generator makes the snapshot shape the performance target names."""

from __future__ import annotations

from script_module import load_script

from bufreuse.analysis.snapshot.load import normalise
from bufreuse.analysis.snapshot.report import ReportConfig, analyze

gen = load_script("gen_big_snapshot")


def test_generator_shape_matches_the_benchmark_spec() -> None:
    snap = gen.generate(20_000, seed=1)
    trace = snap["device_traces"][0]
    assert len(trace) == 20_000
    assert {e["stream"] for e in trace} == set(gen.STREAMS)
    assert all(len(e["frames"]) == 12 for e in trace)
    assert len({id(e["frames"]) for e in trace}) == len(trace)  # a fresh frame list per event
    sizes = [e["size"] for e in trace if e["action"] == "alloc"]
    assert min(sizes) >= 512 and max(sizes) <= 64 << 20 and max(sizes) > 16 << 20
    # at least 10% of frees go through the pending-free state (completion not the next entry)
    reqs = [i for i, e in enumerate(trace[:-1]) if e["action"] == "free_requested"]
    queued = [i for i in reqs if trace[i + 1]["action"] != "free_completed" or trace[i + 1]["addr"] != trace[i]["addr"]]
    assert len(queued) >= 0.1 * len(reqs)


def test_generated_snapshot_replays_consistently() -> None:
    rep, _ = analyze(normalise(gen.generate(5_000, seed=2)), ReportConfig())
    assert rep["reserved_at_trace_start_bytes"] == gen.WEIGHTS
    assert rep["warnings"] == []
    assert rep["max_active_bytes"] >= gen.WEIGHTS
    assert rep["pending_free_at_max_active_bytes"] == sum(
        g["total_bytes"] for g in rep["pending_free_groups_at_max_active"]
    )
