"""Peak memory and time of ``bufreuse compare`` on worst-case training logs, at sizes up to the log budgets.

Writes a log of the chosen shape, runs ``python -m bufreuse compare LOG LOG`` (the log twice: compare
holds both runs) in a child process, and reports its exit code, peak RSS (``os.wait4``'s ``ru_maxrss``)
and wall time, optionally under an address-space limit (``ulimit -v``). Shapes:

- ``short``: the shortest line the grammars read as an iteration (``iteration N/1|TFLOPs:1|``), N rising;
- ``worst``: every column filled (timing, throughput, loss, two iteration-line memory fields), each
  iteration logged twice out of order (the duplicate-merging path) with gaps of 2 (weighted windows);
- ``megatron``: realistic Megatron-LM lines (timestamp prefix, ~330 bytes);
- ``memory``: one ``[Rank N] ... memory (MB)`` report repeated (ranks cycling), ten iteration lines;
- ``args``: argument lines with distinct names (the capped arguments block), ten iteration lines.

``--lines N`` writes N iteration lines (the other shapes: N report/argument lines); ``--bytes B`` writes
lines until the file reaches B bytes (``4G``, ``500M``). The file is deleted afterwards unless ``--keep``.

Usage::

    python scripts/log_memory.py --kind short --bytes 4G --ulimit-v 2500000
    python scripts/log_memory.py --kind worst --lines 2000000 --dir /tmp --json row.json
    python scripts/log_memory.py --kind megatron --lines 3000000 --limit max-log-iterations=3000000  # < 60 s, < 300 MB
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = 100_000  # lines built at a time


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def _short(start: int, n: int) -> str:
    return "".join(f"iteration {i}/1|TFLOPs:1|\n" for i in range(start, start + n))


def _worst(start: int, n: int) -> str:
    out = []
    for j in range(
        start - 1, start - 1 + n
    ):  # lines 4b..4b+3 log iterations 2b+2, 2b+1, 2b+2, 2b+1: twice, out of order
        k = 2 * (2 * (j // 4) + (2 if j % 2 == 0 else 1))  # gaps of 2: weighted windows
        out.append(
            f"iteration {k}/1|elapsed time per iteration (ms):{400 + k % 7}|TFLOPs:{200 + k % 5}|lm loss:6.5|"
            f"memory(GiB):{k % 9}|hip mem usage/free/total/usage_ratio:{k % 3}GB/1GB/2GB/0.5|\n"
        )
    return "".join(out)


def _megatron(start: int, n: int) -> str:
    return "".join(
        f" [2026-12-03 12:00:00] iteration {i:>8}/ 9999999 | consumed samples: {i * 512:>12} | elapsed time per "
        f"iteration (ms): {6000 + i % 97:.1f} | throughput per GPU (TFLOP/s/GPU): {1100 + i % 13:.1f} | learning "
        f"rate: 1.000000E-04 | global batch size:   512 | lm loss: 2.345678E+00 | loss scale: 1.0 | grad norm: "
        f"0.234 | number of skipped iterations:   0 | number of nan iterations:   0 |\n"
        for i in range(start, start + n)
    )


def _memory(start: int, n: int) -> str:
    return "".join(
        f"[Rank {i % 4096}] (after 2 iterations) memory (MB) | allocated: {i % 1000}.0 | max allocated: 2.0 | "
        "reserved: 3.0 | max reserved: 4.0 | total device memory used: 5.0\n"
        for i in range(start, start + n)
    )


def _args(start: int, n: int) -> str:
    return "".join(f"  argument_{i} .................... {i}\n" for i in range(start, start + n))


_SHAPES = {"short": _short, "worst": _worst, "megatron": _megatron, "memory": _memory, "args": _args}
_TEN_ITERATIONS = "".join(f" iteration {i}/ 10 | elapsed time per iteration (ms): 400.0 |\n" for i in range(1, 11))


def _chunks(kind: str, *, lines: int | None, max_bytes: int | None) -> Iterator[str]:
    make, done, start = _SHAPES[kind], 0, 1
    if kind in ("memory", "args"):
        done = len(_TEN_ITERATIONS)
        yield _TEN_ITERATIONS
    while lines is None or start <= lines:
        n = _BLOCK if lines is None else min(_BLOCK, lines - start + 1)
        text = make(start, n)
        if max_bytes is not None and done + len(text) > max_bytes:
            text = text[: text.rfind("\n", 0, max_bytes - done) + 1]
            if text:
                yield text
            return
        done += len(text)
        start += n
        yield text


def write_log(path: Path, kind: str, *, lines: int | None, max_bytes: int | None) -> tuple[int, int]:
    """Write the log; ``(bytes, lines)``."""
    size = count = 0
    with open(path, "w", encoding="ascii") as f:
        for text in _chunks(kind, lines=lines, max_bytes=max_bytes):
            f.write(text)
            size += len(text)
            count += text.count("\n")
    return size, count


def measure(path: Path, *, ulimit_kb: int | None, extra: list[str]) -> dict[str, object]:
    """Run ``bufreuse compare LOG LOG`` in a child; exit code, peak RSS (MiB), wall time, stderr's first line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def limit() -> None:
        if ulimit_kb is not None:
            resource.setrlimit(resource.RLIMIT_AS, (ulimit_kb * 1024, ulimit_kb * 1024))

    cmd = [sys.executable, "-m", "bufreuse", *extra, "compare", str(path), str(path)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd="/", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limit)
    assert proc.stderr is not None
    err = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "exit": proc.returncode,
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "wall_s": round(time.monotonic() - t0, 1),
        "stderr": err.strip().splitlines()[0][:300] if err.strip() else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=sorted(_SHAPES), required=True)
    ap.add_argument("--lines", type=int, help="iteration (or report/argument) lines to write")
    ap.add_argument("--bytes", type=_size, help="write lines until the file reaches this size (4G, 500M)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the log is written")
    ap.add_argument("--ulimit-v", type=int, help="address-space limit of the child, KiB (as ulimit -v)")
    ap.add_argument("--limit", action="append", default=[], help="a --limit NAME=N passed to bufreuse")
    ap.add_argument("--keep", action="store_true", help="keep the log file")
    ap.add_argument("--json", type=Path, help="append the result as one JSON line to this file")
    args = ap.parse_args()
    if args.lines is None and args.bytes is None:
        ap.error("give --lines or --bytes")
    path = args.dir / f"log-memory-{args.kind}-{os.getpid()}.log"
    t0 = time.monotonic()
    size, count = write_log(path, args.kind, lines=args.lines, max_bytes=args.bytes)
    written = time.monotonic() - t0
    try:
        extra = [x for item in args.limit for x in ("--limit", item)]
        row = {"kind": args.kind, "bytes": size, "lines": count, "ulimit_v_kib": args.ulimit_v, "limits": args.limit}
        row.update(measure(path, ulimit_kb=args.ulimit_v, extra=extra))
        row["write_s"] = round(written, 1)
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
    print(json.dumps(row))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
