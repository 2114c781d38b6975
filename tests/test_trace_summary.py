"""scripts/trace_summary.py on hand-made Chrome traces: per-step GPU busy / idle time (the union of intervals over
streams), kernel and runtime-call totals, and the comparison of two traces."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import trace_summary


def _x(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def _trace(extra_wait: bool) -> list[dict]:
    events = [
        _x("ProfilerStep#10", "user_annotation", 0, 1000),
        _x("ProfilerStep#11", "user_annotation", 1000, 1000),
        _x("ProfilerStep#10", "gpu_user_annotation", 2, 900),  # kineto's projection on a stream: not a step
        # step 10: two overlapping kernels on two streams (union 0..300 and 400..500) and a memcpy
        _x("gemm", "kernel", 0, 200), _x("a2a", "kernel", 100, 200), _x("Memcpy DtoD", "gpu_memcpy", 400, 100),
        _x("tail of the step before", "gpu_memset", -50, 60),  # busy from 0 to 10 only (clipped), inside 0..300
        # step 11
        _x("gemm", "kernel", 1000, 200), _x("a2a", "kernel", 1300, 100),
        _x("cudaLaunchKernel", "cuda_runtime", 10, 5), _x("cudaLaunchKernel", "cuda_runtime", 1010, 5),
        _x("aten::mm", "cpu_op", 5, 50), _x("aten::mm", "cpu_op", 1005, 50),
        {"ph": "i", "name": "marker", "ts": 3},  # not a complete event: ignored
    ]  # fmt: skip
    if extra_wait:
        events += [_x("cudaStreamWaitEvent", "cuda_runtime", 20, 3), _x("cudaStreamWaitEvent", "cuda_runtime", 1020, 3)]
        events += [_x("gemm", "kernel", 1500, 100)]
    return events


def test_one_trace_per_step(tmp_path: Path) -> None:
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": _trace(False)}).encode()))
    s = trace_summary.summarise(trace_summary.load(path))
    assert s["steps"] == 2 and s["step_wall_ms"] == pytest.approx(1.0)
    # busy: step 10 union 0..300 + 400..500 = 400 µs; step 11: 200 + 100 = 300 µs -> 350 µs per step
    assert s["gpu_busy_ms"] == pytest.approx(0.35) and s["gpu_idle_ms"] == pytest.approx(0.65)
    assert s["kernels"]["gemm"] == {"ms": pytest.approx(0.2), "count": 1.0}
    assert s["gpu"]["gpu_memcpy"]["count"] == 0.5 and s["cpu_ops"] == 1.0 and s["gpu"]["gpu_memset"]["count"] == 0.5
    assert s["runtime"]["cudaLaunchKernel"]["count"] == 1.0
    # groups by name fragment: "gemm" is a GEMM, "a2a" falls in "other"
    assert s["groups"]["GEMMs"]["ms"] == pytest.approx(0.2) and s["groups"]["other"]["ms"] == pytest.approx(0.15)
    assert trace_summary.group_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert trace_summary.group_of("void at::native::_scatter_gather_elementwise_kernel") == "permute / unpermute"


def test_compare_names_what_the_second_trace_adds(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_trace(False)))
    b.write_text(json.dumps({"traceEvents": _trace(True)}))
    out = tmp_path / "c.json"
    assert trace_summary.main(["--compare", str(a), str(b), "--json", str(out)]) == 0
    c = json.loads(out.read_text())
    kernels = {r["name"]: r for r in c["kernels"]}
    assert kernels["gemm"]["delta_ms"] == pytest.approx(0.05) and kernels["a2a"]["delta_ms"] == 0
    runtime = {r["name"]: r for r in c["runtime"]}
    assert runtime["cudaStreamWaitEvent"]["b_count"] == 1.0 and runtime["cudaStreamWaitEvent"]["a_count"] == 0
    assert c["figures"]["gpu_busy_ms"]["delta"] == pytest.approx(0.05)
    assert c["groups"]["GEMMs"]["ratio"] == pytest.approx(0.25)  # 0.2 -> 0.25 ms per step


def test_bad_traces_are_one_line_and_exit_two(tmp_path: Path, capsys) -> None:
    no_steps, not_json, gz_garbage = tmp_path / "t.json", tmp_path / "u.json", tmp_path / "v.json.gz"
    no_steps.write_text(json.dumps([_x("gemm", "kernel", 0, 1)]))
    not_json.write_text("{not json")
    gz_garbage.write_bytes(b"\x1f\x8b garbage")
    for args, what in (
        ([str(no_steps)], "no ProfilerStep"),
        ([str(not_json)], "Expecting"),
        ([str(gz_garbage)], "trace_summary:"),
        ([str(tmp_path / "missing.json")], "No such file"),
        (["--compare", str(no_steps), str(not_json)], "trace_summary:"),
        ([], "give a TRACE"),
    ):
        assert trace_summary.main(args) == 2, args
        err = capsys.readouterr().err
        assert what in err and err.count("\n") == 1 and "Traceback" not in err, err
