#!/usr/bin/env python3
"""Compare Megatron ``lm loss`` iteration by iteration between control and rings logs.

Usage: ``python3 scripts/compare_losses.py [--json OUT.json] [--tolerance T] CONTROL RINGS [CONTROL RINGS ...]``

Each (control, rings) pair is compared at every iteration both logs printed: the printed text
(``equal`` means the same digits, what a bit-identical run prints), and the absolute difference.
An iteration only one log printed is listed as missing. Reads the iteration lines itself (a closing
``|`` after the loss field, so a truncated last line never counts); launcher prefixes are fine.
Exit status: 0 when every pair agrees within ``--tolerance`` (default 0: same printed digits) at
every common iteration and no iteration is missing, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

_LINE_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|.*?\blm loss:\s*([^\s|]+)\s*\|")


@dataclass(kw_only=True, slots=True)
class PairResult:
    """One control/rings pair, iteration by iteration."""

    control: str
    rings: str
    rows: list[dict[str, object]] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    compared: int = 0
    equal: int = 0
    max_abs_diff: float = 0.0
    first_difference: int | None = None
    ok: bool = True


def losses(path: Path) -> dict[int, str]:
    """Printed ``lm loss`` per iteration (the last printing of an iteration wins)."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    found = {int(m.group(1)): m.group(2) for m in _LINE_RE.finditer(text)}
    if not found:
        raise ValueError(f"{path}: no Megatron iteration line with an lm loss")
    return found


def compare_pair(control: Path, rings: Path, tolerance: float) -> PairResult:
    """Every common iteration's printed losses; ``ok`` when all agree within ``tolerance`` and none is missing."""
    a, b = losses(control), losses(rings)
    res = PairResult(control=str(control), rings=str(rings))
    res.missing = sorted(set(a) ^ set(b))
    for it in sorted(set(a) & set(b)):
        x, y = float(a[it]), float(b[it])
        same = a[it] == b[it]
        diff = abs(x - y) if math.isfinite(x) and math.isfinite(y) else (0.0 if same else math.inf)
        within = same or diff <= tolerance
        res.rows.append({"iteration": it, "control": a[it], "rings": b[it], "abs_diff": diff, "equal": same})
        res.compared += 1
        res.equal += same
        res.max_abs_diff = max(res.max_abs_diff, diff)
        if not within and res.first_difference is None:
            res.first_difference = it
    res.ok = res.first_difference is None and not res.missing
    return res


def _render(res: PairResult) -> str:
    lines = [f"{res.control} vs {res.rings}", f"{'iteration':>9}  {'control':>14}  {'rings':>14}  abs diff"]
    lines += [f"{r['iteration']:>9}  {r['control']:>14}  {r['rings']:>14}  {r['abs_diff']:.3g}" for r in res.rows]
    lines.append(
        f"{res.compared} iterations compared, {res.equal} printed identically, max |diff| {res.max_abs_diff:.3g}"
        + (f", first difference at iteration {res.first_difference}" if res.first_difference is not None else "")
        + (f", missing in one log: {res.missing}" if res.missing else "")
        + (": AGREE" if res.ok else ": DIFFER")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Compare every pair; print one table each; write JSON if asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path, help="CONTROL RINGS [CONTROL RINGS ...]")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--tolerance", type=float, default=0.0, help="largest absolute loss difference accepted")
    args = parser.parse_args(argv)
    if len(args.logs) % 2 or args.tolerance < 0:
        print("compare_losses: error: give CONTROL RINGS pairs and a tolerance >= 0", file=sys.stderr)
        return 2
    try:
        results = [compare_pair(args.logs[i], args.logs[i + 1], args.tolerance) for i in range(0, len(args.logs), 2)]
    except ValueError as e:
        print(f"compare_losses: error: {e}", file=sys.stderr)
        return 2
    print("\n\n".join(_render(r) for r in results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
