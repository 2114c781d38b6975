"""``scripts/megatron-ab.sh`` (run order, budget guard) and ``scripts/megatron_ab_summary.py`` (F-summary.json)."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "recordings" / "megatron-h200" / "h200-2026-12-03-te"
summ = load_script("megatron_ab_summary")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _ab(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "OUT": str(tmp_path), "MEGATRON_LM_PATH": str(tmp_path), **env}
    # the script runs `python3`: make it the interpreter running these tests (its venv has bufreuse), whatever
    # PATH says, without putting the venv's other tools (its real torchrun) ahead of a fake one
    py_dir = tmp_path.parent / f"{tmp_path.name}-python3"
    py_dir.mkdir(parents=True, exist_ok=True)
    shim = py_dir / "python3"
    if not shim.exists():  # a wrapper, not a symlink: a venv is found from the path the interpreter is run by
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        shim.chmod(0o755)
    full["PATH"] = os.pathsep.join([str(py_dir), full.get("PATH", "")])
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "megatron-ab.sh"), *args], env=full, capture_output=True, text=True, timeout=60
    )


def test_dry_run_interleaves_a_b_b_a_per_family(tmp_path: Path) -> None:
    res = _ab(tmp_path, "gb-te", "gb-te-graph", DRY_RUN="1", ROUNDS="3")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    start = lines.index(next(x for x in lines if x.startswith("== order (12 runs")))
    order = lines[start + 1 : start + 13]
    expected = []
    for k in (1, 2, 3):
        arms = ("control", "rings") if k % 2 else ("rings", "control")
        expected += [f"{f}-{a}-{k}" for f in ("gb-te", "gb-te-graph") for a in arms]
    assert order == expected
    commands = {x.split()[1]: x for x in lines if x.startswith("== gb-")}
    assert "--cuda-graph-impl full_iteration" in commands["gb-te-graph-rings-2"]
    assert "--cuda-graph-impl full_iteration" not in commands["gb-te-rings-2"]
    assert "--moe-hybridep-num-expert-output-buffers 4" in commands["gb-te-rings-1"]
    assert "--moe-hybridep" not in commands["gb-te-control-1"]  # the control installs nothing
    assert "--hidden-size 4096" in commands["gb-te-control-3"] and "--train-iters 20" in commands["gb-te-control-3"]
    assert "--hidden-size 1024" not in commands["gb-te-control-3"]
    assert "== estimate: 12 runs" in res.stdout


def test_budget_skips_runs_that_cannot_finish(tmp_path: Path) -> None:
    (tmp_path / "gb-te-rings-2.log").write_text("an earlier call's log\n")  # must not stand in for a skipped run
    res = _ab(tmp_path, "--runs-only", "gb-te", ROUNDS="2", BUDGET_S="30", EST_RUN_S="50")
    assert res.returncode == 1
    skipped = (tmp_path / "ab-skipped.txt").read_text().splitlines()
    assert [s.split()[2] for s in skipped] == ["gb-te-control-1", "gb-te-rings-1", "gb-te-rings-2", "gb-te-control-2"]
    assert not list(tmp_path.glob("*.log"))  # nothing started


def _recorded_rounds(tmp_path: Path, family: str, rounds: list[str]) -> Path:
    """Real `bufreuse compare --json` outputs of the 2026-12-03 TE runs, renamed as one family's rounds."""
    for k, src in enumerate(rounds, start=1):
        shutil.copy(RECORDED / f"{src}.json", tmp_path / f"{family}-round{k}.json")
    shutil.copy(RECORDED / "te-drift.json", tmp_path / f"{family}-drift1.json")
    shutil.copy(RECORDED / "te-drift.json", tmp_path / f"{family}-drift.json")
    shutil.copy(RECORDED / "te-ab.json", tmp_path / f"{family}-ab.json")
    shutil.copy(RECORDED / "te-losses.json", tmp_path / f"{family}-losses.json")
    shutil.copy(RECORDED / "te-losses-drift.json", tmp_path / f"{family}-losses-drift.json")
    return tmp_path


