"""What narrowing the dispatch slot's saved-tensor region saves: the experts' readers only vs the whole stage.

Where the experts read the all-to-all dispatch slot directly (one local expert: no sort copy), production opens a
saved-tensor region only around the modules that take the slot (``dispatch_postprocess`` and the experts'
``linear_fc1``: :func:`bufreuse.integrations.alltoall.hooks.dispatch_slot_readers`); before, the whole
``routed_experts_compute`` ran in one, so every tensor the experts save (activation, FC2, probs) went through the
pool's pack hook and its unpack in backward. This runs a real megatron-core ``MoELayer`` (``bufreuse bench layer``'s
layer, schedule and rounds; the dispatch ring exercised at EP = 1, where the sort after it is a no-op, so the
experts read the slot for any number of them) in three arms in one process:

- ``control``: no hooks;
- ``narrow``: ``install()`` as it is (the ring policy);
- ``whole``: the same with the readers unknown (``dispatch_slot_readers`` answering None): the previous design but
  for the experts' forward, which it also wrapped in a nested region (one more push and pop per layer call, so
  ``whole - narrow`` slightly understates what the change saves).

Rounds in A B C C B A order; per round the host µs per layer call (forward + backward); per cycle the difference of
each arm's two rounds to the others', the mean with a 95% t interval over cycles; and the tensors through the pack
hook per layer call of each arm (a counted pass after the timed rounds).

    python3 scripts/narrow_cost.py [--spec local|te] [--precision bf16|fp8] [--preset tiny] [--experts 1]
        [--topk 1] [--cycles 6] [--steps 16] [--device cpu|cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from typing import Any

import torch

from bufreuse.analysis.runs.stats import mean_diff_interval
from bufreuse.bench import layer_bench
from bufreuse.errors import InputError
from bufreuse.integrations.alltoall import hooks
from bufreuse.pool import tracking

ARMS = ("control", "narrow", "whole")


@contextlib.contextmanager
def _arm(name: str) -> Iterator[None]:
    """``whole``: the dispatch hook told that the readers are unknown (it tracks the whole experts stage)."""
    if name != "whole":
        yield
        return
    real = hooks.dispatch_slot_readers
    hooks.dispatch_slot_readers = lambda layer, inst=None: None
    try:
        yield
    finally:
        hooks.dispatch_slot_readers = real


@contextlib.contextmanager
def _counting(counter: list[int]) -> Iterator[None]:
    """Count the pool's pack-hook calls (pools built inside)."""
    real = tracking._pack_unpack

    def counted_pair(*args: Any, **kwargs: Any) -> Any:
        pack, unpack = real(*args, **kwargs)

        def pack_counted(t: torch.Tensor) -> Any:
            counter[0] += 1
            return pack(t)

        return pack_counted, unpack

    tracking._pack_unpack = counted_pair
    try:
        yield
    finally:
        tracking._pack_unpack = real


def _round(p: Any, arm: str) -> dict[str, Any]:
    with _arm(arm):
        return layer_bench._run_round(p, "control" if arm == "control" else "ring")


def _packs_per_call(p: Any, arm: str) -> float:
    counter = [0]
    with _arm(arm), _counting(counter), layer_bench._installed(p.layer, "ring", p.cfg, p.device):
        p.schedule()
        counter[0] = 0
        p.schedule()
        layer_bench._sync(p.cuda)
    return counter[0] / p.cfg.microbatches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="local")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--experts", type=int, default=1, help="local experts (at EP = 1 the sort is a no-op for any)")
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.cycles < 3 or a.steps < 1:
        print("narrow_cost: --cycles must be >= 3 and --steps >= 1", file=sys.stderr)
        return 2
    try:
        cfg = layer_bench.layer_config(
            a.preset,
            device=a.device,
            shape={"hidden": a.hidden, "tokens": a.tokens, "experts": a.experts, "topk": a.topk},
            spec=a.spec,
            precision=a.precision,
            steps=a.steps,
            rounds=2,
            dispatch_ring=True,
            pad=True,
            gc="manual",
        )
        device = layer_bench.check_config(cfg)
    except InputError as e:
        print(f"narrow_cost: {e}", file=sys.stderr)
        return 2
    try:
        return _measure(a, cfg, device)
    except InputError as e:  # megatron-core refusing the shape, raised while the layer is built
        print(f"narrow_cost: {e}", file=sys.stderr)
        return 2


def _measure(a: argparse.Namespace, cfg: Any, device: torch.device) -> int:
    rounds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with layer_bench.prepared(cfg, device) as p:
        if hooks.dispatch_slot_readers(p.layer) is None:
            print("narrow_cost: the experts' readers of the dispatch slot are not known here: nothing to compare",
                  file=sys.stderr)  # fmt: skip
            return 2
        for arm in ARMS:  # warm-up, dropped
            _round(p, arm)
        for _ in range(a.cycles):
            for arm in (*ARMS, *ARMS[::-1]):
                rounds[arm].append(_round(p, arm)["host_us"])
        packs = {arm: _packs_per_call(p, arm) for arm in ARMS[1:]}
    out: dict[str, Any] = {
        "config": {
            "spec": cfg.spec,
            "precision": cfg.precision,
            "hidden": cfg.hidden,
            "tokens": cfg.tokens,
            "ffn": cfg.ffn,
            "experts": cfg.experts,
            "topk": cfg.topk,
            "steps": cfg.steps,
            "microbatches": cfg.microbatches,
            "cycles": a.cycles,
            "device": str(device),
        },
        "host_us": {arm: statistics.median(v) for arm, v in rounds.items()},
        "packs_per_layer_call": packs,
        "env": layer_bench._env(device),
        "differences_us": {},
    }
    for arm, base in (("narrow", "control"), ("whole", "control"), ("whole", "narrow")):
        diffs = [
            (rounds[arm][2 * c] + rounds[arm][2 * c + 1] - rounds[base][2 * c] - rounds[base][2 * c + 1]) / 2
            for c in range(a.cycles)
        ]
        # against a zero sample: Welch's interval reduces to the one-sample t interval of the cycle differences
        lo, hi = mean_diff_interval([0.0] * len(diffs), diffs) or (float("nan"), float("nan"))
        out["differences_us"][f"{arm} - {base}"] = {"mean": statistics.fmean(diffs), "ci_low": lo, "ci_high": hi}
    print(
        f"{cfg.spec} {cfg.precision}, hidden {cfg.hidden}, {cfg.tokens} tokens, {cfg.experts} expert(s), "
        f"top-{cfg.topk}, {device}; {a.cycles} A B C C B A cycles of {cfg.steps} schedules x {cfg.microbatches} "
        "layer calls"
    )
    for arm in ARMS:
        extra = f", {packs[arm]:.1f} tensors through the pack hook" if arm in packs else ""
        print(f"  {arm:8s} {out['host_us'][arm]:9.1f} µs / layer call (median round){extra}")
    for name, d in out["differences_us"].items():
        print(f"  {name:18s} {d['mean']:+8.1f} µs  95% CI [{d['ci_low']:+.1f}, {d['ci_high']:+.1f}]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
