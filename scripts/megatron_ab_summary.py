#!/usr/bin/env python3
"""One machine-readable summary of a family's interleaved Megatron-LM A/B rounds (scripts/megatron-ab.sh).

Usage: ``python3 scripts/megatron_ab_summary.py --out DIR --family F --rounds R [--json F-summary.json]``
       ``python3 scripts/megatron_ab_summary.py --pool DIR [DIR...] --family F [--json F-pooled.json]``

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

``--pool DIR...`` pools one family's rounds from several calls or device sessions (each DIR holds the
``F-summary.json`` and run logs a ``--compare-only`` left): resolving ±1% takes more processes per arm than
one session holds. Each round is a paired ratio, so rounds from other machines of the same kind pool; the
pool refuses (exit 2) unless every control run, and every rings run, logged the same command (run name and
master port aside) and every round dropped the same warm-up. It gives each session's between-rounds
interval and the pooled one.

Exit status: 0 on success, 2 when an input is missing or unreadable, or runs that cannot pool.
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


def _ci_text(b: dict[str, Any]) -> str:
    """A :func:`between_rounds` interval as printed."""
    lo, hi = b["ci95_pct"]
    return "n/a (fewer than 3 rounds)" if lo is None else f"[{lo:+.2f}%, {hi:+.2f}%]"


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
    lines.append(f"  between rounds: geometric mean {b['ratio_geomean']:.4f}, CI95 {_ci_text(b)}, {b['verdict']}")
    d = summary["drift"]
    rows = list(d["neighbouring_controls"])
    if summary["rounds"] > 2:  # with two rounds the first-vs-last pair is the one neighbouring pair
        rows.append(d["first_vs_last_control"])
    for row in rows:
        lines.append(f"  drift {row['baseline']} -> {row['label']}: {row['delta_pct']:+.2f}% ({row['verdict']})")
    return "\n".join(lines)


def run_command(log: Path) -> list[str]:
    """A run's command as megatron-ab.sh logged it (the log's first line), without its run name and master port."""
    try:
        with log.open() as f:
            first = f.readline()
    except OSError as e:
        raise SummaryError(f"{log}: {e}") from e
    if not first.startswith("== ") or ": " not in first:
        raise SummaryError(f"{log}: its first line is not the command megatron-ab.sh logs ('== NAME: COMMAND')")
    words = first.split(": ", 1)[1].split()
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w == "--master-port":
            skip = True
        else:
            out.append(w)
    return out


def _first_difference(a: list[str], b: list[str]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"word {i + 1}: {x!r} vs {y!r}"
    return f"one command is longer ({len(a)} vs {len(b)} words)"


def pool(dirs: list[Path], family: str) -> dict[str, Any]:
    """One family's rounds from several ``--compare-only`` folders: each session's and the pooled interval.

    Refuses (``SummaryError``) runs that cannot pool: another family or metric, another band, a control (or
    rings) run whose command differs from the first one's, or rounds that dropped another warm-up (their
    sample counts differ).
    """
    if not dirs:
        raise SummaryError("--pool needs at least one folder")
    first: dict[str, tuple[list[str], Path]] = {}
    samples: tuple[Any, Path] | None = None
    sessions, ratios, band = [], [], None
    for d in dirs:
        s = _load(d / f"{family}-summary.json")
        if s.get("family") != family or s.get("metric") != METRIC:
            raise SummaryError(
                f"{d}: a summary of {s.get('family')!r} by {s.get('metric')!r}, not {family!r} by {METRIC}"
            )
        rounds = s.get("per_round") or []
        if not rounds:
            raise SummaryError(f"{d}: {family}-summary.json has no round")
        if band is None:
            band = s["band_pct"]
        elif abs(s["band_pct"] - band) > 1e-9:
            raise SummaryError(f"{d}: band ±{s['band_pct']}%, the first folder's is ±{band}%")
        for r in rounds:
            for arm in ("control", "rings"):
                log = d / f"{family}-{arm}-{r['round']}.log"
                cmd = run_command(log)
                ref = first.setdefault(arm, (cmd, log))
                if cmd != ref[0]:
                    raise SummaryError(
                        f"{log} ran another command than {ref[1]} ({_first_difference(ref[0], cmd)}): not the same A/B"
                    )
            if samples is None:
                samples = (r["n"], d)
            elif r["n"] != samples[0]:
                raise SummaryError(
                    f"{d}: round {r['round']} compared {r['n']} iterations, {samples[1]} {samples[0]}: "
                    "another warm-up or run length"
                )
        rs = [r["ratio"] for r in rounds]
        ratios += rs
        sessions.append(
            {
                "out": str(d),
                "rounds": len(rs),
                "ratios": rs,
                "between_rounds": between_rounds(rs, band),
                "drift_max_abs_pct": (s.get("drift") or {}).get("max_abs_pct"),
            }
        )
    drifts = [x["drift_max_abs_pct"] for x in sessions if x["drift_max_abs_pct"] is not None]
    return {
        "family": family,
        "metric": METRIC,
        "band_pct": band,
        "sessions": sessions,
        "rounds": len(ratios),
        "ratios": ratios,
        "between_rounds": between_rounds(ratios, band),
        "drift_max_abs_pct": max(drifts, default=None),
        "command": {arm: " ".join(cmd) for arm, (cmd, _) in first.items()},
    }


def render_pool(p: dict[str, Any]) -> str:
    """Each session's between-rounds interval, then the pooled one."""

    def line(b: dict[str, Any]) -> str:
        g = b["ratio_geomean"]
        return f"geometric mean {g:.4f} ({(g - 1) * 100:+.2f}%), CI95 {_ci_text(b)}, {b['verdict']}"

    lines = [f"{p['family']}: step time median, rings / control, band ±{p['band_pct']:.2f}%, pooled over folders"]
    for s in p["sessions"]:
        drift = "n/a" if s["drift_max_abs_pct"] is None else f"{s['drift_max_abs_pct']:.2f}%"
        lines.append(f"  {s['out']}: {s['rounds']} round(s), {line(s['between_rounds'])}; control drift max |{drift}|")
    lines.append(f"  pooled, {p['rounds']} rounds: {line(p['between_rounds'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder megatron-ab.sh wrote into")
    parser.add_argument("--family", required=True)
    parser.add_argument("--rounds", type=int, default=None, help="complete rounds to read")
    parser.add_argument("--pool", type=Path, nargs="+", default=None, metavar="DIR", help="pool these folders' rounds")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    try:
        if args.pool is not None:
            if args.out is not None or args.rounds is not None:
                raise SummaryError("--pool reads each folder's F-summary.json: no --out or --rounds with it")
            summary = pool(args.pool, args.family)
            text = render_pool(summary)
        else:
            if args.out is None or args.rounds is None:
                raise SummaryError("--out and --rounds are needed (or --pool DIR...)")
            summary = summarize(args.out, args.family, args.rounds)
            text = render(summary)
    except SummaryError as e:
        print(f"megatron_ab_summary: error: {e}", file=sys.stderr)
        return 2
    if args.json is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bufreuse, from any folder
        from bufreuse.fsutil import atomic_write_json

        atomic_write_json(args.json, summary)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
