"""`bufreuse compare` end to end: table, --json, --csv, --plot, --fail-on-regression, bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_compare import CONTROL_LOG, FEATURE_LOG, LOGS, make_sweep
from typer.testing import CliRunner

from bufreuse.cli import app

runner = CliRunner()


def test_cli_compare_sweep_labels_prints_table(tmp_path: Path) -> None:
    make_sweep(tmp_path)
    result = runner.invoke(app, ["compare", "control", "feature", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for text in ("slots0", "slots4", "stream-ordered", "peak reserved (whole process) (MiB)", "improvement",
                 "ring storage"):  # fmt: skip
        assert text in result.output


def test_cli_compare_seed_logs_json_csv_and_plots(tmp_path: Path) -> None:
    csv_path, plots = tmp_path / "out" / "compare.csv", tmp_path / "plots"
    args = ["compare", str(CONTROL_LOG), str(FEATURE_LOG), "--json", "--csv", str(csv_path), "--plot", str(plots),
            "--mkdir"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    verdicts = {m["metric"]: m["verdict"] for m in data["comparisons"][0]["metrics"]}
    assert verdicts["tflops_mean"] == "inconclusive" and verdicts["max_reserved_mib"] == "parity"
    rows = list(csv.DictReader(csv_path.open()))
    assert {r["metric"] for r in rows} >= {"tflops_median", "device_used_mib"}
    assert sorted(p.name for p in plots.iterdir()) == [
        "compare-iterations.png",
        "compare-memory.png",
        "compare-throughput.png",
    ]


def test_cli_compare_fail_on_regression_exits_one(tmp_path: Path) -> None:
    args = ["compare", str(CONTROL_LOG), str(FEATURE_LOG), "--fail-on-regression", "--throughput-band", "0.5"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "regression beyond the noise band" in result.output
    assert "slurm-2796654:tflops_mean" in result.output
    assert "not counted, covered by ring storage: slurm-2796654:max_allocated_mib" in result.output


def test_cli_compare_fail_on_regression_passes_within_bands(tmp_path: Path) -> None:
    args = ["compare", str(CONTROL_LOG), str(FEATURE_LOG), "--fail-on-regression", "--throughput-band", "1.5"]
    args += ["--memory-band-mib", "2200"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output


def test_cli_compare_fail_on_regression_ring_growth_passes(tmp_path: Path) -> None:
    args = ["compare", str(CONTROL_LOG), str(FEATURE_LOG), "--fail-on-regression", "--throughput-band", "1.5"]
    # device used +1990 MiB is parity in a 2000 MiB band; allocated +2156 MiB is not, but the rings cover it
    result = runner.invoke(app, [*args, "--memory-band-mib", "2000"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "regression, explained by ring storage: 4 × 539 MiB" in result.output


def test_cli_compare_fail_on_regression_growth_beyond_rings_fails(tmp_path: Path) -> None:
    args = ["compare", str(CONTROL_LOG), str(FEATURE_LOG), "--fail-on-regression", "--throughput-band", "1.5"]
    result = runner.invoke(app, [*args, "--memory-band-mib", "1000", "--slot-mib", "expert=100"])
    assert result.exit_code == 1  # rings 400 MiB + band 1000 MiB < +2156 MiB; device +1990 fails too
    assert "slurm-2796654:max_allocated_mib" in result.output


def test_cli_compare_slot_mib_explains_allocated(tmp_path: Path) -> None:
    feature = tmp_path / "feature.out"
    feature.write_text(
        "".join(x for x in FEATURE_LOG.read_text().splitlines(True) if "moe_expert_rank_capacity_factor" not in x)
    )
    result = runner.invoke(app, ["compare", str(CONTROL_LOG), str(feature), "--slot-mib", "expert=539", "--json"])
    assert result.exit_code == 0, result.output
    comp = json.loads(result.stdout)["comparisons"][0]
    assert comp["explained"] is True and "4 × 539 MiB" in comp["explanation"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([str(LOGS / "empty.log")], "empty log"),
        ([str(LOGS / "no-iterations.log")], "no Megatron iteration lines"),
        (["slots7"], "unknown label"),
        (["missing-folder/run"], "missing-folder/run: no such file or folder"),
        (["slurm-404.out"], "slurm-404.out: no such file or folder"),
        (["--slot-mib", "expert=x", "feature"], "--slot-mib"),
    ],
)
def test_cli_compare_bad_input_one_line_exit_two(tmp_path: Path, args: list[str], message: str) -> None:
    make_sweep(tmp_path)
    result = runner.invoke(app, ["compare", "--root", str(tmp_path), "control", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
    assert "Traceback" not in result.output


def test_cli_compare_missing_sweeps_root_exit_two(tmp_path: Path) -> None:
    result = runner.invoke(app, ["compare", "control", "feature", "--root", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no sweep found" in result.output


def test_python_m_bufreuse_compare_subprocess(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bufreuse", "compare", str(CONTROL_LOG), str(FEATURE_LOG), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    comp = data["comparisons"][0]
    assert comp["node_sets"] == "differ" and comp["explained"] is True
    bad = subprocess.run([*cmd[:4], str(LOGS / "empty.log"), str(FEATURE_LOG)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and len(bad.stderr.splitlines()) == 1
