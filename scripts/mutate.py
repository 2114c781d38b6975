#!/usr/bin/env python3
"""Mutation check: put small deliberate bugs into a copy of the repository and see which the tests miss.

Each mutation in the data file (default ``scripts/mutations.toml``) names a file, a snippet that must
occur in it exactly once, its replacement, and the tests that should catch it. For each mutation the
script copies the repository's tracked and untracked-but-not-ignored files into a temporary folder
(the working tree is never touched), applies the one replacement, runs the named tests there and
reports the mutation as **killed** (the tests failed), **survived** (they passed), **stale** (the
snippet is no longer in the file, or not exactly once: update the data file) or **error** (the run
timed out). The named tests are first run once unmutated; a mutation whose tests fail unmutated is
reported as ``baseline-failing`` instead of killed. The whole set is run by hand, before and after a
refactor; CI runs the ``--quick`` set (the mutations marked ``quick = true``: release rules whose tests
take seconds on CPU), which fails on a survivor.

    python scripts/mutate.py                     # every mutation, a table on stdout
    python scripts/mutate.py --only band --only gate --markdown results.md --json results.json
    python scripts/mutate.py --fail-on-survivor  # exit 1 if any mutation survives (GPU-only ones excepted)
    python scripts/mutate.py --quick             # the quick set, --fail-on-survivor implied (.ci/run)

Exit codes: 0 done; 1 with ``--fail-on-survivor`` and a survivor, or a stale mutation; 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT / "scripts" / "mutations.toml"


@dataclass(kw_only=True)
class Mutation:
    """One deliberate bug: replace ``original`` (exactly once in ``file``) by ``mutated``, run ``tests``."""

    name: str
    file: str
    original: str
    mutated: str
    tests: list[str]
    why: str = ""
    gpu_only: bool = False
    """Expected to survive a CPU run (the behaviour is a no-op without CUDA); reported, never a failure."""
    quick: bool = False
    """In the ``--quick`` set CI runs: CPU-catchable, its tests take seconds."""


@dataclass(kw_only=True)
class Result:
    name: str
    file: str
    outcome: str
    seconds: float
    tests: list[str]
    why: str = ""
    gpu_only: bool = False
    detail: str = ""
    extra: dict = field(default_factory=dict)


def load(path: Path) -> list[Mutation]:
    """The mutations of a TOML file (``[[mutation]]`` tables); raises ``SystemExit(2)`` on a bad file."""
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
        out = [Mutation(**m) for m in doc["mutation"]]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        print(f"error: {path}: not a mutation file ({type(e).__name__}: {e})", file=sys.stderr)
        raise SystemExit(2) from None
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        print(f"error: {path}: duplicate mutation names", file=sys.stderr)
        raise SystemExit(2)
    if any(m.original == m.mutated for m in out):
        print(f"error: {path}: a mutation that changes nothing", file=sys.stderr)
        raise SystemExit(2)
    if any(m.quick and m.gpu_only for m in out):
        print(f"error: {path}: a GPU-only mutation in the quick set (CPU cannot kill it)", file=sys.stderr)
        raise SystemExit(2)
    return out


def copy_repo(dest: Path) -> None:
    """Tracked and untracked-but-not-ignored files of the repository, as they are in the working tree."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    )  # fmt: skip
    for rel in filter(None, listing.stdout.decode().split("\0")):
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[str, str]:
    """``(passed | failed | timeout, last lines)`` of pytest on ``tests`` inside the copy."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    env.pop("BUFREUSE_TEST_OUTCOMES", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--no-header", *tests]
    try:
        res = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    tail = " | ".join(line for line in res.stdout.strip().splitlines()[-3:] if line.strip())
    if res.returncode == 0:
        return "passed", tail
    if res.returncode == 5:  # no tests collected: the data file names tests that do not exist
        return "no-tests", tail
    return "failed", tail


def mutate(m: Mutation, copy: Path, timeout: float, baseline: dict[tuple[str, ...], str]) -> Result:
    start = time.monotonic()
    path = copy / m.file
    base = Result(name=m.name, file=m.file, outcome="", seconds=0.0, tests=m.tests, why=m.why, gpu_only=m.gpu_only)
    if not path.is_file():
        base.outcome, base.detail = "stale", f"{m.file} does not exist"
        return base
    text = path.read_text(encoding="utf-8")
    count = text.count(m.original)
    if count != 1:
        base.outcome, base.detail = "stale", f"snippet found {count} times in {m.file} (must be exactly once)"
        return base
    key = tuple(m.tests)
    if key not in baseline:
        baseline[key], _ = run_tests(copy, m.tests, timeout)
    if baseline[key] != "passed":
        base.outcome, base.detail = "baseline-failing", f"the named tests are {baseline[key]} without the mutation"
        base.seconds = time.monotonic() - start
        return base
    path.write_text(text.replace(m.original, m.mutated), encoding="utf-8")
    try:
        status, tail = run_tests(copy, m.tests, timeout)
    finally:
        path.write_text(text, encoding="utf-8")
    base.outcome = {"failed": "killed", "passed": "survived", "timeout": "error", "no-tests": "stale"}[status]
    base.detail = tail if status != "timeout" else f"timed out after {timeout:.0f} s"
    base.seconds = time.monotonic() - start
    return base


def markdown(results: list[Result]) -> str:
    rows = ["| mutation | file | outcome | caught by | what it breaks |", "|---|---|---|---|---|"]
    for r in results:
        outcome = f"**{r.outcome}**" if r.outcome == "survived" and not r.gpu_only else r.outcome
        if r.gpu_only and r.outcome == "survived":
            outcome = "survived (GPU-only by design)"
        tests = ", ".join(f"`{t}`" for t in r.tests)
        rows.append(f"| `{r.name}` | `{r.file}` | {outcome} | {tests} | {r.why} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the mutation file (TOML)")
    ap.add_argument("--only", action="append", default=[], help="run mutations whose name contains this (repeatable)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    ap.add_argument("--markdown", type=Path, help="also write the result table here")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--fail-on-survivor", action="store_true", help="exit 1 when a CPU-catchable mutation survives")
    ap.add_argument("--quick", action="store_true", help="only the quick set (quick = true; CI), --fail-on-survivor")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)
    mutations = load(args.data)
    if args.quick:
        mutations = [m for m in mutations if m.quick]
        args.fail_on_survivor = True
    if args.only:
        mutations = [m for m in mutations if any(o in m.name for o in args.only)]
    if args.list:
        for m in mutations:
            print(f"{m.name:40s} {m.file}  ({', '.join(m.tests)})")
        return 0
    if not mutations:
        print("error: no mutation selected", file=sys.stderr)
        return 2
    # On SIGTERM: unwind, so the running pytest is killed and the temporary copy removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: list[Result] = []
    baseline: dict[tuple[str, ...], str] = {}
    with tempfile.TemporaryDirectory(prefix="bufreuse-mutate-") as tmp:
        copy = Path(tmp) / "repo"
        copy_repo(copy)
        for i, m in enumerate(mutations, 1):
            r = mutate(m, copy, args.timeout, baseline)
            results.append(r)
            print(f"[{i}/{len(mutations)}] {r.outcome:16s} {r.name} ({r.seconds:.0f} s) {r.detail}", flush=True)
    survivors = [r for r in results if r.outcome == "survived" and not r.gpu_only]
    stale = [r for r in results if r.outcome in ("stale", "baseline-failing", "error")]
    killed = sum(r.outcome == "killed" for r in results)
    print()
    print(markdown(results))
    print(f"{killed} killed, {len(survivors)} survived, {sum(r.gpu_only and r.outcome == 'survived' for r in results)} "
          f"GPU-only survived, {len(stale)} stale/error of {len(results)}")  # fmt: skip
    if args.markdown:
        args.markdown.write_text(markdown(results), encoding="utf-8")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1), encoding="utf-8")
    if stale or (args.fail_on_survivor and survivors):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
