"""Write a valid-looking allocator snapshot with big strings planted in it (the snapshot memory-budget test).

Takes a real example snapshot (``examples/sweep-h200/*/snapshot.pickle.gz``), keeps its trace and
segments, and replaces frame file names and function names of randomly chosen trace entries with
big distinct strings (ASCII with one wide character at the end, so each byte of the file costs two or
four bytes once loaded) until the
pickle reaches ``--mb`` MB. Every string is referenced by one frame, so nothing is shared: the file
is as big as the strings. Seeded: the same ``--seed`` and ``--mb`` give the same bytes.

Usage: ``python scripts/gen_planted_snapshot.py OUT.pickle [--mb 200] [--seed 0]``
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _seed() -> dict:
    from bufreuse.analysis.snapshot.unpickle import loads_restricted

    path = sorted((ROOT / "examples/sweep-h200").glob("*/snapshot.pickle.gz"))[0]
    return loads_restricted(gzip.decompress(path.read_bytes()))


def planted(mb: int, seed: int) -> dict:
    """The seed snapshot with about ``mb`` MB of big strings planted in its frames."""
    rng = random.Random(seed)
    snap = _seed()
    frames = [f for trace in snap["device_traces"] for e in trace for f in e.get("frames") or []]
    if not frames:
        raise SystemExit("the seed snapshot has no frames to plant strings in")
    left = mb * 10**6
    while left > 0:
        size = min(left, rng.choice([1, 4, 16, 64]) * 10**6)
        wide = rng.choice(["é", "\U0001f600"])  # one wide character widens the whole string once loaded
        text = rng.choice(["a", "/"]) * (size - 4) + wide
        frame = rng.choice(frames)
        if rng.random() < 0.5:
            frame["filename"] = f"/workspace/megatron/core/{text}{rng.random()}.py"  # a user frame: names a site
        else:
            frame["name"] = text + str(rng.random())
        left -= size
    return snap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    snap = planted(args.mb, args.seed)
    events = sum(len(t) for t in snap["device_traces"])
    args.out.write_bytes(pickle.dumps(snap, protocol=4))
    print(f"{args.out}: {args.out.stat().st_size:,} bytes, {events:,} trace events")


if __name__ == "__main__":
    main()