def test_summary_of_recorded_rounds(tmp_path: Path) -> None:
    out = _recorded_rounds(tmp_path, "F", ["te-round1", "te-round2"])
    assert summ.main(["--out", str(out), "--family", "F", "--rounds", "2", "--json", str(out / "s.json")]) == 0
    s = json.loads((out / "s.json").read_text())
    # docs/benchmarks.md, TE bf16: round 1 229.0 -> 246.2 ms, round 2 206.8 -> 261.9 ms, drift 229.0 -> 206.8
    r1, r2 = s["per_round"]
    assert r1["order"] is None and r2["order"] is None  # no ab-order.txt: the order is not guessed
    assert (r1["control_ms"], r1["rings_ms"]) == (229.0, 246.2)
    assert (r2["control_ms"], r2["rings_ms"]) == (206.8, 261.9)
    assert r1["ratio"] == pytest.approx(246.2 / 229.0) and r2["ratio"] == pytest.approx(261.9 / 206.8)
    assert r1["ci95_pct"] == pytest.approx([100 * 4.0 / 229.0, 100 * 33.2 / 229.0], abs=1e-6)
    assert s["overall"]["verdict"] == "regression"
    assert s["overall"]["ratio_median_of_rounds"] == pytest.approx((246.2 / 229.0 + 261.9 / 206.8) / 2)
    assert s["overall"]["every_round_ci_inside_band"] is False
    assert [r["label"] for r in s["overall"]["all_runs_vs_first_control"]] == [
        "te-rings-1",
        "te-control-2",
        "te-rings-2",
    ]
    assert s["drift"]["first_vs_last_control"]["delta_pct"] == pytest.approx(100 * (206.8 - 229.0) / 229.0)
    assert s["drift"]["max_abs_pct"] == pytest.approx(100 * 22.2 / 229.0)
    assert s["losses"]["control_vs_control_max_abs"] == [pytest.approx(0.0445, abs=5e-5)]


def test_rounds_that_disagree_are_inconclusive(tmp_path: Path) -> None:
    out = _recorded_rounds(tmp_path, "F", ["te-round1", "te-fp8-round1"])  # regression, then improvement
    s = summ.summarize(out, "F", 2)
    assert s["overall"]["round_verdicts"] == ["regression", "improvement"]
    assert s["overall"]["verdict"] == "inconclusive"


def test_interval_inside_the_band(tmp_path: Path) -> None:
    out = _recorded_rounds(tmp_path, "F", ["te-round1"])
    data = json.loads((out / "F-round1.json").read_text())
    m = next(m for m in data["comparisons"][0]["metrics"] if m["metric"] == "step_ms_median")
    m.update(value=229.5, delta=0.5, ci_low=-1.0, ci_high=2.0, verdict="parity")  # ±2.29 ms band = ±1%
    (out / "F-round1.json").write_text(json.dumps(data))
    s = summ.summarize(out, "F", 1)
    assert s["overall"]["every_round_ci_inside_band"] is True and s["overall"]["verdict"] == "parity"
    assert s["drift"]["first_vs_last_control"] is None  # one round: no second control


def test_missing_round_is_bad_input(tmp_path: Path, capsys) -> None:
    out = _recorded_rounds(tmp_path, "F", ["te-round1"])
    assert summ.main(["--out", str(out), "--family", "F", "--rounds", "2"]) == 2
    assert "F-round2.json" in capsys.readouterr().err


