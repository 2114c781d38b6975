"""An out-of-memory event recorded in a snapshot turns the verdict into a caveat (issue 46 item 9).

A run that died of OOM never reached its true peak: its recorded peak is a lower bound. ``compare`` keeps a
memory verdict only where every true peak consistent with that bound gives the same verdict (derived here by
enumerating the true values, not by the code's rule); ``snapshot-diff`` and ``advise`` state the caveat, and
``advise`` says "cannot tell" where the dead run's trace cannot show the answer. ``advise`` on a snapshot
without a trace says "cannot tell" too: its final state says nothing about the max-active point.

The snapshots are the bundled ``tests/data/snapshots/record_stream.pickle.gz`` with an ``oom`` trace entry
appended (the shape torch records: ``action``, ``size``, ``device_free``, ``stream``, ``time_us``): synthetic.
"""

from __future__ import annotations

import gzip
import itertools
import json
import pickle
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bufreuse.analysis.runs.compare import compare_runs
from bufreuse.analysis.runs.record import MIB, RunRecord
from bufreuse.cli import app

runner = CliRunner()
DATA = Path(__file__).resolve().parent / "data" / "snapshots"
RECORD_STREAM = DATA / "record_stream.pickle.gz"
NO_TRACE = DATA / "no_history.pickle"
LOGS = Path(__file__).resolve().parent / "data" / "logs"
BAND = 64.0  # MiB: the default memory band (max(64 MiB, 0.1%) with baselines far below 64 GiB)


def _with_oom(dst: Path) -> Path:
    snap = pickle.loads(gzip.decompress(RECORD_STREAM.read_bytes()))
    trace = snap["device_traces"][0]
    last = trace[-1]
    trace.append({"action": "oom", "size": 150 << 30, "device_free": 2 << 30, "stream": 0,
                  "time_us": last.get("time_us", 0) + 10, "frames": last.get("frames", [])})  # fmt: skip
    dst.write_bytes(gzip.compress(pickle.dumps(snap)))
    return dst


def _cli(argv: list[str]) -> tuple[int, str]:
    res = runner.invoke(app, argv, env={"COLUMNS": "240"})
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.stdout


# --- compare: which verdicts a lower bound supports, derived by enumeration ---------------------------------


def _plain_verdict(delta: float) -> str:
    return "regression" if delta > BAND else "improvement" if delta < -BAND else "parity"


def _expected(a: float, b: float, a_dead: bool, b_dead: bool, *, peak: bool) -> str:
    """The verdict every true value consistent with the records gives, else inconclusive.

    A dead run's true peak is anywhere at or above its record (grid up to 4x); a dead run's pending-free is
    anywhere from 0 to 4x its record or the band (it bounds nothing either way)."""

    def truths(v: float, dead: bool) -> list[float]:
        if not dead:
            return [v]
        top = 4 * max(v, BAND)
        lo = v if peak else 0.0
        return [lo + (top - lo) * k / 40 for k in range(41)]

    verdicts = {_plain_verdict(tb - ta) for ta in truths(a, a_dead) for tb in truths(b, b_dead)}
    return verdicts.pop() if len(verdicts) == 1 else "inconclusive"


def _snap(label: str, reserved: float, pending: float, ooms: int) -> RunRecord:
    run = RunRecord(label=label, source=Path(label), kind="snapshot", oom_events=ooms)
    run.max_reserved_bytes = round(reserved * MIB)
    run.pending_free_bytes = round(pending * MIB)
    return run


PAIRS = [(1000.0, 1300.0), (1000.0, 1010.0), (1000.0, 700.0), (300.0, 300.0)]


