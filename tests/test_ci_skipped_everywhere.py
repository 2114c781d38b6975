"""scripts/ci/skipped-everywhere.py: conftest's outcome file and the check that no test runs nowhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "ci" / "skipped-everywhere.py"


def _check(tmp_path: Path, cpu: dict, gpu: dict | None = None, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "cpu.json").write_text(json.dumps({"tests": cpu}))
    args = [sys.executable, str(SCRIPT), str(tmp_path / "cpu.json"), *extra]
    if gpu is not None:
        (tmp_path / "gpu.json").write_text(json.dumps({"tests": gpu}))
        args += ["--gpu", str(tmp_path / "gpu.json")]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def _t(outcome: str, *markers: str, reason: str | None = None) -> dict:
    return {"outcome": outcome, "markers": list(markers), "reason": reason}


def test_skip_without_gpu_marker_runs_nowhere(tmp_path: Path) -> None:
    ok = {"a.py::ran": _t("passed"), "a.py::gpu": _t("skipped", "gpu", reason="needs a CUDA GPU")}
    assert _check(tmp_path, ok).returncode == 0  # control: gpu-marked skips are covered by the GPU run
    bad = dict(ok, **{"a.py::cuda_build": _t("skipped", reason="CPU build")})
    res = _check(tmp_path, bad)
    assert res.returncode == 1 and "runs nowhere: a.py::cuda_build" in res.stdout and "a.py::gpu" not in res.stdout


def test_gpu_marked_test_skipped_in_the_gpu_run_too_runs_nowhere(tmp_path: Path) -> None:
    cpu = {"a.py::g1": _t("skipped", "gpu"), "a.py::g2": _t("skipped", "gpu")}
    assert _check(tmp_path, cpu, {"a.py::g1": _t("passed", "gpu"), "a.py::g2": _t("passed", "gpu")}).returncode == 0
    res = _check(tmp_path, cpu, {"a.py::g1": _t("passed", "gpu"), "a.py::g2": _t("skipped", "gpu", reason="no TE")})
    assert res.returncode == 1 and "a.py::g2" in res.stdout and "a.py::g1" not in res.stdout


def test_te_only_marker_and_module_skips_run_nowhere(tmp_path: Path) -> None:
    res = _check(tmp_path, {"t.py::x": _t("skipped", "te"), "m.py": dict(_t("skipped"), collection=True)})
    assert res.returncode == 1 and "t.py::x" in res.stdout and "m.py: module skipped" in res.stdout
    assert _check(tmp_path, {"s.py::x": _t("skipped", "slurm")}, None, "--allow-marker", "slurm").returncode == 0


def test_bad_input_exits_2(tmp_path: Path) -> None:
    (tmp_path / "cpu.json").write_text("[]")
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "cpu.json")], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.startswith("error:")


def test_conftest_writes_the_outcomes_a_real_run_had(tmp_path: Path) -> None:
    """End to end: a pytest run with this repo's conftest, then the check on its file."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    assert True\n\n"
        "@pytest.mark.gpu\ndef test_gpu():\n    pass\n\n"
        "def test_skips_everywhere():\n    pytest.skip('only on a CUDA build')\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: x\n    te: x\n    slurm: x\n")
    out = tmp_path / "outcomes.json"
    env = dict(os.environ, BUFREUSE_TEST_OUTCOMES=str(out), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    tests = json.loads(out.read_text())["tests"]
    assert {k.split("::")[-1]: (v["outcome"], v["markers"]) for k, v in tests.items()} == {
        "test_runs": ("passed", []),
        "test_gpu": ("skipped", ["gpu"]),
        "test_skips_everywhere": ("skipped", []),
    }
    res = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "test_skips_everywhere" in res.stdout and "test_gpu" not in res.stdout
