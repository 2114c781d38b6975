#!/usr/bin/env python
"""Fuzz bufreuse with hostile and broken files, one forked process per case; print the outcome table.

Each case (see ``tests/fuzz_cases.py``: snapshots, logs, configs) is written by the parent and run in
a forked child, so a case that hangs is killed at ``--timeout`` and a case's peak RSS is its own
(``wait4``). Outcomes: accepted (reported), rejected (one ``error:`` line, exit 2), uncaught (any
other exception or exit), traceback (a traceback on stderr), executed (the case's canary file
appeared: pickled code ran), over-time, over-memory. Target: only the first two.

    python scripts/fuzz_hostile.py --cases 10000 --jobs 2 --out fuzz-10k.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fuzz_cases import Case, make_case, run_case  # noqa: E402

_GOOD = ("accepted", "rejected")


def _reset_peak_rss() -> None:
    """Start this process's peak-RSS count afresh (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_mb() -> float | None:
    """Peak RSS since the reset (``VmHWM``), MB; pages shared with the parent count too."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def _child(case: Case, canary: Path, plot: bool, wfd: int, err_path: Path) -> None:
    """Run one case in this (forked) process and send the outcome up the pipe; never returns."""
    try:
        fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        _reset_peak_rss()
        t0 = time.perf_counter()
        outcome, detail = run_case(case, canary, plot=plot)
        msg = {"outcome": outcome, "detail": detail, "seconds": time.perf_counter() - t0, "rss_mb": _peak_rss_mb()}
    except BaseException as e:  # the harness itself must report, not die
        msg = {"outcome": "uncaught", "detail": f"harness: {type(e).__name__}: {e}"[:300], "seconds": 0.0}
    os.write(wfd, json.dumps(msg).encode())
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=20261203)
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (one process each)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case before it is killed")
    ap.add_argument("--rss-mb", type=float, default=2048.0, help="peak RSS per case above which it is over budget")
    ap.add_argument("--scale", type=float, default=1.0, help="size of the bombs (1.0 = past every default budget)")
    ap.add_argument("--plot-every", type=int, default=20, help="also draw the PNG timeline every Nth snapshot case")
    ap.add_argument("--out", type=Path, default=None, help="write the summary and every bad case as JSON here")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import bufreuse.analysis.render.plots
    import bufreuse.analysis.snapshot
    import bufreuse.cli  # noqa: F401

    work = Path(tempfile.mkdtemp(prefix="bufreuse-fuzz-"))
    table: collections.Counter[tuple[str, str]] = collections.Counter()
    kinds: collections.Counter[tuple[str, str, str]] = collections.Counter()
    bad: list[dict[str, object]] = []
    slowest: list[tuple[float, str]] = []
    peak_rss_mb, t_start = 0.0, time.monotonic()
    running: dict[int, tuple[Case, Path, int, float, Path]] = {}
    next_case = 0

    def finish(pid: int, status: int, rusage: object, killed: str | None) -> None:
        nonlocal peak_rss_mb
        case, canary, rfd, started, err_path = running.pop(pid)
        raw = b""
        while chunk := _read(rfd):
            raw += chunk
        os.close(rfd)
        wall = time.monotonic() - started
        try:
            msg = json.loads(raw) if raw else {"outcome": "uncaught", "detail": f"child died (status {status})"}
        except ValueError:
            msg = {"outcome": "uncaught", "detail": "child sent garbage"}
        rss_mb = msg.get("rss_mb") or getattr(rusage, "ru_maxrss", 0) / 1024
        peak_rss_mb = max(peak_rss_mb, rss_mb)
        outcome = killed or msg["outcome"]
        stderr = err_path.read_text(errors="replace") if err_path.exists() else ""
        if outcome in _GOOD and "Traceback" in stderr:
            outcome = "traceback"
        if canary.exists():
            outcome = "executed"
        if outcome in _GOOD and rss_mb > args.rss_mb:
            outcome = "over-memory"
        if outcome in _GOOD and wall > args.timeout:
            outcome = "over-time"
        table[(case.target, outcome)] += 1
        kinds[(case.target, case.kind, outcome)] += 1
        slowest.append((wall, f"{case.target}/{case.kind} #{case.index} {rss_mb:.0f} MB"))
        if outcome not in _GOOD:
            bad.append({"index": case.index, "target": case.target, "kind": case.kind, "outcome": outcome,
                        "detail": str(msg.get("detail"))[:300], "stderr": stderr[-300:], "rss_mb": rss_mb})  # fmt: skip
        for p in (case.path, err_path, canary):
            p.unlink(missing_ok=True)

    while next_case < args.cases or running:
        while next_case < args.cases and len(running) < args.jobs:
            canary = work / f"CANARY-{next_case}"
            case = make_case(next_case, args.seed, work, canary, scale=args.scale)
            rfd, wfd = os.pipe()
            err_path = work / f"stderr-{next_case}.txt"
            plot = case.target == "snapshot" and next_case % args.plot_every == 0
            pid = os.fork()
            if pid == 0:
                os.close(rfd)
                _child(case, canary, plot, wfd, err_path)
            os.close(wfd)
            running[pid] = (case, canary, rfd, time.monotonic(), err_path)
            next_case += 1
        for pid in list(running):
            done_pid, status, rusage = os.wait4(pid, os.WNOHANG)
            if done_pid:
                finish(pid, status, rusage, None)
            elif time.monotonic() - running[pid][3] > args.timeout:
                os.kill(pid, 9)
                _, status, rusage = os.wait4(pid, 0)
                finish(pid, status, rusage, "over-time")
        time.sleep(0.002)
        if next_case and next_case % 1000 == 0 and len(running) == args.jobs:
            print(f"... {next_case} cases, {time.monotonic() - t_start:.0f} s", file=sys.stderr, flush=True)

    total = sum(table.values())
    outcomes = ("accepted", "rejected", "uncaught", "traceback", "executed", "over-time", "over-memory")
    by = {o: sum(n for (_, oo), n in table.items() if oo == o) for o in outcomes}
    print(f"{total} cases (seed {args.seed}, scale {args.scale}, {args.jobs} jobs), "
          f"{time.monotonic() - t_start:.0f} s, peak RSS of one case {peak_rss_mb:.0f} MB")  # fmt: skip
    print(f"{'target':<10}" + "".join(f"{o:>12}" for o in outcomes))
    for target in ("snapshot", "log", "config"):
        print(f"{target:<10}" + "".join(f"{table[(target, o)]:>12}" for o in outcomes))
    print(f"{'all':<10}" + "".join(f"{by[o]:>12}" for o in outcomes))
    print("slowest:", "; ".join(f"{s:.1f} s {what}" for s, what in sorted(slowest, reverse=True)[:5]))
    for b in bad[:20]:
        print("BAD", json.dumps(b))
    if args.out is not None:
        summary = {"cases": total, "seed": args.seed, "scale": args.scale, "outcomes": by,
                   "peak_rss_mb": peak_rss_mb, "seconds": time.monotonic() - t_start,
                   "by_kind": [[t, k, o, n] for (t, k, o), n in sorted(kinds.items())], "bad": bad}  # fmt: skip
        args.out.write_text(json.dumps(summary, indent=1))
    return 0 if all(by[o] == 0 for o in outcomes[2:]) else 1


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


if __name__ == "__main__":
    sys.exit(main())