@pytest.mark.parametrize(("a_dead", "b_dead"), list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_compare_keeps_only_what_the_lower_bound_supports(a: float, b: float, a_dead: bool, b_dead: bool) -> None:
    result = compare_runs([_snap("a", a, a / 4, int(a_dead)), _snap("b", b, b / 4, int(b_dead))])
    comp = result.comparisons[0]
    assert comp.metric("max_reserved_mib").verdict == _expected(a, b, a_dead, b_dead, peak=True)
    assert comp.metric("pending_free_mib").verdict == _expected(a / 4, b / 4, a_dead, b_dead, peak=False)
    caveat = [c for c in comp.caveats if "out-of-memory" in c]
    assert bool(caveat) == (a_dead or b_dead)


def test_both_snapshots_ending_in_oom_are_no_parity(tmp_path: Path) -> None:
    a, b = _with_oom(tmp_path / "a.pickle.gz"), _with_oom(tmp_path / "b.pickle.gz")
    code, out = _cli(["compare", str(a), str(b)])
    assert code == 0, out
    assert "parity" not in out.split("└")[0]  # the table: every memory row inconclusive
    assert "a (1 out-of-memory event) and b (1 out-of-memory event) recorded" in out
    code, out = _cli(["compare", str(a), str(b), "--json"])
    data = json.loads(out)
    assert {m["verdict"] for m in data["comparisons"][0]["metrics"]} == {"inconclusive"}
    assert data["runs"]["a"]["oom_events"] == 1 and data["runs"]["b"]["oom_events"] == 1
    assert any("lower bound" in c for c in data["comparisons"][0]["caveats"])
    # positive control: the same snapshots without the OOM entry are parity, no caveat
    code, out = _cli(["compare", str(RECORD_STREAM), str(RECORD_STREAM), "--json"])
    data = json.loads(out)
    assert {m["verdict"] for m in data["comparisons"][0]["metrics"]} == {"parity"}
    assert not data["comparisons"][0]["caveats"] and data["runs"]["record_stream"]["oom_events"] == 0


# --- snapshot-diff -----------------------------------------------------------------------------------------


def test_snapshot_diff_states_the_oom_caveat(tmp_path: Path) -> None:
    dead = _with_oom(tmp_path / "dead.pickle.gz")
    code, out = _cli(["snapshot-diff", str(RECORD_STREAM), str(dead)])
    assert code == 0 and "caveat: B (1 out-of-memory event) recorded: B died before its true peak" in out, out
    code, out = _cli(["snapshot-diff", str(dead), str(dead), "--json"])
    data = json.loads(out)
    assert data["a"]["oom_events"] == data["b"]["oom_events"] == 1
    assert data["caveats"] and "both runs died" in data["caveats"][0]
    code, out = _cli(["snapshot-diff", str(RECORD_STREAM), str(RECORD_STREAM), "--json"])
    assert json.loads(out)["caveats"] == []


# --- advise ------------------------------------------------------------------------------------------------


def test_advise_with_an_oom_says_cannot_tell_and_states_the_caveat(tmp_path: Path) -> None:
    dead = _with_oom(tmp_path / "dead.pickle.gz")
    code, out = _cli(["advise", str(dead), "--json"])
    data = json.loads(out)
    assert code == 0 and data["oom_events"] == 1
    assert data["verdict"].startswith("cannot tell:") and "out-of-memory" in data["verdict"], data["verdict"]
    assert not data["gain"] and any("lower bounds" in c for c in data["caveats"])
    # positive control: the same trace without the OOM entry gets a verdict and no caveat
    data = json.loads(_cli(["advise", str(RECORD_STREAM), "--json"])[1])
    assert data["verdict"].startswith("nothing to gain here") and data["caveats"] == [] and data["oom_events"] == 0
    code, out = _cli(["advise", str(dead)])
    assert "caveat: the run ran out of memory" in out


def test_advise_without_a_trace_cannot_tell() -> None:
    data = json.loads(_cli(["advise", str(NO_TRACE), "--json"])[1])
    assert not data["recording"]
    assert data["verdict"].startswith("cannot tell: the snapshot has no trace"), data["verdict"]
    assert "nothing waits" not in data["verdict"] and not data["gain"] and not data["flags"]


# --- a log that says a rank ran out of memory --------------------------------------------------------------


def test_log_with_cuda_oom_lines_is_a_dead_run_too(tmp_path: Path) -> None:
    """The seed's feature log with two ranks' OOM lines appended: peak reserved +6 MiB (parity) no longer stands,
    the +2156 MiB allocated regression does (only the compared run died: its true growth is at least that)."""
    control, feature = LOGS / "slurm-2796012.out", LOGS / "slurm-2796654.out"
    dead = tmp_path / "slurm-2796654.out"
    dead.write_text(feature.read_text() + "".join(
        f"{r}: [rank{r}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU {r} has a "
        "total capacity of 139.81 GiB of which 1.02 GiB is free.\n" for r in (3, 7)))  # fmt: skip
    before = json.loads(_cli(["compare", str(control), str(feature), "--json"])[1])["comparisons"][0]
    after = json.loads(_cli(["compare", str(control), str(dead), "--json"])[1])
    comp = after["comparisons"][0]
    verdict = {m["metric"]: m["verdict"] for m in comp["metrics"]}
    was = {m["metric"]: m["verdict"] for m in before["metrics"]}
    assert was["max_reserved_mib"] == "parity" and verdict["max_reserved_mib"] == "inconclusive"
    assert was["max_allocated_mib"] == verdict["max_allocated_mib"] == "regression"
    assert verdict["tflops_mean"] == was["tflops_mean"]  # the windows it logged still count
    assert after["runs"]["slurm-2796654"]["oom_events"] == 2
    assert any("2 out-of-memory events" in c for c in comp["caveats"])