def _fake_torchrun(tmp_path: Path, sleep: float = 0.0) -> dict[str, str]:
    """A `torchrun` on PATH that prints a recorded H200 log: rings when the ring knobs are in its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f"sleep {sleep}\n"
        'case "$*" in *--moe-hybridep-reuse-dispatch-output-buffers*) arm=rings ;; *) arm=control ;; esac\n'
        f'echo "$*" >>"{tmp_path}/argv.txt"\n'
        f'sed 1d "{RECORDED}/te-$arm-1.log"\n'
    )
    fake.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}


def test_budget_lets_runs_start_while_they_fit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = _ab(out, "--runs-only", "gb-te", ROUNDS="2", BUDGET_S="8", EST_RUN_S="1", **_fake_torchrun(tmp_path, 3))
    assert res.returncode == 1, res.stdout + res.stderr
    assert sorted(p.name for p in out.glob("*.log")) == ["gb-te-control-1.log", "gb-te-rings-1.log"]
    skipped = (out / "ab-skipped.txt").read_text().splitlines()
    assert [s.split()[2] for s in skipped] == ["gb-te-rings-2", "gb-te-control-2"]


def test_rounds_end_to_end_with_a_fake_launcher(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = _ab(out, "gb-te-graph", ROUNDS="2", ITERS="7", **_fake_torchrun(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    argv = (tmp_path / "argv.txt").read_text().splitlines()
    assert len(argv) == 4 and all("--train-iters 7" in a and "--cuda-graph-impl full_iteration" in a for a in argv)
    assert ["reuse-dispatch" in a for a in argv] == [False, True, True, False]  # A B B A
    s = json.loads((out / "gb-te-graph-summary.json").read_text())
    # every control arm printed te-control-1.log (median 229.0 ms), every rings arm te-rings-1.log (246.2 ms)
    assert [(r["control_ms"], r["rings_ms"]) for r in s["per_round"]] == [(229.0, 246.2), (229.0, 246.2)]
    assert s["overall"]["verdict"] == "regression"
    assert s["drift"]["neighbouring_controls"][0]["delta_pct"] == 0.0
    assert [r["order"] for r in s["per_round"]] == ["control rings", "rings control"]
    assert s["ab_order"] == [
        "gb-te-graph control 1",
        "gb-te-graph rings 1",
        "gb-te-graph rings 2",
        "gb-te-graph control 2",
    ]
    assert "rings / control" in res.stdout


def test_budget_uses_measured_runs_not_the_first_estimate(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # EST_RUN_S=6 lets the first run start; the measured ~2 s then let all four fit in 10 s (6 s would stop at 3)
    res = _ab(out, "--runs-only", "gb-te", ROUNDS="2", BUDGET_S="10", EST_RUN_S="6", **_fake_torchrun(tmp_path, 2))
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(list(out.glob("gb-te-*.log"))) == 4 and not (out / "ab-skipped.txt").exists()


def test_between_rounds_interval() -> None:
    # Three rounds: log ratios 0, ln 1.002, ln 0.998; t(2) = 4.303 (table value).
    import math
    import statistics

    ratios = [1.0, 1.002, 0.998]
    logs = [math.log(r) for r in ratios]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)
    mean = sum(logs) / 3
    b = summ.between_rounds(ratios, 1.0)
    assert b["ratio_geomean"] == pytest.approx(math.exp(mean))
    assert b["ci95_pct"][0] == pytest.approx(100 * (math.exp(mean - half) - 1))
    assert b["ci95_pct"][1] == pytest.approx(100 * (math.exp(mean + half) - 1))
    assert b["verdict"] == "parity" and abs(b["ci95_pct"][1]) < 0.6  # about ±0.5%: inside the ±1% band
    # Positive controls: a spread past the band is inconclusive; a shift past it either side is judged so.
    assert summ.between_rounds([1.0, 1.03, 0.97], 1.0)["verdict"] == "inconclusive"
    assert summ.between_rounds([1.05, 1.051, 1.049], 1.0)["verdict"] == "regression"
    assert summ.between_rounds([0.95, 0.951, 0.949], 1.0)["verdict"] == "improvement"
    with pytest.raises(summ.SummaryError):
        summ.between_rounds([1.0, 0.0, 1.0], 1.0)
    # 13 rounds: t(12) = 2.179 from the table, not the normal 1.96
    many = [1.0 + 0.001 * (i % 3 - 1) for i in range(13)]
    logs13 = [math.log(r) for r in many]
    half13 = 2.179 * statistics.stdev(logs13) / math.sqrt(13)
    assert summ.between_rounds(many, 1.0)["ci95_pct"][1] == pytest.approx(
        100 * (math.exp(sum(logs13) / 13 + half13) - 1)
    )
    two = summ.between_rounds([1.0, 1.0], 1.0)
    assert two["ci95_pct"] == [None, None] and two["verdict"] == "inconclusive"


SESSIONS = [ROOT / "docs" / "recordings" / "megatron-h200" / d for d in ("h200-2026-12-04", "h200-2026-12-04-pm")]


def _ratios_from_compare(out: Path, family: str) -> list[float]:
    """Each round's rings / control step-time median, read straight from `bufreuse compare --json` (F-roundK.json)."""
    ratios, k = [], 1
    while (out / f"{family}-round{k}.json").is_file():
        data = json.loads((out / f"{family}-round{k}.json").read_text())
        m = next(m for m in data["comparisons"][0]["metrics"] if m["metric"] == "step_ms_median")
        ratios.append(m["value"] / m["baseline"])
        k += 1
    return ratios


