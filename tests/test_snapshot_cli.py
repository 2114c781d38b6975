"""`bufreuse snapshot-report` end to end: JSON lines, tables, plots, bad files among good ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from snapshot_synth import Sim, write
from typer.testing import CliRunner

from bufreuse.analysis.snapshot.batch import report_file
from bufreuse.cli import app

DATA = Path(__file__).parent / "data" / "snapshots"
RECORD_STREAM = DATA / "record_stream.pickle.gz"
OOM = DATA / "oom.pickle.gz"
runner = CliRunner()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_json_lines_match_report_file_for_each_file() -> None:
    res = runner.invoke(app, ["snapshot-report", "--json", str(RECORD_STREAM), str(OOM)])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [obj["file"] for obj in lines] == [str(RECORD_STREAM), str(OOM)]
    assert lines[0] == report_file(RECORD_STREAM)
    for key in (
        "max_reserved_bytes",
        "max_active_bytes",
        "max_active_event_index",
        "pending_free_at_max_active_bytes",
        "pending_free_groups_at_max_active",
        "pending_free_by_category_at_max_active",
        "final_state_bytes",
        "num_trace_events",
        "oom_events",
        "warnings",
    ):
        assert key in lines[1]


def test_bad_files_exit_2_one_line_each_and_good_files_still_reported(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    evil = write(tmp_path / "evil.pickle", {"segments": [_Evil()]})
    trunc = tmp_path / "trunc.pickle.gz"
    trunc.write_bytes(RECORD_STREAM.read_bytes()[:200])
    res = runner.invoke(app, ["snapshot-report", "--json", str(empty), str(RECORD_STREAM), str(evil), str(trunc)])
    assert res.exit_code == 2
    assert len(res.stdout.splitlines()) == 1 and json.loads(res.stdout)["file"] == str(RECORD_STREAM)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 3
    assert "empty.pickle" in errors[0] and "system" in errors[1] and "trunc.pickle.gz" in errors[2]
    assert "Traceback" not in res.output


def test_table_output_names_site_and_combined_worst_rank(tmp_path: Path) -> None:
    rank0 = tmp_path / "snap_rank0.pickle.gz"
    rank1 = tmp_path / "snap_rank1.pickle.gz"
    rank0.write_bytes(OOM.read_bytes())
    rank1.write_bytes(RECORD_STREAM.read_bytes())
    res = runner.invoke(app, ["snapshot-report", str(rank0), str(rank1)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "_dispatch_tokens" in res.stdout and "dispatch_output" in res.stdout
    assert "combined over 2 of 2 files" in res.stdout
    worst = [ln for ln in res.stdout.splitlines() if ln.startswith("│ pending free at max active")]
    assert worst and "snap_rank1.pickle.gz" in worst[0]  # record_stream has the most pending free at max active
    assert "OOM at event 11" in res.stdout


def test_category_option_adds_a_rule(tmp_path: Path) -> None:
    res = runner.invoke(app, ["snapshot-report", "--json", "--category", "mine=_dispatch_tok", str(RECORD_STREAM)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["pending_free_by_category_at_max_active"]["mine"] == 72 << 20


def test_bad_category_option_is_exit_2() -> None:
    res = runner.invoke(app, ["snapshot-report", "--category", "nope", str(RECORD_STREAM)])
    assert res.exit_code == 2 and "NAME=REGEX" in res.stderr


def test_plot_writes_png_per_file(tmp_path: Path) -> None:
    out = tmp_path / "t.png"
    res = runner.invoke(app, ["snapshot-report", "--json", "--plot", str(out), str(RECORD_STREAM)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_site_frame_option_moves_to_the_caller() -> None:
    res = runner.invoke(app, ["snapshot-report", "--json", "--site-frame", "1", str(RECORD_STREAM)])
    group = json.loads(res.stdout)["pending_free_groups_at_max_active"][0]
    assert group["site"].endswith(":_scenario_record_stream")


def test_processes_in_parallel_as_a_subprocess(tmp_path: Path) -> None:
    paths = []
    for k in range(3):
        sim = Sim()
        for i in range(300):
            sim.op((i * 7 + k) % 4, 1000 + i * 4096, i % 2)
        paths.append(str(write(tmp_path / f"m_{k}.pickle", {"segments": sim.segments(), "device_traces": [sim.trace]})))
    cmd = [sys.executable, "-m", "bufreuse", "snapshot-report", "--json", "--workers", "2", *paths]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert [json.loads(line)["file"] for line in out.stdout.splitlines()] == paths


def test_report_imports_no_torch_pandas_or_matplotlib() -> None:
    code = (
        "import sys; from bufreuse.analysis import report_file; "
        f"report_file({str(RECORD_STREAM)!r}); "
        "bad = [m for m in ('torch', 'pandas', 'matplotlib') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a pickle")
    env = {**os.environ, "BUFREUSE_CLI_DEBUG": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "bufreuse", "snapshot-report", str(bad)], capture_output=True, text=True, env=env
    )
    assert out.returncode != 0 and "Traceback" in out.stderr and "SnapshotFormatError" in out.stderr


def test_combined_names_megatron_rank_files() -> None:
    from bufreuse.analysis.snapshot.batch import FileResult, combine

    def res(name: str, peak: int) -> FileResult:
        return FileResult(file=f"/runs/{name}", report={"max_reserved_bytes": peak, "num_trace_events": 1})

    results = [res("snap_base_0.pickle", 5), res("snap_base_12.pickle.gz", 9), res("snap_base_3.pickle", 7)]
    figs = combine([*results, FileResult(file="/runs/bad.pickle", error="x")])
    assert combine(results)["figures"]["max_reserved_bytes"] == {
        "min": 5,
        "median": 7,
        "max": 9,
        "worst_file": "/runs/snap_base_12.pickle.gz",
        "worst_label": "snap_base_12.pickle.gz",
        "worst_rank": 12,
    }
    assert figs["failed"] == 1 and figs["reported"] == 3


def test_streams_are_named_in_the_report_not_printed_as_raw_integers() -> None:
    """torch records a stream as its cudaStream_t handle: 0 is the default stream, others read as 0x... handles.
    The bundled record_stream recording frees its dispatch blocks on a side stream (handle 972366656)."""
    from bufreuse.analysis.render.snapshot_tables import stream_name

    assert [stream_name(s) for s in (0, "0", 1, 2, 972366656, "972366656")] == [
        "default", "default", "legacy default", "per-thread default", "0x39f52340", "0x39f52340"]  # fmt: skip
    snap = Path(__file__).parent / "data" / "snapshots" / "record_stream.pickle.gz"
    res = CliRunner().invoke(app, ["snapshot-report", str(snap)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "0x39f52340" in res.stdout and "│    default │" in res.stdout
    assert "972366656" not in res.stdout  # the raw handle nowhere in the text
    data = json.loads(CliRunner().invoke(app, ["snapshot-report", str(snap), "--json"]).stdout)
    assert "972366656" in data["streams"]  # positive control: the JSON keeps the exact handle


SWEEP_SNAPSHOTS = sorted((Path(__file__).resolve().parents[1] / "examples" / "sweep-h200").glob("*/snapshot.pickle.gz"))


def test_several_files_name_their_plots_and_worst_run_by_the_file_that_tells_them_apart(tmp_path: Path) -> None:
    """The bundled H200 sweep: five runs, every file named snapshot.pickle.gz. Plots and the worst column carry
    the run's folder (the shortest path that tells the files apart), not a number or the shared file name."""
    from bufreuse.analysis.snapshot.batch import plot_stems, unique_labels

    assert len(SWEEP_SNAPSHOTS) == 5
    res = CliRunner().invoke(app, ["snapshot-report", *map(str, SWEEP_SNAPSHOTS), "--plot", str(tmp_path / "sr.png")],
                             env={"COLUMNS": "200"})  # fmt: skip
    assert res.exit_code == 0, res.output
    want = sorted(f"sr-{p.parent.name}-snapshot.png" for p in SWEEP_SNAPSHOTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == want
    reserved = {p.parent.name: report_file(p)["max_reserved_bytes"] for p in SWEEP_SNAPSHOTS}
    worst = max(reserved, key=reserved.get)
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith("│ max reserved"))
    assert f"{worst}/snapshot.pickle.gz" in row, row
    # names that already differ stay file names; a path given twice is told apart; stems are file-safe
    assert unique_labels(["a/x.pickle", "b/y.pickle"]) == ["x.pickle", "y.pickle"]
    assert unique_labels(["r/a/s.pkl", "r/b/s.pkl", "r/b/s.pkl"]) == ["a/s.pkl", "b/s.pkl", "b/s.pkl#2"]
    assert plot_stems(["r/a b/s.pickle.gz", "r/c/s.pickle.gz", "r/c/s.pickle.gz"]) == ["a_b-s", "c-s", "c-s-2"]
