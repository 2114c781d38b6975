"""The proxy benchmark behind docs/benchmarks: ratios against the control with 95% intervals.

``python -m bufreuse.bench.sweep_bench --out bench.json`` measures, on one GPU and in ONE process,
control / stream-ordered / ring-2 / ring-4 over ``--comm-ms`` values, plus CUDA-graph replay, for
``--repeats`` interleaved repeats (each repeat runs every configuration, in a rotated order). Between
measurements every tensor, the pool and the graph are dropped and the allocator cache emptied,
with peak statistics reset, so each max-reserved figure is that configuration's alone (the same
figure a fresh process gives, without paying process start and CUDA init per measurement). One
pair of streams serves every measurement: cuBLAS keeps a workspace per stream, which new streams
per measurement would add to max allocated (docs/benchmarks.md gives the measured growth).

Ratios pair each configuration with the control of the same repeat and comm time; the interval is
Student's t over repeats (mean ± t(0.975, n-1)·sd/√n). :func:`summarize` imports no torch.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import Any

__all__ = ["CONFIGS", "PINNED_SHAPE", "main", "mean_ci", "measure_config", "summarize"]

PINNED_SHAPE: dict[str, Any] = {"hidden": 4096, "ffn": 2048, "tokens": 32768, "local_experts": 8, "topk": 2,
                                "dtype": "bf16", "microbatches": 12, "attn_gemms": 2}  # fmt: skip
"""DESIGN.md's proxy shape, pinned so figures stay comparable."""

CONFIGS: dict[str, dict[str, Any]] = {
    "control": {"mode": "control", "slots": 0},
    "stream-ordered": {"mode": "stream-ordered", "slots": 0},
    "ring2": {"mode": "ring", "slots": 2},
    "ring4": {"mode": "ring", "slots": 4},
}
GRAPH_CONFIGS = ("control", "stream-ordered", "ring4")
# Two-sided 95% Student t quantiles by degrees of freedom (1..30); beyond that the normal 1.96.
_T975 = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
]  # fmt: skip


def mean_ci(values: list[float]) -> dict[str, float | int]:
    """Mean and 95% t-interval of ``values`` (a single value: the interval is that value)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if n == 1:
        return {"mean": mean, "lo": mean, "hi": mean, "n": 1}
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


def summarize(measurements: list[dict[str, Any]]) -> dict[str, dict[str, float | int]]:
    """Ratios with 95% intervals, paired by (repeat, comm_ms, graph) with that repeat's control."""
    by_key = {(m["repeat"], m["comm_ms"], m["graph"], m["config"]): m for m in measurements}
    out: dict[str, dict[str, float | int]] = {}

    def ratio(name: str, num: str, den: str, field: str, comm: float, graph: bool, den_field: str = "") -> None:
        vals = []
        for rep in sorted({m["repeat"] for m in measurements}):
            a, b = by_key.get((rep, comm, graph, num)), by_key.get((rep, comm, graph, den))
            if a and b and a.get(field) and b.get(den_field or field):
                vals.append(a[field] / b[den_field or field])
        if vals:
            out[name] = mean_ci(vals)

    for comm in sorted({m["comm_ms"] for m in measurements if not m["graph"]}):
        for cfg in ("ring4", "ring2", "stream-ordered"):
            ratio(f"reserved {cfg}/control @comm {comm}", cfg, "control", "max_reserved_bytes", comm, False)
        ratio(f"reserved/allocated ring4 @comm {comm}", "ring4", "ring4", "max_reserved_bytes", comm, False,
              "max_allocated_bytes")  # fmt: skip
        for cfg in ("ring2", "ring4", "stream-ordered"):
            ratio(f"step {cfg}/control @comm {comm}", cfg, "control", "step_ms", comm, False)
    for comm in sorted({m["comm_ms"] for m in measurements if m["graph"]}):
        for cfg in ("ring4", "stream-ordered"):
            ratio(f"graph replay {cfg}/control @comm {comm}", cfg, "control", "step_ms", comm, True)
            ratio(f"graph reserved {cfg}/control @comm {comm}", cfg, "control", "max_reserved_bytes", comm, True)
    return out