@pytest.mark.parametrize(
    ("family", "t95", "verdict"),
    [("gb4-te-pad", 2.306, "parity"), ("gb4-te-fp8-pad", 2.447, "inconclusive")],  # t quantiles, df 8 and 6
)
def test_pool_of_two_recorded_sessions(tmp_path: Path, family: str, t95: float, verdict: str) -> None:
    assert summ.main(["--family", family, "--pool", *map(str, SESSIONS), "--json", str(tmp_path / "p.json")]) == 0
    p = json.loads((tmp_path / "p.json").read_text())
    ratios = [r for d in SESSIONS for r in _ratios_from_compare(d, family)]
    assert p["ratios"] == pytest.approx(ratios) and p["rounds"] == len(ratios) == sum(
        s["rounds"] for s in p["sessions"]
    )
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    half = t95 * sd / math.sqrt(len(logs))
    b = p["between_rounds"]
    assert b["ratio_geomean"] == pytest.approx(math.exp(mean))
    assert b["ci95_pct"] == pytest.approx([(math.exp(mean - half) - 1) * 100, (math.exp(mean + half) - 1) * 100])
    assert b["verdict"] == verdict
    assert all(s["between_rounds"]["verdict"] == "inconclusive" for s in p["sessions"])  # neither session alone


def test_pool_of_three_recorded_sessions_resolves_fp8(tmp_path: Path) -> None:
    """The evening's ten FP8 rounds resolve the eager FP8 A/B: parity alone and pooled (17 rounds), from the
    compare outputs and t quantiles written here (df 9: 2.262, df 16: 2.120)."""
    fam, eve = "gb4-te-fp8-pad", ROOT / "docs" / "recordings" / "megatron-h200" / "h200-2026-12-04-eve"
    folders = [*SESSIONS, eve]
    assert summ.main(["--family", fam, "--pool", *map(str, folders), "--json", str(tmp_path / "p.json")]) == 0
    p = json.loads((tmp_path / "p.json").read_text())

    def interval(ratios: list[float], t95: float) -> tuple[float, list[float]]:
        logs = [math.log(r) for r in ratios]
        mean, sd = statistics.mean(logs), statistics.stdev(logs)
        half = t95 * sd / math.sqrt(len(logs))
        return math.exp(mean), [(math.exp(mean - half) - 1) * 100, (math.exp(mean + half) - 1) * 100]

    alone = _ratios_from_compare(eve, fam)
    pooled = [r for d in folders for r in _ratios_from_compare(d, fam)]
    assert len(alone) == 10 and len(pooled) == 17 and p["ratios"] == pytest.approx(pooled)
    geo, ci = interval(pooled, 2.120)
    assert p["between_rounds"]["ratio_geomean"] == pytest.approx(geo)
    assert p["between_rounds"]["ci95_pct"] == pytest.approx(ci) and p["between_rounds"]["verdict"] == "parity"
    assert ci[0] > -1.0 and ci[1] < 1.0 and ci[0] > 0  # inside the band, and above zero (what the docs say)
    geo_e, ci_e = interval(alone, 2.262)
    last = p["sessions"][-1]["between_rounds"]
    assert (
        last["ratio_geomean"] == pytest.approx(geo_e)
        and last["ci95_pct"] == pytest.approx(ci_e)
        and last["verdict"] == "parity"
        and ci_e[0] < 0 < ci_e[1]
    )


