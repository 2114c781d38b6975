"""`bufreuse demo` end to end on an examples folder built here, and on the real examples/ recordings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_compare import make_metrics, make_sweep
from typer.testing import CliRunner

from bufreuse.cli import app
from bufreuse.demo import find_sweeps, run_demo
from bufreuse.errors import InputError

runner = CliRunner()
SNAPSHOTS = Path(__file__).parent / "data" / "snapshots"
EXAMPLES = Path(__file__).parent.parent / "examples"


def _examples(tmp_path: Path, *, failed: bool = False) -> Path:
    """An examples folder like F's recordings: one eager sweep, one graph sweep, a snapshot per control."""
    ex = tmp_path / "examples"
    make_sweep(ex, "h200-eager")
    metrics = {"slots4-graph": make_metrics("slots4-graph", status="failed")} if failed else None
    make_sweep(ex, "h200-graph", ("slots0-graph", "slots4-graph"), metrics=metrics)
    shutil.copy(SNAPSHOTS / "record_stream.pickle.gz", ex / "h200-eager" / "slots0" / "snapshot.pickle.gz")
    return ex


def test_run_demo_writes_every_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = run_demo(_examples(tmp_path), out)
    assert result.sweeps == ["h200-eager", "h200-graph"]
    names = {p.relative_to(out).as_posix() for p in result.files}
    for sweep in ("h200-eager", "h200-graph"):
        for f in ("sweep-table.txt", "sweep-table.json", "sweep-table.csv", "reserved_vs_slots.png",
                  "step_time_vs_slots.png", "compare.txt", "compare.json", "compare.csv", "compare-memory.png",
                  "compare-throughput.png", "compare-iterations.png"):  # fmt: skip
            assert f"{sweep}/{f}" in names
            assert (out / sweep / f).stat().st_size > 0
    assert {"snapshots.txt", "snapshots.json", "summary.txt", "summary.json"} <= names
    assert "snapshots/h200-eager__slots0__snapshot.png" in names
    assert "pending" in (out / "snapshots.txt").read_text()
    (snap,) = json.loads((out / "snapshots.json").read_text())
    assert snap["file"] == "h200-eager/slots0/snapshot.pickle.gz" and snap["max_reserved_bytes"] > 0
    compare = json.loads((out / "h200-eager" / "compare.json").read_text())
    assert compare["baseline"] == "slots0"
    assert [c["label"] for c in compare["comparisons"]] == ["slots2", "slots4", "slots10", "stream-ordered"]
    summary = (out / "summary.txt").read_text()
    assert "slots4 peak reserved (whole process) 3,112 MiB vs control 5,672 MiB" in summary
    assert "compare slots4-graph vs slots0-graph" in summary
    assert "snapshot h200-eager/slots0/snapshot.pickle.gz" in summary


def test_run_demo_snapshot_plots_of_dotted_folders_do_not_collide(tmp_path: Path) -> None:
    ex = tmp_path / "examples"
    for name in ("run.1", "run.2"):
        make_sweep(ex, name, ("slots0", "slots4"))
        shutil.copy(SNAPSHOTS / "record_stream.pickle.gz", ex / name / "slots0" / "snapshot.pickle.gz")
    result = run_demo(ex, tmp_path / "demo")
    pngs = sorted(p.name for p in result.files if p.parent.name == "snapshots")
    assert pngs == ["run.1__slots0__snapshot.png", "run.2__slots0__snapshot.png"]


def test_run_demo_failed_configuration_is_reported(tmp_path: Path) -> None:
    ex = _examples(tmp_path, failed=True)
    (ex / "h200-graph" / "slots4-graph" / "snapshot.pickle.gz").write_bytes(b"\x1f\x8bnot a gzip stream")
    result = run_demo(ex, tmp_path / "demo")
    assert any(
        line.startswith("snapshot h200-graph/slots4-graph/snapshot.pickle.gz: unreadable") for line in result.summary
    )
    assert "h200-graph: not ok: slots4-graph failed" in result.summary
    assert "h200-graph: compare slots4-graph vs slots0-graph: failed" in result.summary


def test_run_demo_without_sweeps_raises(tmp_path: Path) -> None:
    (tmp_path / "ex").mkdir()
    with pytest.raises(InputError, match="no recorded sweep"):
        run_demo(tmp_path / "ex", tmp_path / "out")
    with pytest.raises(InputError, match="no such examples folder"):
        find_sweeps(tmp_path / "missing")


def test_cli_demo_prints_summary_and_writes_folder(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    result = runner.invoke(app, ["demo", "--examples", str(_examples(tmp_path)), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "bufreuse demo over" in result.output and "stream-ordered" in result.output
    assert f"into {out}/" in result.output
    assert (out / "h200-eager" / "compare.txt").is_file()


def test_cli_demo_missing_examples_exit_two(tmp_path: Path) -> None:
    result = runner.invoke(app, ["demo", "--examples", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "no such examples folder" in result.output


def test_cli_demo_out_is_a_file_exit_two(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("not a folder")
    result = runner.invoke(app, ["demo", "--examples", str(_examples(tmp_path)), "--out", str(tmp_path / "taken")])
    assert result.exit_code == 2, result.output
    assert "cannot write here" in result.output and "internal error" not in result.output


def test_cli_demo_live_without_cuda_exit_two(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --live would record")
    result = runner.invoke(app, ["demo", "--live", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "--live" in result.output and "CUDA" in result.output


@pytest.mark.skipif(not any(EXAMPLES.rglob("manifest.json")), reason="examples/ has no H200 recordings yet")
def test_run_demo_on_real_examples(tmp_path: Path) -> None:
    result = run_demo(EXAMPLES, tmp_path / "demo")
    assert result.sweeps and result.summary
    assert all(p.is_file() for p in result.files)
    assert result.snapshots and not [s["file"] for s in result.snapshots if "error" in s]
    for sweep in result.sweeps:
        compare = json.loads((tmp_path / "demo" / sweep.replace("/", "__") / "compare.json").read_text())
        assert compare["baseline"].startswith("slots0")
        for comp in compare["comparisons"]:
            verdicts = {m["metric"]: m["verdict"] for m in comp["metrics"]}
            assert verdicts.get("max_reserved_mib") in ("improvement", "parity", "regression")


def test_demo_and_compare_import_no_torch(tmp_path: Path) -> None:
    ex = _examples(tmp_path)
    code = (
        "import sys; from bufreuse.demo import run_demo; "
        f"run_demo({str(ex)!r}, {str(tmp_path / 'o')!r}); "
        "assert 'torch' not in sys.modules, 'the demo imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
