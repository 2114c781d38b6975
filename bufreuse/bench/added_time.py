"""Host time the hooks add per layer call over the control: one timer, the same in both arms.

The hook clock (:mod:`bufreuse.bench.hook_time`) charges the hooks' own frames: its cost at every
boundary, cold, stays in that figure, and what the control does instead (TE's allocation of the FC2
output, the stage megatron runs itself) is not subtracted. This measures the difference of the arms
instead. Two layers are built the same way (same weights, same inputs); the arm is installed on one,
and the points where a call enters its hooks (``Installation.entry_points``: the overridden stages,
``forward`` of the FC2 module the TE route switched) and the same points of the other layer
(:func:`counterparts`) are wrapped by one span timer (the outermost span on the calling thread only:
nested points are inside it); one schedule of each layer runs in turn, A B B A, and the layers swap
roles halfway. The timer's cost is the same in both and cancels, and the control's own work at those
points (the allocation the ring replaces) is in the control's figure. Hook code that runs outside every
point exists in the hooked arm only and is timed by the same timer and added in full: autograd's unpack
of a saved slot and the saved-reference holder's ``__del__`` (the deferred release) in backward, and the
autograd Functions' backward (the local spec's, whose control counterpart, a ``CatBackward``, is then not
subtracted).

Per pair of schedules the figure is the hooked µs per layer call less its neighbouring plain schedule's;
the 95% t interval is over whole A B B A groups. One installation serves each half, so a pair costs two
schedules, not two installations: on the H200 host the TE work inside the points varies by 80–230 µs per
layer call from one pair to the next (in rounds of separate installations as much), far more than the
hooks cost, and only the count of pairs narrows the interval. Two figures per schedule: the mean span per
layer call (what throughput pays, every long call included) and the per-call median (each point's median
span times its calls per layer call: the typical call). Class-level patches shared by installations (the
release-path patches of combined 1F1B, not called by a single layer) are not points.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["SpanTimer", "counterparts", "outside_points", "pair_order", "spanned", "summarise_pairs"]


class SpanTimer:
    """Host ns inside wrapped points, outermost span per thread only, by point name; thread-safe totals and
    the per-call spans."""

    def __init__(self) -> None:
        self._t = threading.local()
        self._lock = threading.Lock()
        self.by_point: dict[str, list[int]] = {}
        """Point name -> [ns, calls]."""
        self.samples: dict[str, list[int]] = {}
        """Point name -> each call's ns, in call order."""

    def reset(self) -> None:
        """Forget what was timed (call it with no span open)."""
        with self._lock:
            self.by_point = {}
            self.samples = {}

    def per_call_median_ns(self, calls: int) -> dict[str, float]:
        """Point name -> its median span times its calls per ``calls`` layer calls (ns per layer call)."""
        with self._lock:
            return self._medians_ns(calls)

    def _medians_ns(self, calls: int) -> dict[str, float]:  # the caller holds the lock
        return {n: statistics.median(v) * len(v) / calls for n, v in self.samples.items() if v}

    def snapshot(self, calls: int) -> dict[str, Any]:
        """What the timer holds after ``calls`` layer calls, read under its lock: µs per layer call, by point, as
        means (``us``, ``by_point``) and per-call medians (``median_us``, ``by_point_median``)."""
        with self._lock:
            by_point = {n: row[0] for n, row in self.by_point.items()}
            medians = self._medians_ns(calls)
        return {
            "us": sum(by_point.values()) / calls / 1e3,
            "by_point": {n: ns / calls / 1e3 for n, ns in by_point.items()},
            "median_us": sum(medians.values()) / 1e3,
            "by_point_median": {n: ns / 1e3 for n, ns in medians.items()},
        }

    @property
    def ns(self) -> int:
        """Total ns over every point."""
        return sum(row[0] for row in self.by_point.values())

    def _add(self, name: str, ns: int) -> None:
        with self._lock:
            row = self.by_point.get(name)
            if row is None:
                row = self.by_point[name] = [0, 0]
            row[0] += ns
            row[1] += 1
            self.samples.setdefault(name, []).append(ns)

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``fn`` timed as point ``name`` unless a span is already open on this thread."""
        clock, t, add = time.perf_counter_ns, self._t, self._add

        def span(*args: Any, **kwargs: Any) -> Any:
            if getattr(t, "inside", False):
                return fn(*args, **kwargs)
            t.inside = True
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns = clock() - start
                t.inside = False
                add(name, ns)

        return span


def point_name(obj: Any, attr: str) -> str:
    """``Class.attr`` (the TE route's switched class keeps its class's name, so both arms name a point alike)."""
    return f"{type(obj).__name__}.{attr}"


def counterparts(src: Any, dst: Any, points: list[tuple[Any, str]]) -> list[tuple[Any, str]]:
    """``points`` on module ``src`` (or on objects its modules hold directly, as a layer's token dispatcher) -> the
    objects at the same attribute paths of ``dst``, a module built the same way. Objects deeper than that (held by
    a plain object) are not searched: ``ValueError``."""
    paths: dict[int, list[str]] = {}
    for name, module in src.named_modules():
        base = name.split(".") if name else []
        paths.setdefault(id(module), base)
        for attr, value in vars(module).items():
            paths.setdefault(id(value), [*base, attr])
    out = []
    for obj, attr in points:
        path = paths.get(id(obj))
        if path is None:
            raise ValueError(f"{type(obj).__name__} is not reachable from {type(src).__name__}'s modules")
        target = dst
        for part in path:
            target = getattr(target, part, None)
            if target is None:
                raise ValueError(f"{type(dst).__name__} has nothing at {'.'.join(path)} ({type(src).__name__} has)")
        out.append((target, attr))
    return out


@contextlib.contextmanager
def spanned(points: list[tuple[Any, str]], timer: SpanTimer) -> Iterator[None]:
    """Wrap each ``(object, attribute)`` (whatever it is now: the class's method, or an arm's hook) for the block.

    Leave the block before uninstalling an arm: an installation's undo would otherwise remove the wrapper and
    the wrapper's undo put the hook back.
    """
    undo: list[Callable[[], None]] = []
    try:
        for obj, attr in points:
            own = vars(obj)
            had, old = attr in own, own.get(attr)
            setattr(obj, attr, timer.wrap(getattr(obj, attr), point_name(obj, attr)))
            undo.append(
                (lambda o=obj, a=attr, v=old: setattr(o, a, v)) if had else (lambda o=obj, a=attr: delattr(o, a))
            )
        yield
    finally:
        while undo:
            undo.pop()()


@contextlib.contextmanager
def outside_points(timer: SpanTimer) -> Iterator[Callable[[], Any]]:
    """Time the hook code no point encloses (see the module docstring) for the block; yields ``during()``, a
    context to open around ``install()`` (pools built inside get a timed unpack)."""
    from bufreuse.bench.hook_time import pool_hook_code_wrapped, saved_pair_wrapped

    def during() -> Any:
        return saved_pair_wrapped(lambda pack, unpack: (pack, timer.wrap(unpack, "saved-tensor unpack")))

    with pool_hook_code_wrapped(timer.wrap):
        yield during


def pair_order(pairs: int, arm: str) -> list[str]:
    """``pairs`` control / arm pairs in A B B A order: C A A C C A ..."""
    out: list[str] = []
    for k in range(pairs):
        out += ["control", arm] if k % 2 == 0 else [arm, "control"]
    return out


def summarise_pairs(control: list[dict[str, Any]], arm: list[dict[str, Any]]) -> dict[str, Any]:
    """Pairs of schedules (``us`` per layer call, ``by_point``; ``median_us`` / ``by_point_median`` where timed) ->
    the mean added µs, its 95% t interval, per point; the same of the per-call medians under ``per_call_median``.

    ``control[k]`` and ``arm[k]`` are the k-th pair, in :func:`pair_order`'s order. The interval is the one-sample
    t interval (``mean_diff_interval`` against a constant side) of the A B B A groups' differences (pairs 2j and
    2j + 1, averaged: the order within a pair and a linear drift cancel in each, and adjacent pairs are not
    counted as independent); of the pairs' when their count is odd.
    """
    out = _paired(control, arm, "us", "by_point")
    if all("median_us" in r for r in control + arm):
        out["per_call_median"] = _paired(control, arm, "median_us", "by_point_median")
    return out


def _paired(control: list[dict[str, Any]], arm: list[dict[str, Any]], key: str, points_key: str) -> dict[str, Any]:
    from bufreuse.analysis.runs.stats import mean_diff_interval

    diffs = [a[key] - c[key] for c, a in zip(control, arm, strict=True)]
    grouped = len(diffs) % 2 == 0
    units = [(diffs[j] + diffs[j + 1]) / 2 for j in range(0, len(diffs), 2)] if grouped else diffs
    ci = mean_diff_interval([0.0] * len(units), units)
    names = sorted({n for r in control + arm for n in r[points_key]})

    def mean_of(rounds: list[dict[str, Any]], name: str) -> float:
        return statistics.fmean(r[points_key].get(name, 0.0) for r in rounds)

    points = [
        {
            "point": name,
            "control_us": mean_of(control, name),
            "arm_us": mean_of(arm, name),
            "added_us": mean_of(arm, name) - mean_of(control, name),
        }
        for name in names
    ]
    return {
        "added_us": statistics.fmean(diffs),
        "ci_low_us": ci[0] if ci else None,
        "ci_high_us": ci[1] if ci else None,
        "median_us": statistics.median(diffs),
        "pairs": len(diffs),
        "pair_added_us": diffs,
        "interval_over": f"{len(units)} A B B A groups" if grouped else f"{len(units)} pairs",
        "control_us": statistics.fmean(c[key] for c in control),
        "arm_us": statistics.fmean(a[key] for a in arm),
        "points": sorted(points, key=lambda row: -abs(row["added_us"])),
    }
