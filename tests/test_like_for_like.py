"""``compare`` compares like with like (issue 46 item 9): logs over different iteration spans are compared over
the span they share, with the caveat; Megatron-DeepSpeed / DeepSpeed-launcher logs give their node set (the
workers line, the launcher's world info, pdsh ``host: `` prefixes) and software versions (torch, DeepSpeed,
CUDA), so runs on another cluster or software are not claimed as a speedup.

The logs are synthetic, written by ``tests/data/logs/make_deepspeed_logs.py`` in the shapes those tools print.
Expected figures are read from the files here by hand (a regex per line), not by the parser.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bufreuse.analysis.runs.megatron_log import parse_log, parse_log_text
from bufreuse.cli import app

runner = CliRunner()
LOGS = Path(__file__).resolve().parent / "data" / "logs"
SHORT, LONG = LOGS / "mds-span-short.log", LOGS / "mds-span-long.log"
CLUSTER_A, CLUSTER_B = LOGS / "mds-cluster-a.log", LOGS / "mds-cluster-b.log"
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+) \|")


def _windows(path: Path) -> list[tuple[int, float]]:
    """(iteration, step ms) of every iteration line, read by hand."""
    return [(int(m.group(1)), float(m.group(2))) for line in path.read_text().splitlines() if (m := _ITER.search(line))]


def _mean(path: Path, lo: int, hi: int) -> float:
    """Mean step time of the windows ending in [lo, hi] (every window is 10 iterations: equal weights)."""
    ms = [v for it, v in _windows(path) if lo <= it <= hi]
    return sum(ms) / len(ms)


def _compare(*argv: str) -> tuple[int, dict]:
    res = runner.invoke(app, ["compare", *argv, "--json"])
    assert "Traceback" not in res.output, res.output
    return res.exit_code, json.loads(res.stdout) if res.exit_code in (0, 1) else {}


# --- iteration spans --------------------------------------------------------------------------------------


def test_the_fixture_flips_between_whole_and_common_span() -> None:
    """The data exercise the case: over everything the long run is slower, over iterations 11-120 faster."""
    short = _mean(SHORT, 20, 120)  # --warmup 3 drops the window ending at 10 (iterations 1-10)
    assert _mean(LONG, 20, 2130) > short * 1.02 and _mean(LONG, 20, 120) < short * 0.98


def test_different_spans_compare_over_the_common_span_and_say_so() -> None:
    code, data = _compare(str(SHORT), str(LONG), "--fail-on-regression")
    assert code == 0  # the whole-span comparison would be a step-time regression: exit 1
    comp = data["comparisons"][0]
    m = {x["metric"]: x for x in comp["metrics"]}
    want = _mean(LONG, 20, 120) - _mean(SHORT, 20, 120)
    assert m["step_ms_mean"]["delta"] == pytest.approx(want, abs=0.01)
    assert m["step_ms_mean"]["verdict"] == "improvement" and m["tflops_mean"]["verdict"] == "improvement"
    assert m["step_ms_mean"]["n_value"] == len([it for it, _ in _windows(LONG) if 20 <= it <= 120])
    long_windows = len(_windows(LONG)) - 1  # steady: all but the warm-up window
    assert comp["span"] == {"baseline": [11, 120], "run": [11, 2130], "common": [11, 120],
                            "left_out_windows": {"baseline": 0, "run": long_windows - 11}}  # fmt: skip
    (caveat,) = [c for c in comp["comparability"] if c.startswith("iteration spans differ")]
    assert "common span, iterations 11–120" in caveat and "mds-span-long 11–2,130" in caveat
    # the runs' own statistics stay whole (labelled per run)
    assert data["runs"]["mds-span-long"]["step_ms"]["n"] == long_windows


def test_equal_spans_get_no_caveat_and_the_same_verdict(tmp_path: Path) -> None:
    """Control: the long log cut at iteration 120 by hand gives the same figures, and no span caveat."""
    cut = tmp_path / "mds-span-long.log"
    keep = []
    for line in LONG.read_text().splitlines(keepends=True):
        m = _ITER.search(line)
        if m is None or int(m.group(1)) <= 120:
            keep.append(line)
    cut.write_text("".join(keep))
    _, data = _compare(str(SHORT), str(cut))
    comp = data["comparisons"][0]
    assert comp["span"] is None and not any("iteration spans" in c for c in comp["comparability"])
    _, whole = _compare(str(SHORT), str(LONG))
    for a, b in zip(comp["metrics"], whole["comparisons"][0]["metrics"], strict=True):
        assert (a["metric"], a["verdict"]) == (b["metric"], b["verdict"])
        assert a["delta"] == pytest.approx(b["delta"])


def test_spans_that_do_not_overlap_are_compared_whole_with_the_caveat(tmp_path: Path) -> None:
    late = tmp_path / "resumed.log"
    late.write_text("".join(ln for ln in LONG.read_text().splitlines(keepends=True)
                            if (m := _ITER.search(ln)) is None or int(m.group(1)) > 1000))  # fmt: skip
    _, data = _compare(str(SHORT), str(late))
    comp = data["comparisons"][0]
    assert comp["span"]["common"] is None
    assert any("do not overlap" in c for c in comp["comparability"])


# --- node sets and software from DeepSpeed-launched logs -------------------------------------------------


def test_workers_line_and_software_are_read() -> None:
    log = parse_log(CLUSTER_A)
    assert log.node_list == ["host-a", "host-b"] and "workers line" in (log.nodes_source or "")
    assert log.software == {"torch": "2.1.0a0+fe05266", "deepspeed": "0.12.3", "cuda": "12.1"}


def _without(path: Path, dst: Path, *needles: str) -> Path:
    dst.write_text(
        "".join(ln for ln in path.read_text().splitlines(keepends=True) if not any(n in ln for n in needles))
    )
    return dst


def test_node_set_falls_back_to_world_info_then_pdsh_prefixes(tmp_path: Path) -> None:
    no_workers = _without(CLUSTER_A, tmp_path / "a.log", "Running on the following workers")
    log = parse_log(no_workers)
    assert log.node_list == ["host-a", "host-b"] and "WORLD INFO" in (log.nodes_source or "")
    only_prefixes = _without(CLUSTER_A, tmp_path / "b.log", "Running on the following workers", "WORLD INFO")
    log = parse_log(only_prefixes)
    assert sorted(log.node_list or []) == ["host-a", "host-b"] and "pdsh" in (log.nodes_source or "")


@pytest.mark.parametrize("prefix", ["0: ", "12: ", "slurm-prologue "])
def test_srun_labels_and_other_prefixes_are_no_hosts(prefix: str) -> None:
    text = f"{prefix}[2024-03-02 06:31:02,517] [INFO] [launch.py:142:main] nnodes=2\n" + _lm_line()
    assert parse_log_text(text).nodes is None


def test_ip_address_prefixes_are_hosts() -> None:
    text = "10.0.0.11: [2024-03-02 06:31:02,517] [INFO] [launch.py:142:main] nnodes=2\n" + _lm_line()
    assert parse_log_text(text).node_list == ["10.0.0.11"]


def test_engine_version_line_alone_gives_deepspeed() -> None:
    text = ("[2023-08-15 06:31:34,960] [INFO] [logging.py:96:log_dist] [Rank 0] DeepSpeed info: version=0.9.5, "
            "git-hash=unknown, git-branch=unknown\n") + _lm_line()  # fmt: skip
    assert parse_log_text(text).software == {"deepspeed": "0.9.5"}


def _lm_line() -> str:
    return " iteration       10/     100 | elapsed time per iteration (ms): 100.0 | TFLOPs: 10.00 |\n"


def test_another_cluster_and_software_is_not_claimed_as_a_speedup() -> None:
    _, data = _compare(str(CLUSTER_A), str(CLUSTER_B))
    comp = data["comparisons"][0]
    assert comp["node_sets"] == "differ"
    assert "software differs: torch 2.1.0a0+fe05266 in mds-cluster-a, 2.3.1+cu121 in mds-cluster-b" in comp[
        "comparability"]  # fmt: skip
    assert "software differs: DeepSpeed 0.12.3 in mds-cluster-a, 0.14.4 in mds-cluster-b" in comp["comparability"]
    assert not any("CUDA" in c for c in comp["comparability"])  # 12.1 both
    m = {x["metric"]: x for x in comp["metrics"]}
    ratio = _mean(CLUSTER_A, 20, 200) / _mean(CLUSTER_B, 20, 200)
    assert ratio == pytest.approx(1.105, abs=0.002)  # b's step ~10.5% shorter, read by hand
    for key in ("tflops_mean", "tflops_median", "step_ms_mean", "step_ms_median"):
        assert m[key]["verdict"] == "inconclusive", key
        assert "not claimed as a speedup: the runs used different node sets and different software" in m[key]["note"]
    assert data["runs"]["mds-cluster-b"]["software"]["deepspeed"] == "0.14.4"


def test_control_without_launcher_and_version_lines_claims_the_speedup(tmp_path: Path) -> None:
    """What the tool said before reading these lines: the same figures, an improvement (so the lines decide)."""
    needles = ("Running on the following workers", "WORLD INFO", " version ", "deepspeed info", "DeepSpeed info:",
               "[INFO] [launch.py")  # fmt: skip
    a = _without(CLUSTER_A, tmp_path / "a.log", *needles)
    b = _without(CLUSTER_B, tmp_path / "b.log", *needles)
    _, data = _compare(str(a), str(b))
    comp = data["comparisons"][0]
    assert comp["node_sets"] == "unknown" and not any("software" in c for c in comp["comparability"])
    assert {x["metric"]: x["verdict"] for x in comp["metrics"]}["tflops_mean"] == "improvement"


def test_same_cluster_same_software_no_caveat(tmp_path: Path) -> None:
    copy = tmp_path / "again.log"
    copy.write_text(CLUSTER_A.read_text())
    _, data = _compare(str(CLUSTER_A), str(copy))
    comp = data["comparisons"][0]
    assert comp["node_sets"] == "same" and comp["comparability"] == [] and comp["span"] is None


def test_sweep_runs_on_other_software_are_stated(tmp_path: Path) -> None:
    """A sweep's metrics.json env names torch and CUDA: two configurations recorded on different torch say so."""
    import shutil

    sweep = Path(__file__).resolve().parents[1] / "examples" / "sweep-h200"
    for cid in ("slots0", "slots4"):
        shutil.copytree(sweep / cid, tmp_path / cid)
    f = tmp_path / "slots4" / "metrics.json"
    metrics = json.loads(f.read_text())
    torch_then = json.loads((sweep / "slots0" / "metrics.json").read_text())["env"]["torch"]
    metrics["env"]["torch"] = "2.13.0+cu130"
    f.write_text(json.dumps(metrics))
    _, data = _compare(str(tmp_path / "slots0"), str(tmp_path / "slots4"))
    comp = data["comparisons"][0]
    assert f"software differs: torch {torch_then} in slots0, 2.13.0+cu130 in slots4" in comp["comparability"]
    assert data["runs"]["slots4"]["software"]["torch"] == "2.13.0+cu130"
    assert all(m["verdict"] != "improvement" for m in comp["metrics"] if m["metric"].startswith(("tflops", "step")))
    _, same = _compare(str(sweep / "slots0"), str(sweep / "slots4"))  # control: one torch, nothing stated
    assert not any("software" in c for c in same["comparisons"][0]["comparability"])
