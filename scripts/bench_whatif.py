"""Benchmark `bufreuse what-if` for three slot counts against `bufreuse snapshot-report` on one file.

Both run as fresh processes (start-up included), interleaved, ``--repeat`` times each; the script
prints each command's median wall time and its CPU time (user + sys, worker processes included,
from ``os.wait4``), the load average before the runs, and the ratios. Target (issue 16): what-if
wall time ≤ 3x snapshot-report's. The snapshot is made by ``scripts/gen_big_snapshot.py`` when
missing. what-if's slot counts are ``m, m+2, m+8`` for the ring's fewest feasible slots ``m``
(one untimed what-if run finds ``m``), so every slot count is replayed (none is infeasible).

Usage: ``python scripts/bench_whatif.py [--snapshot PATH] [--site REGEX] [--repeat K]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str]) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (process and its waited-for children) and stdout of one run."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    out = proc.stdout.read().decode() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        err = proc.stderr.read().decode() if proc.stderr else ""
        raise SystemExit(f"{' '.join(cmd)} failed: {err[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--snapshot", type=Path, default=Path("/tmp/bufreuse-bench-1M.pickle"))
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--site", default="moe/experts.py:268:forward", help="the ring's site regex")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    snap = args.snapshot
    if not snap.exists():
        print(f"generating {snap} ({args.events:,} events) ...", flush=True)
        gen = [sys.executable, str(ROOT / "scripts" / "gen_big_snapshot.py"), str(snap), "--events", str(args.events)]
        subprocess.run(gen, check=True)
    py = [sys.executable, "-m", "bufreuse"]
    probe = json.loads(_run([*py, "what-if", str(snap), "--slots", "1", "--site", args.site, "--json"])[2])
    m = max(1, *(r["min_slots"] for r in probe["rings"]))
    slots = f"{m},{m + 2},{m + 8}"
    cmds = {
        "snapshot-report --json": [*py, "snapshot-report", str(snap), "--json"],
        f"what-if --slots {slots} --json": [*py, "what-if", str(snap), "--slots", slots, "--site", args.site, "--json"],
    }
    print(f"snapshot: {snap} ({snap.stat().st_size / 1e6:.1f} MB); load average before: {os.getloadavg()}")
    walls: dict[str, list[float]] = {k: [] for k in cmds}
    cpus: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(args.repeat):
        for name, cmd in cmds.items():
            w, c, _out = _run(cmd)
            walls[name].append(w)
            cpus[name].append(c)
    med = {k: (statistics.median(walls[k]), statistics.median(cpus[k])) for k in cmds}
    for name, (w, c) in med.items():
        print(f"{name:40s} wall {w:6.2f} s   cpu {c:6.2f} s   (runs: {', '.join(f'{x:.2f}' for x in walls[name])})")
    (rw, rc), (ww, wc) = med.values()
    print(f"ratio what-if / snapshot-report: wall {ww / rw:.2f}x, cpu {wc / rc:.2f}x (target: wall <= 3x)")
    print(f"cpus: {os.cpu_count()}; load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