def _session_copy(src: Path, dst: Path, family: str) -> Path:
    dst.mkdir()
    for f in src.glob(f"{family}-*"):
        if f.name.endswith(".log") or f.name == f"{family}-summary.json":
            shutil.copy(f, dst / f.name)
    return dst


def _edit_first_line(log: Path, old: str, new: str) -> None:
    first, rest = log.read_text().split("\n", 1)
    assert old in first
    log.write_text(first.replace(old, new) + "\n" + rest)


def test_pool_refuses_runs_of_another_command(tmp_path: Path, capsys) -> None:
    fam = "gb4-te-pad"
    a = _session_copy(SESSIONS[0], tmp_path / "a", fam)
    b = _session_copy(SESSIONS[1], tmp_path / "b", fam)
    _edit_first_line(b / f"{fam}-control-2.log", "--master-port 29533", "--master-port 29999")
    assert summ.main(["--family", fam, "--pool", str(a), str(b)]) == 0  # positive control; the port is no matter
    _edit_first_line(
        b / f"{fam}-rings-3.log",
        "--moe-hybridep-num-expert-output-buffers 1",
        "--moe-hybridep-num-expert-output-buffers 2",
    )
    assert summ.main(["--family", fam, "--pool", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert f"{fam}-rings-3.log ran another command" in err and "'1' vs '2'" in err


def test_pool_refuses_another_warmup_and_bad_arguments(tmp_path: Path, capsys) -> None:
    fam = "gb4-te-pad"
    a = _session_copy(SESSIONS[0], tmp_path / "a", fam)
    b = _session_copy(SESSIONS[1], tmp_path / "b", fam)
    s = json.loads((b / f"{fam}-summary.json").read_text())
    s["per_round"][1]["n"] = [35, 35]  # WARMUP=5 instead of 10
    (b / f"{fam}-summary.json").write_text(json.dumps(s))
    assert summ.main(["--family", fam, "--pool", str(a), str(b)]) == 2
    assert "round 2 compared [35, 35] iterations" in capsys.readouterr().err
    assert summ.main(["--family", fam, "--pool", str(a), "--rounds", "3"]) == 2
    assert "no --out or --rounds" in capsys.readouterr().err
    (a / f"{fam}-rings-1.log").unlink()
    assert summ.main(["--family", fam, "--pool", str(a)]) == 2
    assert f"{fam}-rings-1.log" in capsys.readouterr().err


def _overlap_round(out: Path, snapshots: dict[str, list[str]]) -> None:
    """A recorded round of ep2-gloo-overlap in `out`: the 2026-12-03 TE logs, and per arm the given sweep
    snapshots as its ranks' (rank0, rank1, ...)."""
    out.mkdir(parents=True, exist_ok=True)
    for arm in ("control", "rings"):
        shutil.copy(RECORDED / f"te-{arm}-1.log", out / f"ep2-gloo-overlap-{arm}-1.log")
        d = out / f"ep2-gloo-overlap-{arm}-1-snapshots"
        d.mkdir()
        for r, name in enumerate(snapshots[arm]):
            shutil.copy(ROOT / "examples" / "sweep-h200" / name / "snapshot.pickle.gz", d / f"rank{r}.pickle.gz")


def test_ep2_gloo_overlap_compare_reports_every_rank_snapshot(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # control: slots0 (the record-stream control, MoE buffers pending-free at max active) and stream-ordered
    snaps = {"control": ["slots0", "stream-ordered"], "rings": ["slots2", "slots4"]}
    _overlap_round(out, snaps)
    res = _ab(out, "--compare-only", "ep2-gloo-overlap", ROUNDS="1", PYTHONPATH=str(ROOT))
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("round1.txt", "round1.json", "losses.txt", "summary.json", "snapshots1-control.txt",
                 "snapshots1-rings.txt", "snapshots1.jsonl", "pending.txt"):  # fmt: skip
        assert (out / f"ep2-gloo-overlap-{name}").is_file(), name
    assert "combined over 2 of 2 files" in (out / "ep2-gloo-overlap-snapshots1-rings.txt").read_text()
    assert len((out / "ep2-gloo-overlap-snapshots1.jsonl").read_text().splitlines()) == 4
    # the expected line, from snapshot-report --json on each file alone
    figures: dict[str, list[tuple[float, float]]] = {}
    for arm, names in snaps.items():
        for name in names:
            rep = subprocess.run([sys.executable, "-m", "bufreuse", "snapshot-report", "--json",
                                  str(ROOT / "examples" / "sweep-h200" / name / "snapshot.pickle.gz")],
                                 capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
            d = json.loads(rep.stdout)
            by = d["pending_free_by_category_at_max_active"]
            figures.setdefault(arm, []).append(
                ((by["dispatch_output"] + by["expert_output"]) / 2**20, d["max_reserved_bytes"] / 2**20)
            )
    assert figures["control"][0][0] > 0 and figures["rings"][0][0] == 0  # the line can tell the arms apart

    def col(arm: str, i: int) -> str:
        return " / ".join(f"{f[i]:,.1f}" for f in figures[arm])

    line = (f"== ep2-gloo-overlap round 1: MoE pending-free at max active per rank (MiB): control {col('control', 0)}"
            f", rings {col('rings', 0)}; max reserved per rank (MiB): control {col('control', 1)}, rings "
            f"{col('rings', 1)}")  # fmt: skip
    assert (out / "ep2-gloo-overlap-pending.txt").read_text() == line + "\n"
    assert line in res.stdout.splitlines()


def test_ep2_gloo_overlap_compare_fails_on_a_missing_snapshot(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _overlap_round(out, {"control": ["slots0", "slots0"], "rings": []})  # the rings run dumped nothing
    res = _ab(out, "--compare-only", "ep2-gloo-overlap", ROUNDS="1", PYTHONPATH=str(ROOT))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "no snapshot in" in (out / "ep2-gloo-overlap-pending.txt").read_text()
    assert (out / "ep2-gloo-overlap-round1.txt").is_file()  # the log comparisons still ran
    # positive control: another family without snapshot folders is not asked for any
    shutil.copy(RECORDED / "te-control-1.log", out / "te-control-1.log")
    shutil.copy(RECORDED / "te-rings-1.log", out / "te-rings-1.log")
    ok = _ab(out, "--compare-only", "te", ROUNDS="1", PYTHONPATH=str(ROOT))
    assert ok.returncode == 0 and not (out / "te-pending.txt").exists(), ok.stdout + ok.stderr


def test_dry_run_of_ep2_gloo_overlap_launches_the_snapshot_recorder(tmp_path: Path) -> None:
    res = _ab(tmp_path, "ep2-gloo-overlap", DRY_RUN="1", ROUNDS="1")
    assert res.returncode == 0, res.stderr
    cmds = {x.split()[1]: x for x in res.stdout.splitlines() if x.startswith("== ep2-gloo-overlap-")}
    assert sorted(cmds) == ["ep2-gloo-overlap-control-1", "ep2-gloo-overlap-rings-1"]
    for name, c in cmds.items():
        assert f"scripts/rank_snapshots.py --out {tmp_path}/{name}-snapshots -m bufreuse.integrations.entry" in c
        assert "--overlap-moe-expert-parallel-comm" in c and "--train-iters 20" in c
