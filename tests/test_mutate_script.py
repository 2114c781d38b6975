"""scripts/mutate.py: a killed, a surviving and a stale mutation on a copy of the repository."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DATA = """
[[mutation]]
name = "killed-one"
file = "bufreuse/analysis/snapshot/allocator_model.py"
original = "if size < K_MIN_LARGE_ALLOC:"
mutated = "if size <= K_MIN_LARGE_ALLOC:"
tests = ["tests/test_boundaries.py::test_segment_size_boundaries"]

[[mutation]]
name = "survivor"
file = "bufreuse/analysis/snapshot/allocator_model.py"
original = "K_ROUND_LARGE = 2 << 20"
mutated = "K_ROUND_LARGE = 4 << 20"
tests = ["tests/test_boundaries.py::test_small_and_large_pools_split_at_one_mib"]

[[mutation]]
name = "stale-one"
file = "bufreuse/analysis/snapshot/allocator_model.py"
original = "this text is in no file"
mutated = "x"
tests = ["tests/test_boundaries.py::test_segment_size_boundaries"]
"""


def test_mutate_reports_killed_survived_and_stale_without_touching_the_tree(tmp_path: Path) -> None:
    data = tmp_path / "m.toml"
    data.write_text(DATA)
    model = ROOT / "bufreuse" / "analysis" / "snapshot" / "allocator_model.py"
    before = model.read_text()
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "mutate.py"), "--data", str(data), "--json", str(out)]
    res = subprocess.run([*cmd, "--timeout", "300"], capture_output=True, text=True, timeout=600)
    assert model.read_text() == before  # the working tree is never mutated
    results = {r["name"]: r["outcome"] for r in json.loads(out.read_text())}
    # K_MIN_LARGE_ALLOC inclusive changes allocation_size(10 MiB): killed. K_ROUND_LARGE only matters for
    # requests >= 10 MiB, which the selected test never makes: it survives (the test is too narrow for it).
    assert results == {"killed-one": "killed", "survivor": "survived", "stale-one": "stale"}, res.stdout
    assert res.returncode == 1  # a stale mutation is an error of the data file
    assert "| `survivor` |" in res.stdout and "**survived**" in res.stdout


def test_quick_runs_only_the_quick_set_and_fails_on_its_survivor(tmp_path: Path) -> None:
    """``--quick`` (CI's set) takes the mutations marked ``quick = true`` and implies ``--fail-on-survivor``; a
    GPU-only mutation cannot be in it (a CPU run could never kill it): bad input, exit 2."""
    data = tmp_path / "m.toml"
    data.write_text(DATA.replace('tests = ["tests/test_boundaries.py::test_small_and_large_pools_split_at_one_mib"]',
                                 'tests = ["tests/test_boundaries.py::test_small_and_large_pools_split_at_one_mib"]\n'
                                 "quick = true"))  # fmt: skip
    cmd = [sys.executable, str(ROOT / "scripts" / "mutate.py"), "--data", str(data)]
    listed = subprocess.run([*cmd, "--quick", "--list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and [ln.split()[0] for ln in listed.stdout.splitlines()] == ["survivor"]
    res = subprocess.run([*cmd, "--quick", "--timeout", "300"], capture_output=True, text=True, timeout=600)
    assert "[1/1] survived" in res.stdout and res.returncode == 1, res.stdout  # implied --fail-on-survivor
    data.write_text(data.read_text() + "gpu_only = true\n")  # the last mutation (stale-one) quick and GPU-only
    data.write_text(data.read_text().replace('mutated = "x"\n', 'mutated = "x"\nquick = true\n'))
    bad = subprocess.run([*cmd, "--quick"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "GPU-only mutation in the quick set" in bad.stderr
