"""Seeded fuzz: 2,000 hostile snapshots, logs and configs end in a report or one error line, never in code.

The cases (``tests/fuzz_cases.py``) are the kinds of the hostile-inputs issue at a small scale so CI
stays bounded; ``scripts/fuzz_hostile.py`` runs 10,000+ at full scale with one process per case.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

from fuzz_cases import make_case, run_case

CASES = 2000
SEED = 17
CASE_SECONDS = 10.0


def test_fuzz_cases_end_in_a_report_or_one_error_line(tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    bad, slow = [], []
    for i in range(CASES):
        case = make_case(i, SEED, tmp_path, canary, scale=0.005)
        t0 = time.perf_counter()
        outcome, detail = run_case(case, canary, plot=i % 200 == 0)
        seconds = time.perf_counter() - t0
        outcomes[(case.target, outcome)] += 1
        if outcome not in ("accepted", "rejected"):
            bad.append((i, case.target, case.kind, outcome, detail))
        if seconds > CASE_SECONDS:
            slow.append((i, case.kind, round(seconds, 1)))
        case.path.unlink()
    assert not canary.exists()
    assert bad == []
    assert slow == []
    for target in ("snapshot", "log", "config"):  # every path saw both good and bad input
        assert outcomes[(target, "accepted")] > 0 and outcomes[(target, "rejected")] > 0, outcomes


def test_pickled_code_never_runs(tmp_path: Path) -> None:
    import random

    from fuzz_cases import _exec_pickle

    canary = tmp_path / "CANARY"
    rng = random.Random(5)
    for i in range(200):
        kind, data = _exec_pickle(rng, canary)
        p = tmp_path / f"evil{i}.pickle"
        p.write_bytes(data)
        from fuzz_cases import Case

        outcome, detail = run_case(Case(index=i, target="snapshot", kind=kind, path=p), canary)
        assert outcome == "rejected", (kind, detail)
        assert "refused to load global" in detail, detail
    assert not canary.exists()
