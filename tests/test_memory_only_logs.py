"""Memory-only logs (the ``[Rank N] ... memory (MB)`` lines people paste into issues) compare on memory, and a
log with neither iteration lines nor readable memory reports is refused naming what was found (issue 46 item 9).

The fixtures are synthetic, in Megatron's ``report_memory`` format (``tests/data/logs/README.md``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bufreuse.analysis.runs.megatron_log import parse_log
from bufreuse.analysis.runs.resolve import resolve_runs
from bufreuse.cli import app
from bufreuse.errors import LogFormatError

runner = CliRunner()
LOGS = Path(__file__).resolve().parent / "data" / "logs"
CONTROL, RINGS = LOGS / "memory-only-control.log", LOGS / "memory-only-rings.log"
UNKNOWN = LOGS / "memory-unknown-shape.log"


def _peaks(path: Path) -> tuple[float, float]:
    """Max of 'max allocated' and of 'max reserved' over the file's lines, read by hand (split on '|')."""
    alloc, reserved = [], []
    for line in path.read_text().splitlines():
        fields = dict(p.strip().split(": ", 1) for p in line.split("|")[1:])
        alloc.append(float(fields["max allocated"]))
        reserved.append(float(fields["max reserved"]))
    return max(alloc), max(reserved)


def test_memory_only_run_resolves_with_its_peaks_and_scope() -> None:
    (run,) = resolve_runs([str(CONTROL)])
    alloc, reserved = _peaks(CONTROL)
    assert run.memory_only and run.kind == "megatron" and not run.step_ms and not run.tflops
    assert run.max_allocated_bytes == round(alloc * 2**20) and run.max_reserved_bytes == round(reserved * 2**20)
    assert "over the 4 rank(s) it reports (0, 1, 2, 3)" in run.warnings[0]


def test_two_memory_only_logs_compare_on_memory() -> None:
    res = runner.invoke(app, ["compare", str(CONTROL), str(RINGS), "--json"])
    assert res.exit_code == 0, res.output
    comp = json.loads(res.stdout)["comparisons"][0]
    (a_alloc, a_res), (b_alloc, b_res) = _peaks(CONTROL), _peaks(RINGS)
    verdicts = {m["metric"]: (m["delta"], m["verdict"]) for m in comp["metrics"]}
    assert set(verdicts) == {"max_allocated_mib", "max_reserved_mib"}  # no throughput row on either side
    band = 64.0  # max(64 MiB, 0.1% of ~42-47 GiB = 42-47 MiB)
    assert verdicts["max_allocated_mib"] == (pytest.approx(b_alloc - a_alloc), "regression")  # +512 > band
    assert b_alloc - a_alloc > band and a_res - b_res > band
    assert verdicts["max_reserved_mib"] == (pytest.approx(b_res - a_res), "improvement")
    assert not any("node sets unknown" in c for c in comp["caveats"])  # no throughput compared: no such caveat
    assert any(c.startswith("the baseline memory-only-control has memory reports only") for c in comp["caveats"])
    text = runner.invoke(app, ["compare", str(CONTROL), str(RINGS)]).stdout
    assert "--warmup" not in text  # no log windows to drop


def test_memory_only_against_a_full_log_compares_memory_and_leaves_throughput_n_a() -> None:
    res = runner.invoke(app, ["compare", str(CONTROL), str(LOGS / "slurm-2796012.out"), "--json"])
    assert res.exit_code == 0, res.output
    metrics = {m["metric"]: m["verdict"] for m in json.loads(res.stdout)["comparisons"][0]["metrics"]}
    assert metrics["max_reserved_mib"] == "regression" and metrics["tflops_mean"] == "n/a"


def test_unknown_memory_shape_is_refused_naming_what_was_found() -> None:
    with pytest.raises(LogFormatError) as e:
        parse_log(UNKNOWN, memory_only=True)
    msg = str(e.value)
    assert "found 2 other non-empty line(s)" in msg and "0 memory report(s)" in msg
    assert "2 'memory (MB)' line(s) in no known shape" in msg
    res = runner.invoke(app, ["compare", str(CONTROL), str(UNKNOWN)])
    assert res.exit_code == 2 and "2 'memory (MB)' line(s) in no known shape" in res.stderr


def test_strict_parse_still_refuses_a_memory_only_log_and_names_its_reports() -> None:
    """megatron_collect reads iteration lines: the default parse refuses, naming the 4 reports it read."""
    with pytest.raises(LogFormatError, match=r"of those, 4 memory report\(s\)"):
        parse_log(RINGS)
