"""Hostile snapshot files: validated fields, budgets, exact big sizes, isolation per file, escaped rendering."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import pytest
from snapshot_synth import USER, block, entry, segment, write
from typer.testing import CliRunner

from bufreuse.analysis.render.export import renderable_text
from bufreuse.analysis.render.snapshot_tables import file_renderable
from bufreuse.analysis.snapshot import ReportConfig, analyze_file, load_snapshot, report_file, report_files
from bufreuse.analysis.snapshot import batch as batch_mod
from bufreuse.analysis.snapshot.budget import SnapshotBudgetError
from bufreuse.analysis.snapshot.validate import short
from bufreuse.cli import app
from bufreuse.errors import InputError, SnapshotFormatError
from bufreuse.limits import BudgetExceededError, Limits, override

DATA = Path(__file__).parent / "data" / "snapshots"
GOOD = DATA / "record_stream.pickle.gz"


def _trace(n: int = 20, **bad: object) -> dict:
    entries = [entry("alloc", 4096 * (i + 1), 512, frames=[USER]) for i in range(n)]
    entries[12].update(bad)
    return {"segments": [segment(0, 2 << 20, [block(0, 2 << 20, "inactive")])], "device_traces": [entries]}


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"size": 10**5000}, "device_traces[0][12].size is an int of 16,610 bits"),
        ({"size": -1}, "device_traces[0][12].size is -1"),
        ({"addr": 2**64}, "device_traces[0][12].addr is 18446744073709551616"),
        ({"stream": 1.5}, "device_traces[0][12].stream is 1.5"),
        ({"size": "x" * 10**6}, "device_traces[0][12].size is 'xxxx"),
        ({"action": ["alloc"]}, "device_traces[0][12].action is a list of 1 items"),
    ],
)
def test_bad_trace_field_names_its_path_and_a_short_value(tmp_path: Path, bad: dict, field: str) -> None:
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot(write(tmp_path / "s.pickle", _trace(**bad)))
    assert field in str(info.value)
    assert len(str(info.value)) < 300


@pytest.mark.parametrize(
    ("seg", "field"),
    [
        (segment(0, 10, [{"size": 1, "state": ["inactive"]}]), "segments[0].blocks[0].state is a list"),
        (segment(0, 10, [], device=10**6), "segments[0].device is 1000000"),
        (segment(0, 10**5000, []), "segments[0].total_size is an int of"),
        (segment(0, 10, [], segment_pool_id=[[1]] * 2), "segments[0].segment_pool_id[0] is a list"),
        (segment(0, 10, [], stream=-(2**70)), "segments[0].stream is -1180591620717411303424"),
    ],
)
def test_bad_segment_field_names_its_path(tmp_path: Path, seg: dict, field: str) -> None:
    with pytest.raises(SnapshotFormatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_snapshot(write(tmp_path / "s.pickle", {"segments": [seg], "device_traces": []}))


def test_short_never_recurses_or_prints_big_values() -> None:
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert short(deep) == "a list of 1 items"
    assert short(10**100_000).startswith("an int of")
    assert len(short("y" * 10**7)) < 80


def test_deeply_nested_pickle_is_a_format_error(tmp_path: Path) -> None:
    depth = 200_000
    nest = b"]" * depth + b"a" * (depth - 1)
    p = tmp_path / "deep.pickle"
    p.write_bytes(b"\x80\x02}X\x08\x00\x00\x00segments" + nest + b"s.")
    with pytest.raises(SnapshotFormatError, match=r"segments\[0\] is a list of 1 items, expected a dict"):
        load_snapshot(p)


def test_sizes_near_2_62_are_exact_not_wrapped(tmp_path: Path) -> None:
    big = 2**62
    entries = [entry("segment_alloc", i * big, big) for i in range(3)]
    snap = {"segments": [segment(i * big, big, [block(i * big, big, "inactive")]) for i in range(3)]}
    snap["device_traces"] = [entries]
    report = report_file(write(tmp_path / "big.pickle", snap))
    assert report["max_reserved_bytes"] == 3 * big
    assert report["final_reserved_bytes"] == 3 * big
    assert report["reserved_at_trace_start_bytes"] == 0
    assert not any("negative" in w for w in report["warnings"])


def test_memo_index_bomb_is_refused_by_the_memory_budget(tmp_path: Path) -> None:
    p = tmp_path / "memo.pickle"
    p.write_bytes(b"\x80\x02]r" + struct.pack("<I", 2**31) + b".")  # the loader would zero 16 GiB of memo
    with pytest.raises(SnapshotBudgetError, match=r"max_memory_bytes budget .*--limit max-memory-bytes=N"):
        load_snapshot(p)


def test_declared_length_beyond_the_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "len.pickle"
    p.write_bytes(b"\x80\x04\x8d" + struct.pack("<Q", 2**40) + b"abc.")
    with pytest.raises(InputError, match=r"beyond the end of the file|--max-memory-bytes"):
        load_snapshot(p)


def test_gzip_bomb_is_refused_by_the_pickle_budget(tmp_path: Path) -> None:
    payload = pickle.dumps({"segments": [], "device_traces": [], "pad": bytes(100 << 20)}, protocol=4)
    p = tmp_path / "bomb.pickle.gz"
    p.write_bytes(gzip.compress(payload, compresslevel=9))
    with pytest.raises(SnapshotBudgetError, match=r"max_pickle_bytes budget .*--max-pickle-bytes N"):
        load_snapshot(p)
    load_snapshot(p, limits=Limits(max_pickle_bytes=200 << 20))  # raised: loads
    with override(max_pickle_bytes=200 << 20):  # the same field through --limit / $BUFREUSE_LIMITS
        load_snapshot(p)


def test_shared_reference_trace_over_the_entry_budget_names_the_flag(tmp_path: Path) -> None:
    e = entry("alloc", 4096, 512)
    p = write(tmp_path / "laughs.pickle", {"segments": [], "device_traces": [[e] * 50]})  # 50 references, one dict
    match = r"trace entries: 50 exceeds the max_trace_entries budget of 10; .*--max-trace-entries"
    with pytest.raises(SnapshotBudgetError, match=match):
        load_snapshot(p, limits=Limits(max_trace_entries=10))
    assert len(load_snapshot(p).traces[0]) == 50


def test_budget_error_survives_pickling_between_processes() -> None:
    e = SnapshotBudgetError("max_blocks", value=5, limit=3, what="f.pickle: segments")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is SnapshotBudgetError and str(back) == str(e)
    assert (back.budget, back.value, back.limit) == ("max_blocks", 5, 3)
    assert "--limit max-blocks=N (or --max-blocks N" in str(back)
    assert isinstance(back, BudgetExceededError) and isinstance(back, SnapshotFormatError)


def test_budget_rejects_non_positive_values() -> None:
    with pytest.raises(InputError, match="max-trace-entries=0: must be a whole number >= 1"):
        Limits().replace(max_trace_entries=0)
    assert Limits().replace(max_pickle_bytes=None).max_pickle_bytes is None  # auto: from the file's size


def test_workers_get_the_limits_in_force(tmp_path: Path) -> None:
    """Forked workers read the Limits object they are handed, not a context that stays in the parent."""
    e = entry("alloc", 4096, 512)
    paths = [str(write(tmp_path / f"r{i}.pickle", {"segments": [], "device_traces": [[e] * 50]})) for i in range(2)]
    with override(max_trace_entries=10):
        res = report_files(paths, ReportConfig(), workers=2)
    assert [r.exit_code for r in res] == [2, 2]
    assert all("max_trace_entries budget of 10" in str(r.error) for r in res)
    assert [r.error for r in report_files(paths, ReportConfig(), workers=2)] == [None, None]


def test_worker_count_is_capped_by_files_and_cpus() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert batch_mod.worker_count(2, 99_999) == min(2, cpus)
    assert batch_mod.worker_count(10_000, 99_999) == cpus
    assert batch_mod.worker_count(3, None) == min(3, cpus)


def test_report_files_keeps_the_good_files_when_one_is_bad(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a pickle")
    results = report_files([str(GOOD), str(bad), str(GOOD)], ReportConfig(), workers=99_999)
    assert [r.report is not None for r in results] == [True, False, True]
    assert results[1].exit_code == 2 and str(bad) in (results[1].error or "")


def _dying_analyze_file(path: str, *args: object, **kwargs: object) -> object:
    if path.endswith("die.pickle"):
        os._exit(3)  # a worker killed under it (the OOM killer, say)
    return analyze_file(path, *args, **kwargs)  # type: ignore[arg-type]


def test_report_files_survives_a_worker_that_dies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    die = tmp_path / "die.pickle"
    die.write_bytes(GOOD.read_bytes())
    monkeypatch.setattr(batch_mod, "analyze_file", _dying_analyze_file)
    results = report_files([str(GOOD), str(die), str(GOOD)], ReportConfig(), workers=2)
    assert [r.report is not None for r in results] == [True, False, True]
    assert results[1].exit_code == 1 and "worker process died" in (results[1].error or "")


def test_markup_in_frames_and_actions_renders_literally(tmp_path: Path) -> None:
    frame = {"filename": "/m/[/]bad.py", "line": 3, "name": "[bold red]f[/]"}
    entries = [entry("alloc", 4096, 512, frames=[frame]), entry("free_requested", 4096, 512), entry("[/]x", 0, 0)]
    snap = {"segments": [segment(0, 2 << 20, [block(0, 2 << 20, "inactive")])], "device_traces": [entries]}
    report = report_file(write(tmp_path / "m[red].pickle", snap))
    text = renderable_text(file_renderable(report), width=200)
    assert "[/]bad.py:3:[bold red]f[/]" in text
    assert "m[red].pickle" in text.replace("\n", "")
    assert "'[/]x'" in text  # the skipped-action warning


def test_cli_markup_file_name_is_one_error_line() -> None:
    result = CliRunner().invoke(app, ["snapshot-report", "x[/].pickle"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: x[/].pickle")


def test_cli_budget_flag_is_named_and_raises_the_budget() -> None:
    small = CliRunner().invoke(app, ["snapshot-report", str(GOOD), "--max-trace-entries", "3"])
    assert small.exit_code == 2
    assert "--max-trace-entries" in small.stderr and len(small.stderr.strip().splitlines()) == 1
    assert CliRunner().invoke(app, ["snapshot-report", str(GOOD), "--max-trace-entries", "10000000"]).exit_code == 0
    # the shorthand and the global flag set the same Limits field: either one raises it, either one lowers it
    lowered = CliRunner().invoke(app, ["--limit", "max-trace-entries=3", "snapshot-report", str(GOOD)])
    assert lowered.exit_code == 2 and "max_trace_entries budget of 3" in lowered.stderr
    raised = ["--limit", "max-trace-entries=3", "snapshot-report", str(GOOD), "--max-trace-entries", "10000000"]
    assert CliRunner().invoke(app, raised).exit_code == 0
    both = CliRunner().invoke(app, ["snapshot-report", str(GOOD), str(GOOD), "--max-trace-entries", "3"])
    assert both.exit_code == 2 and both.stderr.count("max_trace_entries budget of 3") == 2  # workers saw it


def test_pending_series_near_2_63_is_exact_and_plots(tmp_path: Path) -> None:
    """int64 x uint64 is float64 in numpy: three 2^62 pending frees must sum exactly (and still plot)."""
    import warnings

    from bufreuse.analysis.render.export import png_bytes
    from bufreuse.analysis.render.plots import timeline_figure

    big = 2**62 + 7
    trace = []
    for i in range(3):
        trace += [entry("alloc", 4096 * (i + 1), big, frames=[USER]), entry("free_requested", 4096 * (i + 1), big)]
    trace += [entry("free_completed", 4096 * (i + 1), big) for i in range(3)]
    p = write(tmp_path / "big.pickle", {"segments": [], "device_traces": [trace]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "invalid value encountered in cast"
        res = analyze_file(str(p), ReportConfig(timeline_points=400))
        assert res.report is not None and res.timeline is not None
        (series,) = res.report["pending_free_series"]["sites"].values()
        assert max(series) == 3 * big == res.report["pending_free_at_max_active_bytes"]
        assert png_bytes(timeline_figure(res.timeline, title="big"))[:4] == b"\x89PNG"
