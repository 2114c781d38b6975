"""Benchmark `bufreuse snapshot-report` against a bare pickle.load and `_memory_viz trace`, side by side.

Each command runs in a fresh process (start-up included); wall time and that process's own peak
RSS (``os.wait4``) are measured. The snapshot is made by ``scripts/gen_big_snapshot.py`` when
missing. Targets (issue 4): report ≤ 1.5x bare ``pickle.load``; ≥ 3x faster than
``python -m torch.cuda._memory_viz trace``; peak RSS ≤ that of ``_memory_viz trace``.

Usage: ``python scripts/bench_snapshot_report.py [--snapshot PATH] [--events N] [--repeat K] [--no-memviz]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process; stdout is discarded."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--snapshot", type=Path, default=Path("/tmp/bufreuse-bench-1M.pickle"))
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=3, help="runs per fast command (median time, max RSS)")
    p.add_argument("--no-memviz", action="store_true", help="skip torch's _memory_viz (needs torch)")
    args = p.parse_args()
    snap = args.snapshot
    if not snap.exists():
        print(f"generating {snap} ({args.events:,} events) ...", flush=True)
        gen = [sys.executable, str(ROOT / "scripts" / "gen_big_snapshot.py"), str(snap), "--events", str(args.events)]
        subprocess.run(gen, check=True)
    py = sys.executable
    cmds = {
        "pickle.load (bare)": [py, "-c", "import pickle,sys; pickle.load(open(sys.argv[1],'rb'))", str(snap)],
        "pickle.load (GC paused)": [
            py,
            "-c",
            "import gc,pickle,sys; gc.disable(); pickle.load(open(sys.argv[1],'rb'))",
            str(snap),
        ],
        "snapshot-report --json": [py, "-m", "bufreuse", "snapshot-report", str(snap), "--json"],
        "snapshot-report (tables)": [py, "-m", "bufreuse", "snapshot-report", str(snap)],
    }
    if not args.no_memviz:
        cmds["_memory_viz trace"] = [py, "-m", "torch.cuda._memory_viz", "trace", str(snap)]
    rows: dict[str, tuple[float, int]] = {}
    for name, cmd in cmds.items():
        k = 1 if name == "_memory_viz trace" else args.repeat
        runs = [_run(cmd) for _ in range(k)]
        rows[name] = (statistics.median(r[0] for r in runs), max(r[1] for r in runs))
        print(f"  {name:28s} {rows[name][0]:7.2f} s  {rows[name][1] / 2**20:7.0f} MiB  ({k} run(s))", flush=True)

    size_mb = snap.stat().st_size / 1e6
    print(f"\nsnapshot: {snap} ({size_mb:.1f} MB), python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"{'command':30s} {'wall s':>8s} {'peak RSS MiB':>13s} {'x pickle.load':>14s} {'memviz / this':>14s}")
    base = rows["pickle.load (bare)"][0]
    mv = rows.get("_memory_viz trace")
    for name, (wall, rss) in rows.items():
        speed = f"{mv[0] / wall:14.1f}" if mv else f"{'-':>14s}"
        print(f"{name:30s} {wall:8.2f} {rss / 2**20:13.0f} {wall / base:14.2f} {speed}")
    rep_wall, rep_rss = rows["snapshot-report --json"]
    checks = [("report <= 1.5x pickle.load", rep_wall <= 1.5 * base)]
    if mv:
        checks += [("report >= 3x faster than memviz", mv[0] >= 3 * rep_wall), ("peak RSS <= memviz", rep_rss <= mv[1])]
    for label, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {label}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
