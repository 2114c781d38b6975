"""Summarise a torch-profiler Chrome trace (Megatron's ``--use-pytorch-profiler``), or compare two: where a step's
time goes on the GPU (kernels by name, copies, idle time) and on the host (CUDA runtime calls, operator count).

    python scripts/trace_summary.py TRACE.json.gz [--json out.json]
    python scripts/trace_summary.py --compare CONTROL.json.gz RINGS.json.gz [--json out.json] [--top 25]

Per profiled step (``ProfilerStep#N`` spans): the step's host wall time; GPU kernel / memcpy / memset time and
counts, kernels by name and by group (:data:`GROUPS`: attention, optimizer, permute / unpermute, GEMMs, other); GPU
busy time (the union of those intervals over every stream, inside the steps) and idle time (the steps'
span less busy); CUDA runtime calls by name (count, host µs) and the operator count. ``--compare`` prints the
second trace less the first, per step, and the kernels and runtime calls whose totals moved most. Reads the trace
as JSON (gzip or plain), never executes anything from it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
GROUPS = (
    ("attention", ("sdpa", "flash", "fmha")),
    ("optimizer", ("multi_tensor", "adam")),
    ("permute / unpermute", ("scatter_gather", "indexfunc", "gather", "scatter", "index_select", "sort")),
    ("GEMMs", ("nvjet", "gemm", "cutlass", "wgmma", "sm90_xmma")),
)
"""Kernel groups by case-insensitive name fragment, first match wins; everything else is ``other``."""


def group_of(name: str) -> str:
    """The :data:`GROUPS` entry a kernel name falls in (``other`` if none)."""
    low = name.lower()
    for group, fragments in GROUPS:
        if any(f in low for f in fragments):
            return group
    return "other"


def load(path: str | Path) -> list[dict[str, Any]]:
    """The trace's complete events (``ph == "X"``)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data = json.loads(raw)
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def summarise(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step figures of one trace, normalised per profiled step."""
    # the host's step spans (kineto also projects them onto each GPU stream as gpu_user_annotation: not steps)
    steps = [
        e
        for e in events
        if str(e.get("name", "")).startswith("ProfilerStep#") and not str(e.get("cat", "")).startswith("gpu")
    ]
    if not steps:
        raise ValueError("no ProfilerStep# spans in the trace (was it recorded with a profiler schedule?)")
    lo = min(float(s["ts"]) for s in steps)
    hi = max(float(s["ts"]) + float(s["dur"]) for s in steps)
    n = len(steps)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    gpu: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    runtime: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy: list[tuple[float, float]] = []
    ops = 0
    for e in events:
        cat = e.get("cat")
        ts, dur = float(e["ts"]), float(e["dur"])
        if cat in GPU_CATS:
            # GPU work overlapping the steps (it may end after the last step's host span: kept)
            if ts + dur < lo or ts > hi + 1e6:
                continue
            gpu[cat][0] += dur
            gpu[cat][1] += 1
            busy.append((max(ts, lo), ts + dur))  # clipped at the first step's start
            if cat == "kernel":
                row = kernels[str(e.get("name", "?"))[:160]]
                row[0] += dur
                row[1] += 1
                row = groups[group_of(str(e.get("name", "")))]
                row[0] += dur
                row[1] += 1
        elif lo <= ts <= hi:
            if cat in ("cuda_runtime", "cuda_driver"):
                row = runtime[str(e.get("name", "?"))]
                row[0] += dur
                row[1] += 1
            elif cat == "cpu_op":
                ops += 1
    window_hi = max([hi] + [b for _a, b in busy])
    busy_us = _union(busy)
    return {
        "steps": n,
        "step_wall_ms": sum(float(s["dur"]) for s in steps) / n / 1e3,
        "gpu_busy_ms": busy_us / n / 1e3,
        "gpu_idle_ms": (window_hi - lo - busy_us) / n / 1e3,
        "gpu": {cat: {"ms": v[0] / n / 1e3, "count": v[1] / n} for cat, v in sorted(gpu.items())},
        "cpu_ops": ops / n,
        "kernels": {k: {"ms": v[0] / n / 1e3, "count": v[1] / n} for k, v in kernels.items()},
        "groups": {k: {"ms": v[0] / n / 1e3, "count": v[1] / n} for k, v in sorted(groups.items())},
        "runtime": {k: {"ms": v[0] / n / 1e3, "count": v[1] / n} for k, v in runtime.items()},
    }


def compare(a: dict[str, Any], b: dict[str, Any], top: int = 25) -> dict[str, Any]:
    """``b`` less ``a``: the step figures, and the kernels / runtime calls whose per-step totals moved most."""

    def deltas(key: str) -> list[dict[str, Any]]:
        rows = []
        for name in set(a[key]) | set(b[key]):
            x, y = a[key].get(name, {"ms": 0.0, "count": 0.0}), b[key].get(name, {"ms": 0.0, "count": 0.0})
            rows.append({"name": name, "a_ms": x["ms"], "b_ms": y["ms"], "delta_ms": y["ms"] - x["ms"],
                         "a_count": x["count"], "b_count": y["count"]})  # fmt: skip
        rows.sort(key=lambda r: -abs(r["delta_ms"]))
        return rows[:top]

    figures = {}
    for key in ("step_wall_ms", "gpu_busy_ms", "gpu_idle_ms", "cpu_ops"):
        figures[key] = {"a": a[key], "b": b[key], "delta": b[key] - a[key]}
    for cat in sorted(set(a["gpu"]) | set(b["gpu"])):
        x, y = a["gpu"].get(cat, {"ms": 0.0, "count": 0.0}), b["gpu"].get(cat, {"ms": 0.0, "count": 0.0})
        figures[f"{cat}_ms"] = {"a": x["ms"], "b": y["ms"], "delta": y["ms"] - x["ms"]}
        figures[f"{cat}_count"] = {"a": x["count"], "b": y["count"], "delta": y["count"] - x["count"]}
    groups = {}
    for g in sorted(set(a["groups"]) | set(b["groups"])):
        x, y = a["groups"].get(g, {"ms": 0.0}), b["groups"].get(g, {"ms": 0.0})
        groups[g] = {"a_ms": x["ms"], "b_ms": y["ms"], "ratio": y["ms"] / x["ms"] - 1 if x["ms"] else None}
    return {"figures": figures, "groups": groups, "kernels": deltas("kernels"), "runtime": deltas("runtime")}


def _print_compare(c: dict[str, Any], names: tuple[str, str]) -> None:
    print(f"per profiled step: B = {names[1]} less A = {names[0]}")
    for key, f in c["figures"].items():
        print(f"  {key:<22} A {f['a']:12.3f}  B {f['b']:12.3f}  B-A {f['delta']:+10.3f}")
    print("kernel groups (ms per step; B/A - 1):")
    for g, r in c["groups"].items():
        ratio = f"{r['ratio']:+.2%}" if r["ratio"] is not None else "—"
        print(f"  {g:<22} A {r['a_ms']:10.3f}  B {r['b_ms']:10.3f}  {ratio}")
    for what in ("kernels", "runtime"):
        print(f"{what} whose per-step total moved most (ms; count A -> B):")
        for r in c[what]:
            print(f"  {r['delta_ms']:+9.3f}  {r['a_ms']:9.3f} -> {r['b_ms']:9.3f}  "
                  f"({r['a_count']:.0f} -> {r['b_count']:.0f})  {r['name'][:110]}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except (OSError, ValueError, EOFError) as e:  # unreadable, not gzip/JSON, no steps: one line, exit 2
        print(f"trace_summary: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    if a.compare:
        sa, sb = (summarise(load(p)) for p in a.compare)
        out = {"a": a.compare[0], "b": a.compare[1], **compare(sa, sb, a.top)}
        _print_compare(out, tuple(a.compare))
    elif a.trace:
        out = summarise(load(a.trace))
        print(json.dumps({k: v for k, v in out.items() if k not in ("kernels", "runtime")}, indent=1))
        out = {**out, "trace": a.trace}
    else:
        print("trace_summary: give a TRACE or --compare A B (see --help)", file=sys.stderr)
        return 2
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
