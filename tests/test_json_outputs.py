"""Every ``--json`` (and the JSON files the demo and ``bench --output`` write) is free of float noise.

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


NOISE = (8297.6 + 8297.7) / 2  # 8297.650000000001


def test_check_config_json_is_free_of_float_noise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bufreuse.integrations.check_file as cf

    real = cf.check_file

    class Noisy:  # the real report, plus a float the way a median or a ratio comes out
        def __init__(self, report: Any) -> None:
            self.report = report

        def to_dict(self) -> dict[str, Any]:
            return {**self.report.to_dict(), "figure": NOISE}

    monkeypatch.setattr(cf, "check_file", lambda *a, **k: Noisy(real(*a, **k)))
    p = tmp_path / "args.txt"
    p.write_text("--num-layers 8\n--hidden-size 1024\n--moe-hybridep-reuse-dispatch-output-buffers\n")
    res = runner.invoke(app, ["check-config", str(p), "--json"])
    assert res.exit_code in (0, 1), res.output
    data = json.loads(res.stdout)
    assert data["figure"] == 8297.65 and "requirements" in data and _noisy(data) == []


@pytest.mark.parametrize("which", ["pool", "layer"])
def test_bench_json_and_output_file_are_free_of_float_noise(
    which: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bufreuse.bench.layer_bench as lb
    import bufreuse.bench.pool_bench as pb

    result = {"cpu_tensors": True, "rows": [{"name": "ring", "us_per_pair": NOISE, "ratio": 0.1 + 0.2, "n": 3}]}
    target, fn = (pb, "run_pool_bench") if which == "pool" else (lb, "run_layer_bench")
    monkeypatch.setattr(target, fn, lambda cfg, progress=None: result)
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", which, "--device", "cpu", "--json", "--output", str(out)])
    assert res.exit_code == 0, res.output
    for data in (json.loads(res.stdout), json.loads(out.read_text())):
        assert data["rows"][0] == {"name": "ring", "us_per_pair": 8297.65, "ratio": 0.3, "n": 3}
        assert _noisy(data) == []
    assert _noisy(result)  # positive control: what the bench returned was noisy


def test_sweep_json_is_free_of_float_noise(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(SWEEP, tmp_path / "sweep-h200")
    median = json.loads((SWEEP / "slots4" / "metrics.json").read_text())["step_ms"]["median"]
    assert median == 45.14259147644043 and _noisy(median)  # positive control: the recorded figure is noisy
    args = ["sweep", "--slots", "0,2,4,10", "--modes", "stream-ordered", "--root", str(tmp_path),
            "--name", "sweep-h200", "--timeout", "120", "--json"]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    rows = {r["config_id"]: r for r in payload["rows"]}
    assert rows["slots4"]["step_ms"] == 45.14259148 and rows["slots4"]["step_delta_pct"] is not None
    assert _noisy(payload) == []


def test_sweep_status_and_cancel_json_pass_the_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No float in these payloads today; they go through the same encoder, so one added later is cut too."""
    import shutil

    import bufreuse.analysis.render.export as export

    seen: list[Any] = []
    real = export.json_text
    monkeypatch.setattr(export, "json_text", lambda obj, **k: seen.append(obj) or real(obj, **k))
    folder = tmp_path / "sweep-h200"
    shutil.copytree(SWEEP, folder)
    for option in ("--status", "--cancel"):
        res = runner.invoke(app, ["sweep", option, str(folder), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["folder"] == str(folder) == seen[-1]["folder"]
    assert len(seen) == 2 and "states" in seen[0] and "cancelled" in seen[1]
