#!/usr/bin/env python3
"""One machine-readable summary of a family's interleaved Megatron-LM A/B rounds (scripts/megatron-ab.sh).

Usage: ``python3 scripts/megatron_ab_summary.py --out DIR --family F --rounds R [--json F-summary.json]``

Reads what megatron-ab.sh wrote into DIR (``bufreuse compare --json`` outputs ``F-roundK.json``, ``F-ab.json``,
``F-driftK.json``, ``F-drift.json``; ``compare_losses.py``'s ``F-losses.json``, ``F-losses-drift.json``;
``ab-order.txt``, ``ab-skipped.txt`` when present) and gives, from the step-time median:

- per round: the arms' order (from ``ab-order.txt``; null when not recorded), each arm's median step time,
  the ratio rings / control, its delta and 95% interval (ms and % of the control), ``bufreuse compare``'s
  verdict;
- overall: the median, min and max of the round ratios, one verdict (the rounds' common verdict, or
  ``inconclusive`` when they disagree), whether every round's interval lies inside the ±band, the
  between-rounds interval (geometric mean of the round ratios with a 95% Student-t interval over the
  rounds: the run-to-run spread, which the per-round intervals over iterations do not see), and the
  all-runs comparison against the first control;
- drift: each pair of neighbouring control runs and the first against the last (the noise floor), and
  the largest |drift|;
- losses: the largest |Δ lm loss| control vs rings per round beside the control-vs-control one.

Prints a short text summary; with ``--json`` also writes the summary there (atomically).
Exit status: 0 on success, 2 when an input is missing or unreadable.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

METRIC = "step_ms_median"


class SummaryError(Exception):
    """An input the summary needs is missing or not what compare wrote."""


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SummaryError(f"{path}: {e}") from e


def _step(compare: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """The step-time-median row of every comparison in one ``bufreuse compare --json`` output."""
    rows = []
    for c in compare.get("comparisons", []):
        m = next((m for m in c.get("metrics", []) if m.get("metric") == METRIC), None)
        if m is None or m.get("baseline") in (None, 0) or m.get("value") is None:
            raise SummaryError(f"{path}: no {METRIC} for {c.get('label')}")
        base = float(m["baseline"])
        ci = [m.get("ci_low"), m.get("ci_high")]
        rows.append(
            {
                "label": c.get("label"),
                "baseline_ms": base,
                "value_ms": float(m["value"]),
                "ratio": float(m["value"]) / base,
                "delta_pct": 100.0 * (float(m["value"]) - base) / base,
                "ci95_ms": ci,
                "ci95_pct": [None if x is None else 100.0 * float(x) / base for x in ci],
                "band_pct": 100.0 * float(m.get("band", 0.0)) / base,
                "verdict": m.get("verdict"),
                "n": [m.get("n_baseline"), m.get("n_value")],
            }
        )
    if not rows:
        raise SummaryError(f"{path}: no comparison in it")
    return rows


def _pair(out: Path, stem: str) -> dict[str, Any]:
    path = out / f"{stem}.json"
    compare = _load(path)
    row = _step(compare, path)[0]
    row["baseline"] = compare.get("baseline")
    return row


# Two-sided 95% Student-t quantiles by degrees of freedom (rounds - 1); the summary stays standard-library only.
_T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    25: 2.060,
    30: 2.042,
}


def between_rounds(ratios: list[float], band: float) -> dict[str, Any]:
    """Geometric mean of the round ratios and its 95% t interval over rounds (in %), judged against ±band.

    Each round is one control and one rings process, so the rounds' spread holds the process-to-process
    noise that an interval over one run's iterations cannot. Fewer than 3 rounds: no interval.
    """
    if any(not r > 0 for r in ratios):
        raise SummaryError(f"a round's step-time ratio is not positive: {ratios}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    out: dict[str, Any] = {"n": len(ratios), "ratio_geomean": math.exp(mean), "ci95_pct": [None, None]}
    if len(ratios) < 3:
        out["verdict"] = "inconclusive"
        return out
    df = len(ratios) - 1
    t = _T95.get(df) or _T95[max(k for k in _T95 if k <= df)]  # past the table: the next smaller df (wider)
    half = t * statistics.stdev(logs) / math.sqrt(len(ratios))
    lo, hi = (math.exp(mean - half) - 1) * 100, (math.exp(mean + half) - 1) * 100
    out["ci95_pct"] = [lo, hi]
    if -band <= lo and hi <= band:
        out["verdict"] = "parity"
    elif lo > band:
        out["verdict"] = "regression"
    elif hi < -band:
        out["verdict"] = "improvement"
    else:
        out["verdict"] = "inconclusive"
    return out


def _inside(ci: list[float | None], band: float) -> bool:
    return None not in ci and -band <= ci[0] and ci[1] <= band  # type: ignore[operator]


def summarize(out: Path, family: str, rounds: int) -> dict[str, Any]:
    """The summary dictionary of one family's ``rounds`` complete rounds in ``out``."""
    if rounds < 1:
        raise SummaryError("--rounds must be at least 1")
    order = _order(out, family)
    per_round = []
    for k in range(1, rounds + 1):
        row = _pair(out, f"{family}-round{k}")
        per_round.append(
            {
                "round": k,
                "order": order.get(k),
                "control_ms": row["baseline_ms"],
                "rings_ms": row["value_ms"],
                "ratio": row["ratio"],
                "delta_pct": row["delta_pct"],
                "ci95_ms": row["ci95_ms"],
                "ci95_pct": row["ci95_pct"],
                "verdict": row["verdict"],
                "n": row["n"],
            }
        )
    ratios = [r["ratio"] for r in per_round]
    verdicts = {r["verdict"] for r in per_round}
    band = _pair(out, f"{family}-round1")["band_pct"]
    drift = [_pair(out, f"{family}-drift{k}") for k in range(1, rounds)]
    first_last = _pair(out, f"{family}-drift") if rounds > 1 else None
    all_runs_path = out / f"{family}-ab.json"
    summary: dict[str, Any] = {
        "family": family,
        "metric": METRIC,
        "rounds": rounds,
        "band_pct": band,
        "per_round": per_round,
        "overall": {
            "verdict": verdicts.pop() if len(verdicts) == 1 else "inconclusive",
            "round_verdicts": [r["verdict"] for r in per_round],
            "ratio_median_of_rounds": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "every_round_ci_inside_band": all(_inside(r["ci95_pct"], band) for r in per_round),
            "between_rounds": between_rounds(ratios, band),
            "all_runs_vs_first_control": _step(_load(all_runs_path), all_runs_path),
        },
        "drift": {
            "neighbouring_controls": [_drift_row(d) for d in drift],
            "first_vs_last_control": None if first_last is None else _drift_row(first_last),
            "max_abs_pct": max(
                (abs(d["delta_pct"]) for d in [*drift, *([first_last] if first_last else [])]), default=None
            ),
        },
        "losses": _losses(out, family),
    }
    for name in ("ab-order.txt", "ab-skipped.txt"):
        path = out / name
        if path.is_file():
            summary[name.removesuffix(".txt").replace("-", "_")] = path.read_text().splitlines()
    return summary


