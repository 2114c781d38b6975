"""What a saved-tensor region costs autograd, and what a ring's release-by-fact cycle costs beyond it (host µs).

The added-time A/B on the H200 charges the combine stage about twice the hooks' own time there; the rest was
thought to be torch's side of the region the stage opens (autograd calling Python for each saved tensor, at
save and at backward). This measures that side alone on a stage shaped like the all-to-all combine (a product with
the routing probabilities, an ``index_add`` into the output), so small that the kernels cost little:

- ``plain``: the stage, no region;
- ``identity hooks``: inside ``torch.autograd.graph.saved_tensors_hooks`` with identity pack / unpack (torch's
  cost of a region, and of calling Python per saved tensor);
- ``pool tracker``: inside ``BufferPool.track_saved()`` (the hot path's region, C pack where it builds);
- ``alloc``: the control of a ring, the stage on a fresh ``torch.empty`` (the allocation a ring replaces) instead
  of the input that requires grad: the product saves it for the probabilities' gradient;
- ``alloc, identity hooks``: ``alloc`` inside identity pack / unpack: torch's cost of a region around that stage
  (its saved tensors), the part of the next arm that is not the pool's;
- ``ring, deferred``: the same stage on a ring slot instead, the whole release-by-fact cycle of a hooked stage
  whose slot is saved: acquire, the stage inside the pool's region (the slot saved: a counted reference),
  ``release_when_unsaved`` (deferred), backward (unpack; the freed reference releases the slot). Its difference is
  to ``alloc`` (the JSON also gives it to ``alloc, identity hooks``: the pool's own work). Run once more with
  ``BUFREUSE_NATIVE=0`` for the Python hot path's figure.

Blocks of ``--calls`` forward + backward calls, the arms in order and reversed in turn (A B C ... / ... C B A) over
``--blocks`` blocks; per block the median call; each arm's difference to its baseline per block, the mean with a 95%
t interval.

    python3 scripts/region_cost.py [--device cpu] [--blocks 12] [--calls 2000] [--json out.json]
    BUFREUSE_NATIVE=0 python3 scripts/region_cost.py ...   # the Python hot path
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bufreuse.analysis.runs.stats import mean_diff_interval
from bufreuse.pool import BufferPool


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.blocks < 3 or a.calls < 1:
        print("region_cost: --blocks must be >= 3 and --calls >= 1", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("region_cost: no CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    tokens, hidden = 8, 8
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    probs = torch.rand(tokens, 1, device=device, requires_grad=True)
    index = torch.arange(tokens, device=device)
    tracker = BufferPool(device, debug=False).track_saved()  # a pool without rings: no span to test per tensor
    pool = BufferPool(device, debug=False)  # the ring arm's own
    pool.register("fc2", policy="ring", num_slots=2, max_shape=(tokens, hidden), dtype=x.dtype)
    packed = [0]

    def stage(inp: torch.Tensor | None = None) -> torch.Tensor:
        return torch.zeros(tokens, hidden, device=device).index_add(0, index, (x if inp is None else inp) * probs)

    def alloc() -> torch.Tensor:
        return stage(torch.empty(tokens, hidden, device=device))

    def ring() -> torch.Tensor:
        slot = pool.acquire("fc2", (tokens, hidden))
        with pool.track_saved():
            out = stage(slot)
        pool.release_when_unsaved("fc2", slot)
        return out

    def identity(t: torch.Tensor) -> torch.Tensor:
        packed[0] += 1
        return t

    def hooks() -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(identity, lambda t: t):
            return stage()

    def alloc_hooks() -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(identity, lambda t: t):
            return alloc()

    def tracked() -> torch.Tensor:
        with tracker:
            return stage()

    arms = {
        "plain": stage,
        "identity hooks": hooks,
        "pool tracker": tracked,
        "alloc": alloc,
        "alloc, identity hooks": alloc_hooks,
        "ring, deferred": ring,
    }
    baseline = {
        "identity hooks": "plain",
        "pool tracker": "plain",
        "alloc, identity hooks": "alloc",
        "ring, deferred": "alloc",
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def block(fn, n: int) -> tuple[float, float]:
        fwd, bwd = [], []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            out = fn()
            t1 = time.perf_counter_ns()
            s = out.sum()
            t2 = time.perf_counter_ns()
            s.backward()
            t3 = time.perf_counter_ns()
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
        sync()
        return statistics.median(fwd) / 1e3, statistics.median(bwd) / 1e3

    for fn in arms.values():
        block(fn, 500)
    packed[0] = 0
    hooks()
    saved = packed[0]
    packed[0] = 0
    alloc_hooks()
    saved_ring_stage = packed[0]
    deferred_before = pool.get("fc2").stats.deferred_releases
    per: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    for k in range(a.blocks):
        names = list(arms) if k % 2 == 0 else list(reversed(arms))
        for name in names:
            per[name].append(block(arms[name], a.calls))
    ring_stats = pool.get("fc2").stats
    if ring_stats.deferred_releases - deferred_before != a.blocks * a.calls or pool.get("fc2").held:
        print("region_cost: a ring call was not deferred (its slot not saved), or a slot stayed held", file=sys.stderr)
        return 1
    import bufreuse

    result = {
        "device": str(device),
        "torch": torch.__version__,
        "bufreuse": _code_of(bufreuse.__file__),
        "c_hot_path": pool.hotpath is not None,
        "saved_tensors_per_call": saved,
        "saved_tensors_per_ring_stage_call": saved_ring_stage,
        "deferred_releases": ring_stats.deferred_releases,
        "arms": {},
    }
    for name in arms:
        row = {"fwd_us": statistics.fmean(r[0] for r in per[name]), "bwd_us": statistics.fmean(r[1] for r in per[name])}
        if name == "ring, deferred":  # the pool's own work: beyond torch's cost of a region around the same stage
            for i, part in enumerate(("fwd", "bwd")):
                diffs = [r[i] - p[i] for r, p in zip(per[name], per["alloc, identity hooks"], strict=True)]
                lo, hi = mean_diff_interval([0.0] * len(diffs), diffs)
                row[f"{part}_beyond_region_us"], row[f"{part}_beyond_region_ci_us"] = statistics.fmean(diffs), [lo, hi]
        if name in baseline:
            row["baseline"] = baseline[name]
            for i, part in enumerate(("fwd", "bwd")):
                diffs = [r[i] - p[i] for r, p in zip(per[name], per[baseline[name]], strict=True)]
                lo, hi = mean_diff_interval([0.0] * len(diffs), diffs)
                row[f"{part}_added_us"], row[f"{part}_ci_us"] = statistics.fmean(diffs), [lo, hi]
        result["arms"][name] = row
    print(
        f"{a.blocks} blocks of {a.calls} calls, {saved} saved tensors per call, {device}, torch {torch.__version__}, "
        f"C hot path {'on' if result['c_hot_path'] else 'off'}"
    )
    for name, row in result["arms"].items():
        line = f"  {name:15s} fwd {row['fwd_us']:6.1f} µs  bwd {row['bwd_us']:6.1f} µs"
        if "fwd_added_us" in row:
            line += "  added to {}: fwd {:+.1f} [{:+.1f}, {:+.1f}]  bwd {:+.1f} [{:+.1f}, {:+.1f}]".format(
                row["baseline"], row["fwd_added_us"], *row["fwd_ci_us"], row["bwd_added_us"], *row["bwd_ci_us"]
            )
        if "fwd_beyond_region_us" in row:
            line += "\n  {:15s} beyond a region around the same stage: fwd {:+.1f} [{:+.1f}, {:+.1f}]".format(
                "", row["fwd_beyond_region_us"], *row["fwd_beyond_region_ci_us"]
            ) + "  bwd {:+.1f} [{:+.1f}, {:+.1f}]".format(row["bwd_beyond_region_us"], *row["bwd_beyond_region_ci_us"])
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _code_of(path: str) -> dict[str, str | None]:
    """Which bufreuse ran: its folder and, when that is a git checkout, the commit (old / new runs side by side)."""
    import os
    import subprocess

    folder = os.path.dirname(os.path.abspath(path))
    try:
        done = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        commit = done.stdout.strip() if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"path": folder, "commit": commit}


if __name__ == "__main__":
    sys.exit(main())
