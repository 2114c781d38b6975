"""``compare`` and ``demo --examples`` over sweeps whose files hold wrong types, NaN or negative figures.

Each case is the bundled H200 sweep (``examples/sweep-h200``) with one file changed: the commands end in
one ``error:`` line and exit 2, or report and name the refused run (exit 0/1), never an internal error.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bufreuse.cli import app

runner = CliRunner()
SWEEP = Path(__file__).resolve().parents[1] / "examples" / "sweep-h200"


def _set(*keys: str, value: Any) -> Callable[[dict], Any]:
    def edit(d: dict) -> dict:
        at = d
        for k in keys[:-1]:
            at = at[k]
        at[keys[-1]] = value
        return d

    return edit


CASES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    # wrong types
    "error-number": ("slots4/metrics.json", _set("error", value=5)),
    "config-text": ("slots4/metrics.json", _set("config", value="ring")),
    "slots-huge": ("slots0/metrics.json", _set("config", "slots", value=1e308)),
    "slots-text": ("slots4/metrics.json", _set("config", "slots", value="four")),
    "world-size-text": ("slots0/metrics.json", _set("env", "world_size", value="x")),
    "env-list": ("slots4/metrics.json", _set("env", value=[1])),
    "manifest-list": ("manifest.json", lambda d: [d]),
    "manifest-number": ("manifest.json", lambda d: 7),
    # NaN and negative figures
    "checksum-nan": ("slots4/metrics.json", _set("checksum", value=float("nan"))),
    "error-nan": ("slots0/metrics.json", _set("error", value=float("inf"))),
    "reserved-negative": ("slots4/metrics.json", _set("max_reserved_bytes", value=-1)),
    "median-below-p10": ("slots4/metrics.json", _set("step_ms", "median", value=0.0)),
    "p90-huge-median": ("slots0/metrics.json", _set("step_ms", "p10", value=1e308)),
    "reserved-zero": ("slots0/metrics.json", _set("max_reserved_bytes", value=0)),
}


_READ_AS_IS = {"reserved-zero", "config-text", "env-list"}
"""Cases the demo reports as they are: a measured 0, and shapes the sweep table does not read (compare's reader
names them: one error line)."""


def _sweep(tmp_path: Path, case: str) -> Path:
    root = tmp_path / "examples"
    shutil.copytree(SWEEP, root / "sweep-h200")
    rel, edit = CASES[case]
    f = root / "sweep-h200" / rel
    f.write_text(json.dumps(edit(json.loads(f.read_text()))))
    return root


def _outcome(argv: list[str]) -> tuple[int, list[str], str]:
    res = runner.invoke(app, argv, env={"COLUMNS": "160"})
    lines = [ln for ln in (res.stderr or "").splitlines() if ln.strip()]
    assert "internal error" not in res.output and "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    if res.exit_code == 2:
        assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    else:
        assert res.exit_code in (0, 1), res.output
    return res.exit_code, lines, res.stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_compare_and_demo_over_a_bad_sweep_end_in_one_line_or_name_the_run(tmp_path: Path, case: str) -> None:
    root = _sweep(tmp_path, case)
    _outcome(["compare", "control", "feature", "--root", str(root)])
    code, _, out = _outcome(["demo", "--examples", str(root), "--out", str(tmp_path / "out")])
    if code == 0 and CASES[case][0].endswith("metrics.json") and case not in _READ_AS_IS:
        run = CASES[case][0].split("/")[0]
        assert f"{run} failed" in out or f"{run}: failed" in out or "refused" in out, out


def test_the_unchanged_sweep_reports_every_run(tmp_path: Path) -> None:
    """Positive control: the copy as bundled compares and demos cleanly with every run ok."""
    root = tmp_path / "examples"
    shutil.copytree(SWEEP, root / "sweep-h200")
    code, _, out = _outcome(["compare", "control", "feature", "--root", str(root)])
    assert code == 0 and "refused" not in out
    code, _, out = _outcome(["demo", "--examples", str(root), "--out", str(tmp_path / "out")])
    assert code == 0 and "failed" not in out, out
