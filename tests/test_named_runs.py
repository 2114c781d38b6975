"""A run the user named that yields no comparison is an error (one line, exit 2); inside a whole-sweep
comparison it stays a labelled failed row (issue 46 item 8).

The sweep is the bundled H200 recording with one ``metrics.json`` spoiled: a wrong type (``"lots"``) or NaN
where a size in bytes belongs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bufreuse.analysis.runs.compare import compare_runs
from bufreuse.analysis.runs.record import MIB, RunRecord
from bufreuse.cli import app
from bufreuse.errors import InputError

runner = CliRunner()
SWEEP = Path(__file__).resolve().parents[1] / "examples" / "sweep-h200"
SPOILS = {"wrong-type": "lots", "nan": float("nan")}


def _spoiled(tmp_path: Path, spoil: str) -> Path:
    root = tmp_path / "examples"
    shutil.copytree(SWEEP, root / "sweep-h200")
    f = root / "sweep-h200" / "slots4" / "metrics.json"
    data = json.loads(f.read_text())
    data["max_reserved_bytes"] = SPOILS[spoil]
    f.write_text(json.dumps(data))  # NaN is written as the bare token NaN, as json.dumps does
    return root


def _run(argv: list[str]) -> tuple[int, str, str]:
    res = runner.invoke(app, argv, env={"COLUMNS": "200"})
    assert "Traceback" not in res.output and "internal error" not in res.output, res.output
    return res.exit_code, res.stdout, res.stderr or ""


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


@pytest.mark.parametrize("spoil", sorted(SPOILS))
def test_named_run_without_a_comparison_exits_two(tmp_path: Path, spoil: str) -> None:
    root = _spoiled(tmp_path, spoil)
    sweep = root / "sweep-h200"
    for argv in (
        ["compare", "control", "slots4", "--root", str(root)],
        ["compare", str(sweep / "slots0"), str(sweep / "slots4")],
        ["compare", str(sweep / "slots0"), str(sweep / "slots2"), str(sweep / "slots4"), "--json"],
    ):
        code, out, err = _run(argv)
        assert code == 2, (argv, out)
        line = _one_error_line(err)
        assert "slots4 yields no comparison with slots0" in line and "max_reserved_bytes" in line, line
        assert out == ""  # no table before the error: a gate reads nothing half-done


@pytest.mark.parametrize("spoil", sorted(SPOILS))
def test_whole_sweep_keeps_the_failed_run_as_a_labelled_row(tmp_path: Path, spoil: str) -> None:
    root = _spoiled(tmp_path, spoil)
    for argv in (["compare", "control", "feature", "--root", str(root)], ["compare", str(root / "sweep-h200")]):
        code, out, _ = _run(argv)
        assert code == 0, out
        assert "slots4: status failed; no metrics compared" in out
        assert "refused: max_reserved_bytes" in out
        assert "slots2 vs baseline slots0" in out  # the other runs are still compared
    code, out, _ = _run(["compare", str(root / "sweep-h200"), "--json"])
    data = json.loads(out)
    failed = next(c for c in data["comparisons"] if c["label"] == "slots4")
    assert failed["status"] == "failed" and all(m["verdict"] == "n/a" for m in failed["metrics"])


@pytest.mark.parametrize("spoil", sorted(SPOILS))
def test_demo_over_a_spoiled_sweep_exits_two_before_writing(tmp_path: Path, spoil: str) -> None:
    root = _spoiled(tmp_path, spoil)
    out_dir = tmp_path / "out"
    code, out, err = _run(["demo", "--examples", str(root), "--out", str(out_dir)])
    assert code == 2, out
    line = _one_error_line(err)
    assert "slots4/metrics.json: refused: max_reserved_bytes" in line and "slots4" in line, line
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_unspoiled_sweep_demo_and_named_compare_exit_zero(tmp_path: Path) -> None:
    """Positive control: the same commands over the sweep as bundled."""
    root = tmp_path / "examples"
    shutil.copytree(SWEEP, root / "sweep-h200")
    assert _run(["compare", "control", "slots4", "--root", str(root)])[0] == 0
    assert _run(["demo", "--examples", str(root), "--out", str(tmp_path / "out")])[0] == 0


def _mem_run(label: str, reserved_mib: int | None, **kw: object) -> RunRecord:
    run = RunRecord(label=label, source=Path(label), kind="sweep", **kw)  # type: ignore[arg-type]
    run.max_reserved_bytes = None if reserved_mib is None else reserved_mib * MIB
    return run


def test_library_rule_named_versus_group() -> None:
    base = _mem_run("a", 1000)
    failed = _mem_run("b", None, status="failed")
    failed.warnings.append("status failed: out of memory")
    with pytest.raises(InputError, match="b yields no comparison with a: status failed: out of memory"):
        compare_runs([base, failed])
    grouped = _mem_run("b", None, status="failed", named=False)
    result = compare_runs([base, grouped])
    assert [m.verdict for m in result.comparisons[0].metrics] == ["n/a"]


def test_named_ok_run_with_no_figure_in_common_names_what_each_has() -> None:
    base = _mem_run("a", 1000)
    other = _mem_run("b", None)
    other.max_allocated_bytes = 500 * MIB
    with pytest.raises(InputError, match=r"no figure in common \(baseline has max_reserved_mib; this run has "
                                         r"max_allocated_mib\)"):  # fmt: skip
        compare_runs([base, other])
    other.max_reserved_bytes = 1000 * MIB  # one figure in common: compared (parity)
    assert compare_runs([base, other]).comparisons[0].metric("max_reserved_mib").verdict == "parity"
