"""Verdicts from the interval of the difference against the band, comparability caveats, scope refusal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from snapshot_synth import block, entry, segment

from bufreuse.analysis.render.compare_tables import comparison_text
from bufreuse.analysis.runs.compare import compare_runs, compare_specs
from bufreuse.analysis.runs.hostlist import hosts_from_names, parse_hostlist
from bufreuse.analysis.runs.record import RunRecord
from bufreuse.analysis.runs.resolve import snapshot_label
from bufreuse.analysis.runs.stats import bootstrap_diff, mean_diff_interval, summarise
from bufreuse.analysis.runs.verdicts import node_sets
from bufreuse.analysis.snapshot.load import normalise
from bufreuse.analysis.snapshot.report import ReportConfig, analyze
from bufreuse.errors import InputError

MiB = 1 << 20
NODES = hosts_from_names(["h200-a"])


def _run(label: str, step_ms: list[float], **kw) -> RunRecord:
    return RunRecord(label=label, source=Path(label), kind="sweep", step_ms=step_ms, nodes=NODES, **kw)


def _noise(n: int, centre: float, spread: float, seed: int) -> list[float]:
    return list(centre + np.random.default_rng(seed).normal(0.0, spread, n))


def _verdict(base: list[float], other: list[float], metric: str = "step_ms_median") -> str:
    (comp,) = compare_runs([_run("base", base), _run("other", other)]).comparisons
    return comp.metric(metric).verdict


@pytest.mark.parametrize("metric", ["step_ms_median", "step_ms_mean"])
def test_verdict_table_synthetic_pairs_whose_truth_is_known(metric: str) -> None:
    base = _noise(30, 100.0, 0.1, 1)
    assert _verdict(base, _noise(30, 102.0, 0.1, 2), metric) == "regression"  # +2% step time, tight noise
    assert _verdict(base, _noise(30, 98.0, 0.1, 2), metric) == "improvement"
    assert _verdict(base[:3], _noise(3, 102.0, 0.1, 2), metric) == "inconclusive"  # n = 3 < 5
    assert _verdict(base, list(base), metric) == "parity"  # identical runs
    assert _verdict(_noise(30, 100.0, 5.0, 1), _noise(30, 100.5, 5.0, 2), metric) == "inconclusive"  # wide interval
    assert _verdict(base, _noise(30, 101.0, 0.1, 2), metric) == "inconclusive"  # interval straddles the band edge


def test_too_few_samples_is_said_in_the_row() -> None:
    (comp,) = compare_runs([_run("base", [100.0] * 4), _run("other", [110.0] * 9)]).comparisons
    m = comp.metric("step_ms_median")
    assert m.verdict == "inconclusive" and "n = 4 vs 9 steady-state samples (< 5 a side)" in m.note


def test_single_figure_improvement_is_inconclusive() -> None:
    runs = [_run("base", [100.0], tflops_value=90.0), _run("other", [80.0], tflops_value=120.0)]
    (comp,) = compare_runs(runs).comparisons
    assert {m.metric: m.verdict for m in comp.metrics}["tflops"] == "inconclusive"
    assert comp.metric("step_ms_median").verdict == "inconclusive"


def test_interval_and_verdict_never_contradict() -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        base = list(rng.normal(100, rng.uniform(0.05, 3), rng.integers(5, 40)))
        other = list(rng.normal(rng.uniform(97, 103), rng.uniform(0.05, 3), rng.integers(5, 40)))
        (comp,) = compare_runs([_run("b", base), _run("o", other)]).comparisons
        for m in (comp.metric("step_ms_median"), comp.metric("step_ms_mean")):
            inside = -m.band <= m.ci_low and m.ci_high <= m.band
            assert (m.verdict == "parity") == inside
            assert (m.verdict == "regression") == (m.ci_low > m.band)
            assert (m.verdict == "improvement") == (m.ci_high < -m.band)


def test_windows_weight_the_samples() -> None:
    s = summarise([10.0, 20.0], [3, 1])
    assert (s["n"], s["mean"], s["median"]) == (2, 12.5, 10.0)
    assert summarise([1.0, 2.0, 3.0, 4.0], [1, 1, 1, 1]) == summarise([1.0, 2.0, 3.0, 4.0])
    base, other = [100.0, 101.0, 99.0, 100.5, 99.5], [102.0, 103.0, 101.0, 102.5, 101.5]
    assert bootstrap_diff(base, other, base_weights=[1] * 5, other_weights=[1] * 5) == bootstrap_diff(base, other)
    low, high = mean_diff_interval(base, other)
    assert low < 2.0 < high
    # scaling every window alike changes nothing; a long window pulls the mean towards itself
    same = mean_diff_interval(base, other, base_weights=[10] * 5, other_weights=[10] * 5)
    assert same == pytest.approx((low, high))
    wl, wh = mean_diff_interval(base, other, base_weights=[1, 1, 1, 1, 20])  # base's long window at 99.5
    assert (wl + wh) / 2 > (low + high) / 2


def _megatron(label: str, **config: str) -> RunRecord:
    run = RunRecord(label=label, source=Path(f"{label}.log"), kind="megatron", step_ms=[400.0 + i for i in range(8)])
    run.config = {"world_size": "64", "pipeline_model_parallel_size": "2", "precision": "bf16", **config}
    run.nodes = NODES
    return run


def test_runs_with_different_world_size_and_pp_list_caveats_above_the_verdicts() -> None:
    base, other = _megatron("a"), _megatron("b", world_size="128", pipeline_model_parallel_size="4")
    result = compare_runs([base, other])
    (comp,) = result.comparisons
    assert comp.comparability == [
        "configurations differ: world size 64 in a, 128 in b",
        "configurations differ: PP 2 in a, 4 in b",
    ]
    text = comparison_text(result)
    assert text.index("world size 64 in a, 128 in b") < text.index("b vs baseline a")


def test_real_logs_with_different_layouts_are_caveated(tmp_path: Path) -> None:
    from test_log_grammars import lm_line

    def log(name: str, world: int, pp: int) -> str:
        path = tmp_path / name
        args = f"  world_size ........ {world}\n  pipeline_model_parallel_size ........ {pp}\n  bf16 ........ True\n"
        path.write_text(args + "".join(lm_line(i, 400.0 + i % 3) + "\n" for i in range(1, 12)))
        return str(path)

    (comp,) = compare_specs([log("a.log", 64, 2), log("b.log", 128, 4)]).comparisons
    assert any("world size 64 in a, 128 in b" in c for c in comp.comparability)
    assert any("PP 2 in a, 4 in b" in c for c in comp.comparability)
    (same,) = compare_specs([log("c.log", 64, 2), log("d.log", 64, 2)]).comparisons
    assert same.comparability == []


def _snapshot_record(label: str) -> RunRecord:
    return RunRecord(label=label, source=Path(f"{label}.pickle"), kind="snapshot", max_reserved_bytes=10 * MiB)


def test_log_vs_snapshot_is_refused_unless_forced() -> None:
    log = _megatron("job")
    log.max_reserved_bytes = 100 * MiB
    with pytest.raises(InputError, match=r"different scopes.*--force"):
        compare_runs([log, _snapshot_record("snap")])
    (comp,) = compare_runs([log, _snapshot_record("snap")], force=True).comparisons
    assert any("different scopes" in c and "one device of one process" in c for c in comp.comparability)


def test_cli_compare_force_flag_compares_log_with_snapshot(tmp_path: Path) -> None:
    from test_compare import CONTROL_LOG
    from typer.testing import CliRunner

    from bufreuse.cli import app

    snap = Path(__file__).parent / "data" / "snapshots" / "record_stream.pickle.gz"
    runner = CliRunner()
    refused = runner.invoke(app, ["compare", str(CONTROL_LOG), str(snap)])
    assert refused.exit_code == 2 and "--force" in refused.output
    forced = runner.invoke(app, ["compare", str(CONTROL_LOG), str(snap), "--force"])
    assert forced.exit_code == 0, forced.output
    assert "different scopes" in forced.output


def test_node_sets_compare_compressed_when_too_large_to_expand() -> None:
    a, b = _megatron("a"), _megatron("b")
    a.nodes, b.nodes = parse_hostlist("n[0-999999999]"), parse_hostlist("n[0-999999999]")
    assert node_sets(a, b) == ("same", None)
    b.nodes = parse_hostlist("m[0-999999999]")
    state, caveat = node_sets(a, b)
    assert state == "differ" and "n[0-999999999] (10^9 hosts) vs m[0-999999999] (10^9 hosts)" in caveat


@pytest.mark.parametrize(
    ("name", "label"),
    [("opt-1.3b.pickle", "opt-1.3b"), ("opt-1.3b.pickle.gz", "opt-1.3b"), ("rank0.v2.pkl", "rank0.v2")],
)
def test_snapshot_labels_keep_the_stem(name: str, label: str) -> None:
    assert snapshot_label(Path(name)) == label


def _torch20_like(trace: list[dict], blocks: list[dict]) -> dict:
    return normalise({"segments": [segment(1 << 30, 64 * MiB, blocks)], "device_traces": [trace]})


def test_orphan_free_completed_is_pending_before_trace_not_record_stream() -> None:
    # torch 2.0's default trace_alloc_max_entries=1: the trace starts with a completion whose request is gone
    a, b = 1 << 30, (1 << 30) + 8 * MiB
    trace = [entry("free_completed", a, 8 * MiB), entry("alloc", b, 4 * MiB)]
    blocks = [block(a, 8 * MiB, "inactive"), block(b, 4 * MiB, "active_allocated", 4 * MiB)]
    rep, _ = analyze(_torch20_like(trace, blocks), ReportConfig())
    assert rep["max_active_bytes"] == 8 * MiB and rep["max_active_event_index"] == -1
    assert rep["pending_free_at_max_active_bytes"] == 0  # not blocks waiting on record_stream
    assert rep["pending_before_trace_at_max_active_bytes"] == 8 * MiB
    assert rep["max_active_depends_on_pending_before_trace"] is True
    assert rep["max_active_without_pending_before_trace_bytes"] == 4 * MiB
    assert rep["pending_free_groups_at_max_active"] == []
    assert any("pending free before the trace began" in w and "cause unknown" in w for w in rep["warnings"])
    assert any("max-active point moves without them" in w for w in rep["warnings"])


def test_orphan_completion_that_does_not_move_the_peak_says_so() -> None:
    a, b, c = 1 << 30, (1 << 30) + 2 * MiB, (1 << 30) + 20 * MiB
    trace = [
        entry("free_completed", a, 1 * MiB),
        entry("alloc", b, 16 * MiB),
        entry("free_requested", b, 16 * MiB),
        entry("alloc", c, 2 * MiB),
        entry("free_completed", b, 16 * MiB),
    ]
    blocks = [block(a, 2 * MiB, "inactive"), block(b, 16 * MiB, "inactive"), block(c, 2 * MiB, "active_allocated")]
    rep, _ = analyze(_torch20_like(trace, blocks), ReportConfig())
    assert rep["max_active_bytes"] == 18 * MiB and rep["pending_free_at_max_active_bytes"] == 16 * MiB
    assert rep["pending_before_trace_at_max_active_bytes"] == 0
    assert rep["max_active_depends_on_pending_before_trace"] is False
    assert any("does not move without them" in w for w in rep["warnings"])


def test_orphan_free_warning_names_memory_that_predates_recording() -> None:
    a, b = 1 << 30, (1 << 30) + 8 * MiB
    trace = [entry("free_requested", a, 8 * MiB), entry("free_completed", a, 8 * MiB), entry("alloc", b, MiB)]
    blocks = [block(a, 8 * MiB, "inactive"), block(b, MiB, "active_allocated")]
    rep, _ = analyze(_torch20_like(trace, blocks), ReportConfig())
    (warning,) = [w for w in rep["warnings"] if "frees of blocks" in w]
    assert "memory that predates recording" in warning and not warning.endswith("raise max_entries)")


def test_snapshot_record_label_through_compare(tmp_path: Path) -> None:
    src = Path(__file__).parent / "data" / "snapshots" / "empty_cache.pickle"
    one, two = tmp_path / "opt-1.3b.pickle", tmp_path / "opt-6.7b.pickle"
    for p in (one, two):
        p.write_bytes(src.read_bytes())
    result = compare_specs([str(one), str(two)])
    assert [r.label for r in result.runs] == ["opt-1.3b", "opt-6.7b"]


def test_huge_node_list_in_metrics_and_job_json_stays_compressed(tmp_path: Path) -> None:
    import json
    import time

    from test_compare import make_metrics, make_sweep

    from bufreuse.analysis.runs.resolve import resolve_runs

    env = {"slurm_nodelist": "n[0-999999999]", "world_size": 8}
    metrics = {c: make_metrics(c, env=env) for c in ("slots0", "slots4")}
    make_sweep(tmp_path, configs=("slots0", "slots4"), metrics=metrics)
    start = time.perf_counter()
    runs = resolve_runs(["control", "feature"], root=tmp_path)
    assert time.perf_counter() - start < 2.0
    assert runs[0].nodes.count == 10**9 and runs[0].node_list is None
    (comp,) = compare_runs(runs).comparisons
    assert comp.node_sets == "same"
    folder = tmp_path / "megatron"
    folder.mkdir()
    from test_log_grammars import lm_line

    (folder / "train.log").write_text("".join(lm_line(i, 400.0) + "\n" for i in range(1, 9)))
    (folder / "job.json").write_text(json.dumps({"job_id": 7, "nodelist": "gpu[0-99999999]"}))
    (run,) = resolve_runs([str(folder)])
    assert run.nodes.describe() == "gpu[0-99999999] (10^8 hosts)"
