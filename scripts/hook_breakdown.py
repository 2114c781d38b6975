"""Where the hooks' own host time goes: the hook-time round repeated with one internal at a time counted as work.

``bufreuse bench layer``'s hook-time round charges everything inside bufreuse's hook frames. Here the same
round runs again with one piece of the pool (the ring's acquire, its release, the ``Held`` record, the
saved-tensor region) wrapped as an *original*: the drop against the plain round is that piece's share,
cold caches and all. Variants are interleaved (A B C ... A B C ...) over ``--repeats`` passes in one process
on one layer; the median per variant is printed, with the spread over passes. It measures the Python hot path (it sets
``BUFREUSE_NATIVE=0`` unless set: the C one of ``bufreuse.native`` has no lines to trace or methods to wrap).

    python scripts/hook_breakdown.py --preset host-bound --spec te --pad [--precision fp8] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
from collections.abc import Iterator
from typing import Any

VARIANTS = {
    "all": None,
    "without ring acquire": ("bufreuse.pool.ring", "BufferRing", "acquire"),
    "without ring release": ("bufreuse.pool.ring", "BufferRing", "release_when_unsaved"),
    "without Held record": ("bufreuse.integrations.core", "Held", "__init__"),
    "without saved-tensor region": ("bufreuse.pool.tracking", "SavedTracker", "run"),
}


@contextlib.contextmanager
def _as_original(clock: Any, target: tuple[str, str, str] | None) -> Iterator[None]:
    if target is None:
        yield
        return
    import importlib

    cls = getattr(importlib.import_module(target[0]), target[1])
    old = vars(cls)[target[2]]
    setattr(cls, target[2], clock.original(old))
    try:
        yield
    finally:
        setattr(cls, target[2], old)


def layer_arguments(ap: argparse.ArgumentParser) -> None:
    """The layer these diagnostic scripts measure: ``bench layer``'s shape, spec, precision, routing and steps."""
    ap.add_argument("--preset", default="host-bound")
    ap.add_argument("--spec", default="te")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--pad", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_arguments(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("BUFREUSE_NATIVE", "0")  # before bufreuse is imported: the Python path

    from bufreuse.bench import hook_time
    from bufreuse.bench import layer_bench as lb

    cfg = lb.layer_config(a.preset, device=a.device, shape={}, spec=a.spec, precision=a.precision, pad=a.pad,
                          steps=a.steps, rounds=2, hook_time=False)  # fmt: skip
    device = lb.check_config(cfg)
    bias = hook_time.calibrate()
    rows: dict[str, list[float]] = {v: [] for v in VARIANTS}
    originals: dict[str, float] = {}
    with lb.prepared(cfg, device) as prep:
        for _ in range(a.repeats):
            for name, target in VARIANTS.items():
                plain = hook_time.instrumented

                @contextlib.contextmanager
                def instrumented(clock: Any, _t: Any = target, _plain: Any = plain) -> Iterator[Any]:
                    with _plain(clock) as during, _as_original(clock, _t):
                        yield during

                hook_time.instrumented = instrumented  # what _hook_time_arm imports when it runs
                try:
                    figure = lb._hook_time_arm(prep, "ring", bias)
                finally:
                    hook_time.instrumented = plain
                rows[name].append(figure["us"])
                originals[name] = figure["originals_per_layer_call"]
    out = {
        "config": {"preset": a.preset, "spec": a.spec, "precision": a.precision, "pad": a.pad, "steps": a.steps},
        "calibration_ns": bias,
        "variants": {
            v: {
                "median_us": statistics.median(xs_),
                "min_us": min(xs_),
                "max_us": max(xs_),
                "originals_per_layer_call": originals[v],
                "passes": xs_,
            }
            for v, xs_ in rows.items()
        },
    }
    base = out["variants"]["all"]["median_us"]
    print(f"hooks' own host µs per layer call ({a.preset}, {a.spec}, {a.precision}, {'pad' if a.pad else 'dropless'}),"
          f" median of {a.repeats} interleaved passes")  # fmt: skip
    for v, r in out["variants"].items():
        share = "" if v == "all" else f"  share {base - r['median_us']:6.1f}"
        print(f"  {v:30s} {r['median_us']:7.1f} [{r['min_us']:.1f}, {r['max_us']:.1f}]{share}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