def measure_config(config: str, *, comm_ms: float, graph: bool, cycles_per_ms: float, steps: int, warmup: int,
                   shape: dict[str, Any], seed: int = 1234, checksum: bool = True,
                   streams: Any = None, warmup_s: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """One configuration from a clean allocator: median step ms, peak reserved/allocated, checksum.

    ``streams``: the :class:`~bufreuse.bench.schedule.ProxyStreams` to run on, shared by every
    measurement of the process (None: new ones, and with them new cuBLAS workspaces). ``warmup_s``:
    least seconds of warm-up (``ProxyConfig.warmup_s``; the first measurement of a cold GPU). The checksum
    copies the outputs to the host and hashes them (~0.3 s at the pinned shape).
    """
    import torch

    from bufreuse.bench import measure
    from bufreuse.bench.proxy import ProxyConfig, build_pool, warm_up
    from bufreuse.bench.schedule import MoEProxy

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cfg = ProxyConfig.from_config({**shape, **CONFIGS[config], "comm_ms": 0.0, "cuda_graph": graph, "steps": steps,
                                   "warmup_steps": warmup, "seed": seed, "warmup_s": warmup_s})  # fmt: skip
    dev = torch.device("cuda", torch.cuda.current_device())
    with torch.no_grad():
        pool = build_pool(cfg, dev)
        proxy = MoEProxy(cfg, pool, dev, streams=streams)
        proxy.sleep_cycles = int(comm_ms * cycles_per_ms)
        run, _ = warm_up(proxy, pool, cfg)
        values = measure.time_steps(run, steps, stream=proxy.streams.compute)
        stats = measure.step_stats(values)
        out = {
            "config": config, "comm_ms": comm_ms, "graph": graph, "step_ms": stats["median"],
            "step_p10": stats["p10"], "step_p90": stats["p90"],
            "max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
            "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "checksum": proxy.checksum() if checksum else None,
        }  # fmt: skip
    del run, proxy, pool
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write (rewritten after every repeat)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--warmup-s", type=float, default=2.0, help="least warm-up seconds of the first measurement")
    p.add_argument("--comm-ms", default="0.5,1.5,3", help="comma-separated emulated comm times")
    p.add_argument("--graph-comm-ms", type=float, default=1.5, help="comm time of the CUDA-graph measurements")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting repeats after this many seconds (0: none)")
    args = p.parse_args(argv)

    import torch

    from bufreuse.bench.schedule import MoEProxy, calibrate_sleep
    from bufreuse.fsutil import atomic_write_json

    comms = [float(x) for x in args.comm_ms.split(",")]
    streams = MoEProxy.new_streams(torch.device("cuda", torch.cuda.current_device()))
    cycles = calibrate_sleep(streams.comm)
    plan = [(c, cm, False) for cm in comms for c in CONFIGS] + [(c, args.graph_comm_ms, True) for c in GRAPH_CONFIGS]
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "shape": PINNED_SHAPE, "steps": args.steps, "warmup_steps": args.warmup, "warmup_s_first": args.warmup_s,
        "sleep_cycles_per_ms": cycles,
        "method": "one process; allocator emptied and peaks reset between measurements; repeats interleaved, "
                  "order rotated per repeat; ratios paired with the same repeat's control",
        "command": "python -m bufreuse.bench.sweep_bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "measurements": [],
    }  # fmt: skip
    for rep in range(args.repeats):
        if args.budget_s and rep and time.monotonic() - t0 > args.budget_s:
            print(f"budget reached: {rep} repeats done", flush=True)
            break
        k = rep % len(plan)
        for config, comm, graph in plan[k:] + plan[:k]:
            m = measure_config(config, comm_ms=comm, graph=graph, cycles_per_ms=cycles, steps=args.steps,
                               warmup=args.warmup, shape=PINNED_SHAPE, checksum=rep == 0, streams=streams,
                               warmup_s=0.0 if result["measurements"] else args.warmup_s)  # fmt: skip
            m["repeat"] = rep
            result["measurements"].append(m)
            print(f"rep {rep} {config:15s} comm {comm:3.1f} graph {graph!s:5s} step {m['step_ms']:7.2f} ms "
                  f"reserved {m['max_reserved_bytes'] / 2**20:7.0f} MiB alloc {m['max_allocated_bytes'] / 2**20:7.0f}",
                  flush=True)  # fmt: skip
        result["repeats"] = rep + 1
        result["elapsed_s"] = round(time.monotonic() - t0, 1)
        result["checksums"] = sorted({m["checksum"] for m in result["measurements"] if m["checksum"]})
        result["ratios"] = summarize(result["measurements"])
        atomic_write_json(args.out, result)
    for name, r in result.get("ratios", {}).items():
        print(f"{name:45s} {r['mean']:.4f}  [{r['lo']:.4f}, {r['hi']:.4f}]  n={r['n']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
