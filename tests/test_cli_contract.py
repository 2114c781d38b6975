"""The CLI contract, case by case: bad input ends in one ``error:`` line, the right exit code, no traceback, fast.

Each row is (command, bad input) from issue 18 or its neighbours. Rows that could cost real resources if the
contract broke (forking workers, allocating buffers) run in a subprocess with a hard timeout; the rest use
CliRunner. Nothing here submits a job or runs a configuration: every refusal happens before that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bufreuse.cli import app

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
CONTROL_LOG = DATA / "logs" / "slurm-2796012.out"
FEATURE_LOG = DATA / "logs" / "slurm-2796654.out"
CONFIG = DATA / "megatron" / "hybridep-ready.yaml"
SNAPSHOT = DATA / "snapshots" / "no_history.pickle"

Argv = Callable[[Path], list[str]]


@dataclass(frozen=True)
class Case:
    id: str
    argv: Argv
    """The command line, given a folder holding the fixture files (see :func:`ws`)."""
    code: int = 2
    subprocess: bool = False
    """Run ``python -m bufreuse`` with a timeout (resource cases), not CliRunner."""
    budget_s: float = 10.0
    shows: Callable[[Path], str] | None = None
    """A text the error line must contain literally (user strings are printed as typed)."""
    env: dict[str, str] = field(default_factory=dict)


def _sweep(*extra: str) -> Argv:
    return lambda w: ["sweep", "--workload", "cpu-smoke", "--root", str(w / "sweeps"), *extra]


def _slurm(*extra: str) -> Argv:
    return lambda w: [*_sweep("--launcher", "slurm", "--dry-run")(w), *[e.replace("{w}", str(w)) for e in extra]]


def _w(*args: str) -> Argv:
    return lambda w: [a.replace("{w}", str(w)) for a in args]


# fmt: off
CASES = [
    # rich markup in the user's own strings
    Case("sweep-name-markup", _sweep("--name", "[/]"), shows=lambda w: "'[/]'"),
    Case("snapshot-missing-markup-name", _w("snapshot-report", "{w}/x[/].pickle"), shows=lambda w: "x[/].pickle"),
    Case("snapshot-missing-red-name", _w("snapshot-report", "{w}/snap[red].pickle.gz"),
         shows=lambda w: "snap[red].pickle.gz"),
    # values that used to end in "internal error"
    Case("sweep-comm-ms-nan", _sweep("--comm-ms", "nan")),
    Case("sweep-comm-ms-inf", _sweep("--comm-ms", "inf")),
    Case("sweep-comm-ms-negative", _sweep("--comm-ms", "-1")),
    Case("sweep-timeout-nan", _sweep("--timeout", "nan")),
    Case("sweep-timeout-zero", _sweep("--timeout", "0")),
    Case("sweep-root-is-a-file", _w("sweep", "--workload", "cpu-smoke", "--root", "{w}/afile"),
         shows=lambda w: "afile"),
    Case("sweep-root-proc", _w("sweep", "--workload", "cpu-smoke", "--root", "/proc"), shows=lambda w: "/proc"),
    Case("sweep-slurm-site-binary", _slurm("--slurm-site", "{w}/bin.dat"), shows=lambda w: "bin.dat"),
    Case("sweep-slurm-site-missing", _slurm("--slurm-site", "{w}/nosuch.yaml")),
    Case("sweep-slurm-site-yaml-bomb", _slurm("--slurm-site", "{w}/laughs.yaml"), shows=lambda w: "max_yaml_aliases"),
    Case("sweep-template-binary", _slurm("--template", "{w}/bin.dat"), shows=lambda w: "bin.dat"),
    Case("sweep-template-missing", _slurm("--template", "nosuch.j2")),
    Case("sweep-slurm-poll-negative", _sweep("--launcher", "slurm", "--slurm-poll", "-1")),
    Case("sweep-slurm-poll-nan", _sweep("--launcher", "slurm", "--slurm-poll", "nan")),
    Case("sweep-tokens-huge", _sweep("--tokens", "99999999999"), shows=lambda w: "--limit max-dim"),
    Case("sweep-hidden-zero", _sweep("--hidden", "0")),
    Case("sweep-slots-huge", _sweep("--slots", "0,99999999999"), shows=lambda w: "max_ring_slots"),
    Case("sweep-slots-not-numbers", _sweep("--slots", "a,b")),
    Case("sweep-status-not-a-sweep", _w("sweep", "--status", "{w}")),
    Case("bench-pool-huge-shape", _w("bench", "pool", "--rows", "99999999999", "--hidden", "99999999999")),
    Case("bench-pool-cpu-100000-slots", _w("bench", "pool", "--device", "cpu", "--ring-slots", "100000"),
         subprocess=True, budget_s=60),
    Case("bench-pool-output-wrong-extension", _w("bench", "pool", "--device", "cpu", "--output", "{w}/r.txt")),
    # usage errors: one line, not Click's boxed panel
    Case("usage-unknown-option", _w("sweep", "--bogus")),
    Case("usage-bad-integer", _w("bench", "pool", "--ring-slots", "x")),
    Case("usage-below-minimum", _w("bench", "pool", "--ring-slots", "0")),
    Case("usage-missing-argument", _w("snapshot-report")),
    Case("usage-unknown-command", _w("snapshot-reprot", "x")),
    # budgets
    Case("snapshot-workers-99999", _w("snapshot-report", str(SNAPSHOT), "{w}/a.pickle", "--workers", "99999"),
         subprocess=True, budget_s=30),
    Case("limit-unknown-budget", _w("--limit", "max-bogus=1", "snapshot-report", "{w}/a.pickle")),
    Case("limit-zero", _w("--limit", "max-dim=0", "snapshot-report", "{w}/a.pickle")),
    Case("limit-env-garbage", _sweep("--tokens", "8"), env={"BUFREUSE_LIMITS": "max-dim=lots"}),
    # check-config bounds
    Case("check-config-seq-length-huge", _w("check-config", str(CONFIG), "--seq-length", "1" + "0" * 26)),
    Case("check-config-micro-batch-huge", _w("check-config", str(CONFIG), "--micro-batch-size", "999999999")),
    Case("check-config-missing-file", _w("check-config", "{w}/nosuch.yaml")),
    # outputs
    Case("snapshot-plot-wrong-extension", _w("snapshot-report", str(SNAPSHOT), "--plot", "{w}/out.txt")),
    Case("snapshot-plot-missing-folder", _w("snapshot-report", str(SNAPSHOT), "--plot", "{w}/no/such/t.png"),
         shows=lambda w: "--mkdir"),
    Case("compare-csv-wrong-extension", _w("compare", str(CONTROL_LOG), str(FEATURE_LOG), "--csv", "{w}/c.png")),
    Case("compare-csv-missing-folder", _w("compare", str(CONTROL_LOG), str(FEATURE_LOG), "--csv", "{w}/no/c.csv")),
    Case("compare-plot-is-a-file", _w("compare", str(CONTROL_LOG), str(FEATURE_LOG), "--plot", "{w}/afile")),
    Case("compare-band-nan", _w("compare", str(CONTROL_LOG), str(FEATURE_LOG), "--throughput-band", "nan")),
    Case("demo-out-missing-parent", _w("demo", "--out", "{w}/no/such/demo")),
    # a check that ran and did not pass: exit 1, still one line
    Case("compare-fail-on-regression", _w("compare", str(CONTROL_LOG), str(FEATURE_LOG), "--fail-on-regression"),
         code=1),
]
# fmt: on


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files the bad inputs point at: a binary file, a plain file, a YAML alias bomb."""
    w = tmp_path_factory.mktemp("contract")
    (w / "bin.dat").write_bytes(b"\x00\x01\xff\xfe" * 64)
    (w / "afile").write_text("not a folder\n")
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 201)]
    (w / "laughs.yaml").write_text("\n".join(lines) + "\n")  # 2000 aliases, 10^200 strings if expanded
    return w