def _order(out: Path, family: str) -> dict[int, str]:
    """Each round's arm order as megatron-ab.sh ran it (``ab-order.txt``); empty when not recorded."""
    path = out / "ab-order.txt"
    arms: dict[int, list[str]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == family and parts[2].isdigit():
                arms.setdefault(int(parts[2]), []).append(parts[1])
    return {k: " ".join(v) for k, v in arms.items()}


def _drift_row(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("baseline", "label", "baseline_ms", "value_ms", "ratio", "delta_pct", "ci95_ms", "ci95_pct", "verdict")
    return {k: row[k] for k in keys}


def _losses(out: Path, family: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for stem, key in (("losses", "control_vs_rings_max_abs"), ("losses-drift", "control_vs_control_max_abs")):
        path = out / f"{family}-{stem}.json"
        if path.is_file():
            result[key] = [p.get("max_abs_diff") for p in _load(path)]
    return result


def render(summary: dict[str, Any]) -> str:
    """A few lines for the console: each round, the overall verdict, the drift."""
    lines = [f"{summary['family']}: step time median, rings / control, band ±{summary['band_pct']:.2f}%"]
    for r in summary["per_round"]:
        lo, hi = r["ci95_pct"]
        ci = "n/a" if lo is None else f"[{lo:+.2f}%, {hi:+.2f}%]"
        lines.append(
            f"  round {r['round']} ({r['order'] or 'order not recorded'}): "
            f"{r['control_ms']:.1f} -> {r['rings_ms']:.1f} ms, "
            f"ratio {r['ratio']:.4f} ({r['delta_pct']:+.2f}%), CI95 {ci}, {r['verdict']}"
        )
    o = summary["overall"]
    lines.append(
        f"  overall: {o['verdict']}; median of round ratios {o['ratio_median_of_rounds']:.4f} "
        f"({o['ratio_min']:.4f} - {o['ratio_max']:.4f}); every round's CI inside the band: "
        f"{o['every_round_ci_inside_band']}"
    )
    b = o["between_rounds"]
    lo, hi = b["ci95_pct"]
    ci = "n/a (fewer than 3 rounds)" if lo is None else f"[{lo:+.2f}%, {hi:+.2f}%]"
    lines.append(f"  between rounds: geometric mean {b['ratio_geomean']:.4f}, CI95 {ci}, {b['verdict']}")
    d = summary["drift"]
    rows = list(d["neighbouring_controls"])
    if summary["rounds"] > 2:  # with two rounds the first-vs-last pair is the one neighbouring pair
        rows.append(d["first_vs_last_control"])
    for row in rows:
        lines.append(f"  drift {row['baseline']} -> {row['label']}: {row['delta_pct']:+.2f}% ({row['verdict']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder megatron-ab.sh wrote into")
    parser.add_argument("--family", required=True)
    parser.add_argument("--rounds", type=int, required=True, help="complete rounds to read")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    try:
        summary = summarize(args.out, args.family, args.rounds)
    except SummaryError as e:
        print(f"megatron_ab_summary: error: {e}", file=sys.stderr)
        return 2
    if args.json is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bufreuse, from any folder
        from bufreuse.fsutil import atomic_write_json

        atomic_write_json(args.json, summary)
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
