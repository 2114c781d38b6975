"""Every ``--json`` of the analysis commands (and the demo's JSON files) is free of float noise.

Floats pass :func:`bufreuse.analysis.render.export.json_ready` at the boundary: a non-whole float keeps
10 significant digits, so ``(8297.6 + 8297.7) / 2`` prints ``8297.65``, not ``8297.650000000001``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bufreuse.analysis.render.export import json_ready, json_text
from bufreuse.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "examples" / "sweep-h200"
SNAP = SWEEP / "slots0" / "snapshot.pickle.gz"
LOGS = ROOT / "tests" / "data" / "logs"


def _noisy(obj: Any, path: str = "") -> list[str]:
    """Floats printed with more than 10 significant digits (what float noise looks like)."""
    if isinstance(obj, float):
        digits = re.sub(r"\D", "", repr(obj).split("e")[0]).lstrip("0")
        return [f"{path}={obj!r}"] if len(digits) > 10 else []
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _noisy(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [x for i, v in enumerate(obj) for x in _noisy(v, f"{path}[{i}]")]
    return []


def test_json_ready_cuts_noise_and_keeps_what_was_measured() -> None:
    assert (8297.6 + 8297.7) / 2 == 8297.650000000001  # the noise, as the issue saw it
    assert json_ready({"m": [(8297.6 + 8297.7) / 2, 0.1 + 0.2]}) == {"m": [8297.65, 0.3]}
    # whole floats (byte counts as floats), ints, bools, tiny and huge values, NaN: unchanged
    for x in (2.0**52, 141_733_920_768.0, 7, True, 1.961e-07, -6.25e-05, 123456.789):
        assert json_ready(x) == x and type(json_ready(x)) is type(x)
    assert json.loads(json_text({"x": 1 / 3})) == {"x": 0.3333333333}
    with pytest.raises(ValueError):
        json_text({"x": float("nan")})


def _log(path: Path, times: list[float]) -> Path:
    path.write_text("".join(
        f" iteration {i:8d}/     100 | consumed samples: {64 * i:12d} | elapsed time per iteration (ms): {t} |"
        f" throughput per GPU (TFLOP/s/GPU): {t / 20} | lm loss: 7.1E+00 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 |\n"
        for i, t in enumerate(times, start=1)
    ))  # fmt: skip
    return path


def test_compare_json_median_prints_without_float_noise(tmp_path: Path) -> None:
    a = _log(tmp_path / "a.log", [9000.0] * 3 + [8297.6, 8297.7] * 5)
    b = _log(tmp_path / "b.log", [9000.0] * 3 + [8297.6, 8297.7] * 5)
    res = runner.invoke(app, ["compare", str(a), str(b), "--json"])
    assert res.exit_code == 0, res.output
    assert "8297.650000000001" not in res.stdout and "8297.65" in res.stdout
    assert _noisy(json.loads(res.stdout)) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", str(LOGS / "slurm-2796012.out"), str(LOGS / "slurm-2796654.out")],
        ["compare", "control", "feature", "--root", str(ROOT / "examples")],
        ["what-if", str(SNAP), "--slots", "2,4"],
        ["advise", str(SNAP)],
        ["snapshot-report", str(SNAP)],
        ["snapshot-diff", str(SNAP), str(SWEEP / "slots2" / "snapshot.pickle.gz")],
    ],
    ids=["compare-logs", "compare-sweep", "what-if", "advise", "snapshot-report", "snapshot-diff"],
)
def test_every_analysis_json_is_free_of_float_noise(argv: list[str]) -> None:
    res = runner.invoke(app, [*argv, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert _noisy(data) == []
    # positive control: the checker sees the noise json_ready takes out
    assert _noisy({"x": 1112.3407407407408}) and not _noisy(json_ready({"x": 1112.3407407407408}))


def test_demo_json_files_are_free_of_float_noise(tmp_path: Path) -> None:
    res = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo")])
    assert res.exit_code == 0, res.output
    files = sorted((tmp_path / "demo").rglob("*.json"))
    assert files
    for f in files:
        assert _noisy(json.loads(f.read_text())) == [], f