def _run_bounded(argv: list[str], *, env: dict[str, str], timeout_s: float) -> tuple[int, str, str]:
    """``python -m bufreuse argv`` in its own session; past ``timeout_s`` the whole group is killed (workers too)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bufreuse", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{argv} ran past {timeout_s} s")
    finally:
        with contextlib.suppress(ProcessLookupError):  # leftover workers of a broken run
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stdout, stderr


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_error_line_and_exit_code(case: Case, ws: Path) -> None:
    argv = case.argv(ws)
    start = time.monotonic()
    if case.subprocess:
        code, stdout, stderr = _run_bounded(argv, env=case.env, timeout_s=case.budget_s)
    else:
        result = CliRunner().invoke(app, argv, env=case.env or None)
        code, stdout, stderr = result.exit_code, result.stdout, result.stderr
        assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    elapsed = time.monotonic() - start
    shown = f"argv={argv}\nstdout={stdout[-2000:]}\nstderr={stderr}"
    assert code == case.code, shown
    errors = _error_lines(stderr)
    assert len(errors) == 1, shown
    assert "Traceback" not in stderr and "internal error" not in stderr and "╭" not in stderr, shown
    assert elapsed < case.budget_s, f"{case.id} took {elapsed:.1f} s"
    if case.shows is not None:
        assert case.shows(ws) in errors[0], shown


def test_contract_table_covers_the_issue_cases() -> None:
    ids = {c.id for c in CASES}
    assert len(CASES) >= 40
    for needed in ("sweep-name-markup", "snapshot-missing-markup-name", "sweep-comm-ms-nan", "sweep-timeout-nan",
                   "sweep-root-is-a-file", "sweep-root-proc", "sweep-slurm-site-binary", "sweep-template-binary",
                   "bench-pool-huge-shape", "bench-pool-cpu-100000-slots", "sweep-slurm-poll-negative",
                   "usage-unknown-option", "usage-bad-integer", "usage-below-minimum", "usage-missing-argument",
                   "snapshot-workers-99999", "check-config-seq-length-huge", "snapshot-plot-wrong-extension",
                   "compare-csv-missing-folder"):  # fmt: skip
        assert needed in ids
