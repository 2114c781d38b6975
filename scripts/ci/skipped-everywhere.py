#!/usr/bin/env python3
"""Fail when a test is collected but skipped on every machine the project runs its tests on.

The machines: CPU CI (``.ci/run``: plain ``pytest``, everything not ``gpu``/``te`` runs, SLURM included)
and the H200 (``scripts/gpu-tests.sh``: ``pytest -m gpu``, where conftest skips nothing for want of a
GPU and, once TE is staged, nothing for want of TE). A test therefore runs somewhere iff it ran in the
CPU run, or it is ``gpu``-marked (so the GPU run selects it) and, when that run's outcomes are given,
did not skip there either. A ``te``-marked test without ``gpu`` is selected by neither run.

Inputs are the JSON files conftest writes when ``BUFREUSE_TEST_OUTCOMES=FILE`` is set:

    BUFREUSE_TEST_OUTCOMES=.ci-outcomes.json pytest
    python scripts/ci/skipped-everywhere.py .ci-outcomes.json [--gpu gpu-outcomes.json]

Exit 0: every test runs somewhere; 1: the list printed ran nowhere; 2: unreadable input.
``--allow-marker slurm`` accepts skips of tests with that marker (a laptop without the SLURM cluster).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        tests = doc["tests"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {path}: not a test-outcomes file ({e})", file=sys.stderr)
        sys.exit(2)
    if not isinstance(tests, dict):
        print(f"error: {path}: 'tests' is not an object", file=sys.stderr)
        sys.exit(2)
    return tests


def _ran(entry: dict | None) -> bool:
    return entry is not None and entry.get("outcome") != "skipped"


def nowhere(cpu: dict, gpu: dict | None, allow: set[str]) -> list[tuple[str, str]]:
    """``(nodeid, why)`` of every test that is skipped on every machine."""
    out = []
    for nodeid, entry in sorted(cpu.items()):
        if _ran(entry):
            continue
        markers = set(entry.get("markers") or [])
        if markers & allow:
            continue
        reason = entry.get("reason") or "?"
        if entry.get("collection"):  # a whole module skipped while collecting on CPU
            if gpu is not None and any(_ran(e) for k, e in gpu.items() if k.startswith(nodeid + "::")):
                continue
            out.append((nodeid, f"module skipped on CPU ({reason}), no test of it ran on the GPU"))
            continue
        if "gpu" not in markers:
            out.append((nodeid, f"skipped on CPU ({reason}) and not gpu-marked, so scripts/gpu-tests.sh deselects it"))
        elif gpu is not None and not _ran(gpu.get(nodeid)):
            where = "skipped" if nodeid in gpu else "absent"
            why = (gpu.get(nodeid) or {}).get("reason") or ""
            out.append((nodeid, f"skipped on CPU ({reason}) and {where} in the GPU run {why}".rstrip()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cpu", help="outcomes of the CPU run (.ci/run)")
    ap.add_argument("--gpu", help="outcomes of the GPU run (scripts/gpu-tests.sh); default: gpu-marked tests run there")
    ap.add_argument("--allow-marker", action="append", default=[], help="accept skips of tests with this marker")
    args = ap.parse_args(argv)
    cpu = _load(args.cpu)
    gpu = _load(args.gpu) if args.gpu else None
    bad = nowhere(cpu, gpu, set(args.allow_marker))
    skipped = sum(1 for e in cpu.values() if not _ran(e))
    covered = "per the GPU run's outcomes" if gpu is not None else "assumed to run under scripts/gpu-tests.sh"
    print(f"skipped-everywhere: {len(cpu)} collected on CPU, {skipped} skipped there; gpu-marked skips {covered}")
    for nodeid, why in bad:
        print(f"  runs nowhere: {nodeid}: {why}")
    if bad:
        print(f"skipped-everywhere: {len(bad)} test(s) run on no machine: mark them gpu, or make them run on CPU")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
