"""Record the small real allocator snapshots under tests/data/snapshots/ (needs a CUDA GPU).

Each scenario runs in a fresh Python process so allocator state and peak counters start clean:
``torch.cuda.reset_peak_memory_stats()`` runs just before recording starts, and a sidecar
``<name>.json`` holds torch's own counters taken right after the dump, so the tests can check that
the replay's ``max_reserved_bytes`` equals ``torch.cuda.max_memory_reserved()``.

Usage (on the H200): ``python3 scripts/record_snapshots.py --out DIR [--only NAME ...]``.
Stacks are Python-only and ``max_entries`` is bounded so each file stays well under 300 KB gzipped.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

MiB = 1 << 20

# name -> (extra environment, gzip the dump?)
SCENARIOS: dict[str, tuple[dict[str, str], bool]] = {
    "record_stream": ({}, True),
    "oom": ({}, True),
    "empty_cache": ({}, False),
    "expandable": ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    "mempool": ({}, True),
    "cuda_graph": ({}, True),
    "truncated": ({}, True),
    "no_history": ({}, False),
}


def _dispatch_tokens(torch, n_bytes: int, stream):  # named to match the built-in dispatch_output rule
    with torch.cuda.stream(stream):
        return torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").fill_(1)


def _expert_fc2(torch, x):  # named to match the built-in expert_output rule
    return x * 2


def _scenario_record_stream(torch) -> None:
    """Dispatch outputs made on a comm stream, read on the compute stream, freed with record_stream."""
    comm = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    for _ in range(6):
        outs = []
        for _mb in range(4):
            comm.wait_stream(compute)
            x = _dispatch_tokens(torch, 24 * MiB, comm)
            compute.wait_stream(comm)
            torch.cuda._sleep(2_000_000)  # the expert keeps the block busy on the compute stream
            y = _expert_fc2(torch, x)
            x.record_stream(compute)
            del x  # pending free until the compute stream passes this point
            outs.append(y.sum())
        torch.stack(outs).sum().item()


def _scenario_oom(torch) -> None:
    keep = [torch.empty(64 * MiB, dtype=torch.uint8, device="cuda") for _ in range(3)]
    tmp = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    del tmp
    free, _total = torch.cuda.mem_get_info()
    with contextlib.suppress(torch.cuda.OutOfMemoryError):
        torch.empty(free + (8 << 30), dtype=torch.uint8, device="cuda")
    keep.append(torch.empty(16 * MiB, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()


def _scenario_empty_cache(torch) -> None:
    xs = [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (4, 30, 30, 100)]
    small = [torch.empty(n * 1024, dtype=torch.uint8, device="cuda") for n in (1, 3, 17, 200)]
    del xs[1:3]
    torch.cuda.empty_cache()
    xs.append(torch.empty(50 * MiB, dtype=torch.uint8, device="cuda"))
    del small[:2]
    torch.cuda.synchronize()


def _scenario_expandable(torch) -> None:
    xs = []
    for n in (10, 40, 3, 120, 7):
        xs.append(torch.empty(n * MiB, dtype=torch.uint8, device="cuda"))
    del xs[1]
    del xs[2]
    torch.cuda.empty_cache()  # unmaps the free pages of the expandable segment
    xs.append(torch.empty(60 * MiB, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()


def _scenario_mempool(torch) -> None:
    pool = torch.cuda.MemPool()
    a = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.use_mem_pool(pool):
        b = [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (16, 16, 3)]
    del b[0]
    c = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    _scenario_mempool.keep = (pool, a, b, c)  # type: ignore[attr-defined]


def _scenario_cuda_graph(torch) -> None:
    x = torch.randn(1024, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up on a side stream, as torch recommends
        for _ in range(2):
            y = _expert_fc2(torch, x @ w)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = _expert_fc2(torch, x @ w).relu()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    _scenario_cuda_graph.keep = (g, y)  # type: ignore[attr-defined]


def _scenario_truncated(torch) -> None:
    """More events than ``max_entries``: the ring buffer drops early allocs (frees with no alloc)."""
    keep = [torch.empty((i % 5 + 1) * MiB, dtype=torch.uint8, device="cuda") for i in range(40)]
    for i in range(0, 40, 2):
        keep[i] = None
    for i in range(30):
        keep.append(torch.empty((i % 3 + 1) * 512 * 1024, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    _scenario_truncated.keep = keep  # type: ignore[attr-defined]


def _scenario_no_history(torch) -> None:
    """Recording never switched on: the dump has segments but an empty trace."""
    _scenario_no_history.keep = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")  # type: ignore[attr-defined]


def _child(name: str, out: Path) -> None:
    import torch

    weights = torch.empty(48 * MiB, dtype=torch.uint8, device="cuda")  # memory from before recording
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if name != "no_history":
        max_entries = 60 if name == "truncated" else 20_000
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    globals()[f"_scenario_{name}"](torch)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    data = pickle.dumps(snap)
    compress = SCENARIOS[name][1]
    path = out / (f"{name}.pickle.gz" if compress else f"{name}.pickle")
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)
    stats = torch.cuda.memory_stats()
    keys = [
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "active_bytes.all.current",
        "active_bytes.all.peak",
        "requested_bytes.all.current",
        "requested_bytes.all.peak",
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
        "inactive_split_bytes.all.current",
        "num_alloc_retries",
        "num_ooms",
        "num_device_alloc",
        "num_device_free",
    ]
    sidecar = {
        "scenario": name,
        "snapshot": path.name,
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "memory_reserved": torch.cuda.memory_reserved(),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "memory_allocated": torch.cuda.memory_allocated(),
        "memory_stats": {k: stats.get(k) for k in keys},
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(),
        "recorded_before_trace_bytes": weights.numel(),
    }
    (out / f"{name}.json").write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
    print(f"{name}: {path.stat().st_size} bytes, max_memory_reserved={sidecar['max_memory_reserved']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", nargs="*", default=None, choices=sorted(SCENARIOS))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        _child(args.child, args.out)
        return 0
    failed = []
    for name in args.only or SCENARIOS:
        env = {**os.environ, **SCENARIOS[name][0]}
        cmd = [sys.executable, __file__, "--out", str(args.out), "--child", name]
        r = subprocess.run(cmd, env=env, timeout=120)
        if r.returncode != 0:
            failed.append(name)
    if failed:
        print("failed scenarios:", ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
