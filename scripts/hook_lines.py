"""Where the hooks' host time goes, line by line, in place: ``sys.monitoring`` line events on the hot path only.

The hook-time round says how long the hooks take in the layer (cold caches, between megatron's and TE's code)
but not which line: a warm loop cannot say it either. Here the ring arm of ``bench layer`` runs its timed
schedules with line events switched on for the hot path's code objects alone (the TE shim, the combine-stage
wrapper, the ring's acquire and release, ``Held``, the saved-tensor region and pack/unpack); every other frame runs
untraced. Each line is charged the time until the next event of the same thread, the monitoring callback's own
cost included; that cost is measured on a calibration function of empty lines and printed beside (subtract it
per line event). Counts are line *events*: a line that calls another monitored function is charged before the call
and again after it returns. Python >= 3.12. It measures the Python hot path (it sets
``BUFREUSE_NATIVE=0`` unless set: the C one of ``bufreuse.native`` has no lines to trace or methods to wrap).

    python scripts/hook_lines.py --preset host-bound --spec te --pad [--precision fp8] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import linecache
import os
import statistics
import sys
import threading
import time
from typing import Any

TOOL = 3  # sys.monitoring tool id (0-5; 3 is free in CPython's conventions: not the debugger, coverage or profiler)


class Lines:
    """ns per (code, line) until the next event of the same thread, for the codes switched on.

    A stack per thread: a monitored function called from a monitored line charges that line up to its first line,
    and on return the caller's line runs on from then (time in unmonitored code a line calls, megatron's or TE's,
    is that line's: the lines calling the originals carry them).
    """

    def __init__(self) -> None:
        self.ns: dict[tuple[Any, int], list[int]] = {}
        self._t = threading.local()

    def _stack(self) -> list[list[Any]]:
        stack = getattr(self._t, "stack", None)
        if stack is None:
            stack = self._t.stack = []
        return stack

    def _charge(self, entry: list[Any], now: int) -> None:
        row = self.ns.get(entry[0])
        if row is None:
            row = self.ns[entry[0]] = [0, 0]
        row[0] += now - entry[1]
        row[1] += 1

    def line(self, code: Any, line: int) -> None:
        now = time.perf_counter_ns()
        stack = self._stack()
        if stack and stack[-1][0][0] is code:
            self._charge(stack[-1], now)
            stack[-1] = [(code, line), time.perf_counter_ns()]
            return
        if stack:
            self._charge(stack[-1], now)
        stack.append([(code, line), time.perf_counter_ns()])

    def leave(self, code: Any, offset: int, *rest: Any) -> None:
        now = time.perf_counter_ns()
        stack = self._stack()
        if stack and stack[-1][0][0] is code:
            self._charge(stack.pop(), now)
            if stack:
                stack[-1][1] = time.perf_counter_ns()

    def start(self, codes: list[Any]) -> None:
        mon = sys.monitoring
        mon.use_tool_id(TOOL, "bufreuse-hook-lines")
        mon.register_callback(TOOL, mon.events.LINE, self.line)
        mon.register_callback(TOOL, mon.events.PY_RETURN, self.leave)
        mon.register_callback(TOOL, mon.events.PY_UNWIND, self.leave)
        mon.set_events(TOOL, mon.events.PY_UNWIND)  # a global event only: leave() ignores frames not on its stack
        for code in codes:
            mon.set_local_events(TOOL, code, mon.events.LINE | mon.events.PY_RETURN)

    def stop(self, codes: list[Any]) -> None:
        mon = sys.monitoring
        mon.set_events(TOOL, 0)
        for code in codes:
            mon.set_local_events(TOOL, code, 0)
        mon.free_tool_id(TOOL)


def _calibration(n: int = 20000) -> float:
    """ns charged per line event to a line doing nothing (the callback's own cost)."""

    def empty() -> None:
        a = 0
        a = 0
        a = 0
        a = 0
        del a

    lines = Lines()
    lines.start([empty.__code__])
    for _ in range(n):
        empty()
    lines.stop([empty.__code__])
    per = [ns / k for (_c, _l), (ns, k) in lines.ns.items()]
    return statistics.median(per)


def _codes() -> list[Any]:
    from bufreuse.integrations import core
    from bufreuse.integrations.alltoall import hooks
    from bufreuse.integrations.te import out_route
    from bufreuse.pool import ring, tracking
    from bufreuse.pool._device import DeviceOps

    codes = [
        out_route._routing_forward.__code__,
        ring.BufferRing.acquire.__code__,
        ring.BufferRing.release_when_unsaved.__code__,
        ring.BufferRing._record_release.__code__,
        core.Held.__init__.__code__,
        core.Held.release.__code__,
        tracking.SavedTracker.run.__code__,
        DeviceOps.current_stream.__code__,
    ]
    # closures: the combine-stage wrapper and the pack/unpack pair (their code objects, found by name)
    for fn in (hooks.hook_fc2_release, tracking._pack_unpack):
        codes += [c for c in fn.__code__.co_consts if hasattr(c, "co_code")]
    nested = []
    for c in list(codes):
        nested += [k for k in c.co_consts if hasattr(k, "co_code")]
    return codes + nested


def main() -> None:
    from hook_breakdown import layer_arguments  # scripts/ is on sys.path when a script runs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_arguments(ap)
    ap.add_argument("--manual-gc", action="store_true", help="the collector off during the timed schedules")
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args()
    if sys.version_info < (3, 12):
        print("hook_lines.py: needs Python >= 3.12 (sys.monitoring)", file=sys.stderr)
        raise SystemExit(2)
    os.environ.setdefault("BUFREUSE_NATIVE", "0")  # before bufreuse is imported: the Python path

    from bufreuse.bench import layer_bench as lb

    cfg = lb.layer_config(a.preset, device=a.device, shape={}, spec=a.spec, precision=a.precision, pad=a.pad,
                          steps=a.steps, rounds=2, hook_time=False, added_time=False)  # fmt: skip
    device = lb.check_config(cfg)
    per_line = _calibration()
    codes = _codes()
    lines = Lines()
    with lb.prepared(cfg, device) as p, lb._installed(p.layer, "ring", cfg, device):
        p.schedule()
        lb._sync(p.cuda)
        enabled = gc.isenabled()
        if a.manual_gc:
            gc.collect()
            gc.disable()
        lines.start(codes)
        try:
            for _ in range(cfg.steps):
                p.schedule()
            lb._sync(p.cuda)
        finally:
            lines.stop(codes)
            if enabled:
                gc.enable()
    calls = cfg.steps * cfg.microbatches
    rows = []
    for (code, line), (ns, k) in lines.ns.items():
        text = linecache.getline(code.co_filename, line).strip()
        rows.append({
            "where": f"{code.co_qualname}:{line}",
            "line": text[:90],
            "us_per_layer_call": ns / calls / 1e3,
            "events_per_layer_call": k / calls,
            "us_less_callback": (ns - k * per_line) / calls / 1e3,
        })  # fmt: skip
    rows.sort(key=lambda r: -r["us_per_layer_call"])
    total = sum(r["us_per_layer_call"] for r in rows)
    events = sum(r["events_per_layer_call"] for r in rows)
    out = {"config": {"preset": a.preset, "spec": a.spec, "precision": a.precision, "pad": a.pad, "steps": a.steps,
                      "manual_gc": a.manual_gc},
           "callback_ns_per_event": per_line, "total_us": total, "events_per_layer_call": events,
           "total_less_callback_us": total - events * per_line / 1e3, "lines": rows}  # fmt: skip
    less = out["total_less_callback_us"]
    print(
        f"per layer call: {total:.1f} µs over {events:.0f} line events; the callback's own cost "
        f"{per_line:.0f} ns per event ({events * per_line / 1e3:.1f} µs); less it: {less:.1f} µs"
    )
    for r in rows[:40]:
        print(
            f"{r['us_per_layer_call']:8.2f} {r['us_less_callback']:8.2f} {r['events_per_layer_call']:5.1f}  "
            f"{r['where']:<55} {r['line']}"
        )
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
