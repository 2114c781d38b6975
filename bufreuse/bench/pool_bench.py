"""CPU cost of one acquire+release pair against the allocator path, and the external-event probe.

``run_pool_bench`` times, in one process on one device, ``torch.empty`` + ``record_stream`` + free of
the bound shape against ``BufferRing.acquire``/``release`` and ``BufferPool.acquire``/``release`` for
each policy (producer and consumer on two streams, streams passed explicitly as hot paths do), and the
production ring pair: ``acquire`` + ``release_when_unsaved`` inside an active ``track_saved`` scope.
Variants are interleaved over ``repeats`` rounds and the median is reported. On CPU the same loops run
with CPU tensors (events are no-ops, no ``record_stream``): figures then say nothing about a GPU host.

Two more rows give the saved-tensor hook cost *per saved tensor* (not per pair): a ``x * w`` forward
saving two tensors, with ``track_saved`` minus without, halved — once for tensors that are not ring
storage (pass-through) and once with ``x`` a ring slot (a counting holder made, and freed with the
graph).

``probe_external_events`` runs, each in a fresh subprocess with a timeout (a variant may hang), the
eager <-> CUDA-graph event transitions that the seed built on ``torch.cuda.Event(external=True)``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bufreuse.pool import BufferPool, BufferRing

__all__ = ["PROBE_VARIANTS", "TARGET_RATIO", "PoolBenchConfig", "probe_external_events", "run_pool_bench"]

TARGET_RATIO = 0.7
"""Target for (production ring pair, tracking on) / (torch.empty + record_stream + free)."""

TRACKED_ROW = "BufferPool ring, tracking on (acquire + release_when_unsaved)"
HOOK_ROWS = (
    "track_saved pack hook, per saved tensor (not ring storage)",
    "track_saved pack hook + free, per saved tensor (ring storage)",
    "identity saved_tensors_hooks, per saved tensor (torch's own floor)",
)

Progress = Callable[[int, int], None]


@dataclass(kw_only=True, slots=True)
class PoolBenchConfig:
    """What ``bufreuse bench pool`` measures."""

    device: str | None = None
    """``cuda``/``cuda:N`` or ``cpu``; default: CUDA when available."""
    tokens: int | None = None
    """Rows of the buffer (default 32768 on CUDA, the DESIGN proxy; 1024 on CPU)."""
    hidden: int | None = None
    """Columns (default 4096 on CUDA; 1024 on CPU)."""
    dtype: str = "bfloat16"
    """Element type (a ``torch`` dtype name)."""
    slots: int = 4
    """Ring slots."""
    iters: int = 20000
    """Pairs per timed loop."""
    repeats: int = 5
    """Interleaved rounds per variant; the median is reported."""


def run_pool_bench(cfg: PoolBenchConfig, *, progress: Progress | None = None) -> dict[str, Any]:
    """Time every variant; return rows (µs per pair, ratio to the allocator path) and the environment."""
    device = _resolve_device(cfg.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, cfg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {cfg.dtype!r} is not a torch dtype")
    shape = (cfg.tokens or (32768 if cuda else 1024), cfg.hidden or (4096 if cuda else 1024))
    producer = torch.cuda.Stream(device) if cuda else None
    consumer = torch.cuda.Stream(device) if cuda else None
    ring = BufferRing("bench_ring", cfg.slots, shape, dtype, device, debug=False)
    pool = BufferPool(device, debug=False)
    pool.register("ring", policy="ring", num_slots=cfg.slots, max_shape=shape, dtype=dtype)
    pool.register("stream-ordered", policy="stream-ordered", max_shape=shape, dtype=dtype)
    pool.register("record-stream", policy="record-stream", max_shape=shape, dtype=dtype)
    baseline_name = "torch.empty + record_stream + free" if cuda else "torch.empty + free (CPU)"
    variants: dict[str, Callable[[int], None]] = {
        baseline_name: _baseline_loop(shape, dtype, device, consumer),
        "BufferRing.acquire + release": _ring_loop(ring, shape, producer, consumer),
        "BufferPool ring": _pool_loop(pool, "ring", shape, producer, consumer),
        TRACKED_ROW: _tracked_loop(pool, "ring", shape, producer, consumer),
        "BufferPool stream-ordered": _pool_loop(pool, "stream-ordered", shape, producer, consumer),
        "BufferPool record-stream": _pool_loop(pool, "record-stream", shape, producer, consumer),
    }
    if cuda:
        variants["torch.cuda.current_stream() (reference)"] = _current_stream_loop(device)
    hooks = _hook_loops(pool, device)
    variants.update(hooks)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    total, done = cfg.repeats * len(variants), 0
    with torch.cuda.stream(producer) if cuda else _null():
        for fn in variants.values():  # warm-up: allocator caches, lazy CUDA init, events
            fn(max(cfg.iters // 10, 10))
        _sync(cuda)
        for _ in range(cfg.repeats):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn(cfg.iters)
                samples[name].append((time.perf_counter() - start) / cfg.iters * 1e6)
                _sync(cuda)
                done += 1
                if progress is not None:
                    progress(done, total)
    base = statistics.median(samples[baseline_name])
    for hook_row, bare in zip(HOOK_ROWS, ("_bare_saves", "_bare_saves_ring", "_bare_saves_identity"), strict=True):
        base_saves = samples.pop(bare)  # the same forward without hooks; 2 saved tensors per forward
        samples[hook_row] = [(t - b) / 2 for t, b in zip(samples[hook_row], base_saves, strict=True)]
    rows = [
        {
            "name": name,
            "us_per_pair": statistics.median(vals),
            "ratio": statistics.median(vals) / base,
            "min_us": min(vals),
            "max_us": max(vals),
        }
        for name, vals in samples.items()
    ]
    by_name = {row["name"]: row for row in rows}
    ring_ratio = by_name["BufferRing.acquire + release"]["ratio"]
    pool_ratio = by_name[TRACKED_ROW]["ratio"]
    return {
        "device": str(device),
        "cpu_tensors": not cuda,
        "note": None if cuda else "CPU tensors: events are no-ops and there is no record_stream; not a GPU figure",
        "shape": list(shape),
        "dtype": cfg.dtype,
        "config": asdict(cfg),
        "baseline": baseline_name,
        "rows": rows,
        "ring_ratio": ring_ratio,
        "pool_ratio": pool_ratio,
        "pool_ratio_row": TRACKED_ROW,
        "untracked_pool_ratio": by_name["BufferPool ring"]["ratio"],
        "hook_us_per_saved_tensor": {
            "not_ring_storage": by_name[HOOK_ROWS[0]]["us_per_pair"],
            "ring_storage": by_name[HOOK_ROWS[1]]["us_per_pair"],
            "identity_hooks": by_name[HOOK_ROWS[2]]["us_per_pair"],
        },
        "target_ratio": TARGET_RATIO,
        "meets_target": pool_ratio <= TARGET_RATIO,
        "env": _env(device),
    }


def _resolve_device(name: str | None) -> torch.device:
    """``cuda``, ``cuda:N`` or ``cpu`` (default: CUDA when available); ValueError names the choices."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        raise ValueError(f"device {name!r}: {e}; use cuda, cuda:N or cpu") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {name!r}: use cuda, cuda:N or cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {name!r}: no CUDA device is visible here (use --device cpu)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= count:
            raise ValueError(f"device {name!r}: only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})")
    return device


def _baseline_loop(shape, dtype, device, consumer) -> Callable[[int], None]:
    empty = torch.empty

    def loop(n: int) -> None:
        for _ in range(n):
            t = empty(shape, dtype=dtype, device=device)
            if consumer is not None:
                t.record_stream(consumer)
            del t

    return loop


def _ring_loop(ring: BufferRing, shape, producer, consumer) -> Callable[[int], None]:
    acquire, release = ring.acquire, ring.release

    def loop(n: int) -> None:
        for _ in range(n):
            release(acquire(shape, producer), consumer)

    return loop


def _pool_loop(pool: BufferPool, name: str, shape, producer, consumer) -> Callable[[int], None]:
    acquire, release = pool.acquire, pool.release

    def loop(n: int) -> None:
        for _ in range(n):
            release(name, acquire(name, shape, producer), consumer)

    return loop


def _tracked_loop(pool: BufferPool, name: str, shape, producer, consumer) -> Callable[[int], None]:
    acquire, release = pool.acquire, pool.release_when_unsaved

    def loop(n: int) -> None:
        with pool.track_saved(strict=False):
            for _ in range(n):
                release(name, acquire(name, shape, producer), consumer)

    return loop


def _hook_loops(pool: BufferPool, device: torch.device) -> dict[str, Callable[[int], None]]:
    """Forwards ``x * w`` (2 saved tensors) with and without ``track_saved``, plain and ring-storage x."""
    pool.register("hook_probe", policy="ring", num_slots=1, max_shape=(16,), dtype=torch.float32)
    w = torch.ones(16, device=device, requires_grad=True)
    plain = torch.ones(16, device=device, requires_grad=True)
    slot = pool.acquire("hook_probe")
    ring_x = slot.requires_grad_()  # ring storage that autograd saves

    def identity() -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    def forwards(x: torch.Tensor, tracked: bool, hooks: Callable[[], Any] | None = None) -> Callable[[int], None]:
        def loop(n: int) -> None:
            with (hooks or (lambda: pool.track_saved(strict=False)))() if tracked else _null():
                for _ in range(n):
                    y = x * w  # saves x and w; y (and its saved holders) freed at the next iteration
            del y

        return loop

    return {
        HOOK_ROWS[0]: forwards(plain, True),
        "_bare_saves": forwards(plain, False),
        HOOK_ROWS[1]: forwards(ring_x, True),
        "_bare_saves_ring": forwards(ring_x, False),
        HOOK_ROWS[2]: forwards(plain, True, identity),
        "_bare_saves_identity": forwards(plain, False),
    }


def _current_stream_loop(device: torch.device) -> Callable[[int], None]:
    def loop(n: int) -> None:
        for _ in range(n):
            torch.cuda.current_stream(device)

    return loop


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _env(device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "hostname": platform.node(),
        "cpu": platform.processor() or platform.machine(),
    }


# --- external-event probe ----------------------------------------------------------------------------

PROBE_VARIANTS = (
    "capture-waits-pre-capture-event[plain]",
    "capture-waits-pre-capture-event[external]",
    "eager-waits-capture-recorded-event[plain]",
    "eager-waits-capture-recorded-event[external]",
    "bufreuse-fence-after-replay",
)
"""Each names who waits on which event across the eager <-> graph boundary (see docs/pool.md)."""


def probe_external_events(*, timeout_s: float = 20.0, progress: Progress | None = None) -> dict[str, dict[str, Any]]:
    """Run every variant in its own subprocess; status ``ok``, ``wrong-result``, ``error`` or ``timeout``."""
    results: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(PROBE_VARIANTS):
        code = f"from bufreuse.bench.pool_bench import _probe_variant; _probe_variant({name!r})"
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            results[name] = {"status": "timeout", "detail": f"no result within {timeout_s:g} s (hang)"}
        else:
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if lines:
                results[name] = json.loads(lines[-1])
            else:
                tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
                results[name] = {"status": "error", "detail": f"exit {proc.returncode}: {tail[-400:]}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        if progress is not None:
            progress(i + 1, len(PROBE_VARIANTS))
    return results


def _probe_variant(name: str) -> None:
    """Run one probe variant on the current CUDA device and print one JSON line."""
    try:
        status, detail = _PROBES[name]()
    except Exception as e:  # the probe reports failures; it must not raise
        status, detail = "error", f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
    print(json.dumps({"status": status, "detail": detail}), flush=True)


def _probe_setup():
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = torch.zeros(1 << 20, device=dev)
    out = torch.zeros(1 << 20, device=dev)
    side, cap = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    return buf, out, side, cap


_SLEEP_100MS = 200_000_000


def _check(out: torch.Tensor, value: float, what: str) -> tuple[str, str]:
    torch.cuda.synchronize()
    if bool((out == value).all()):
        return "ok", what
    return "wrong-result", f"{what}, but the reader saw {out[0].item()} instead of {value}: the wait was not honoured"


def _capture_waits_pre_capture(external: bool) -> tuple[str, str]:
    buf, out, side, cap = _probe_setup()
    ev = torch.cuda.Event(external=external)
    with torch.cuda.stream(side):
        buf.fill_(5.0)
        ev.record(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=cap):
        cap.wait_event(ev)
        out.copy_(buf)
    out.zero_()
    with torch.cuda.stream(side):  # eager record after capture: does the captured wait honour it?
        torch.cuda._sleep(_SLEEP_100MS)
        buf.fill_(7.0)
        ev.record(side)
    graph.replay()
    return _check(out, 7.0, "capture succeeded and a replay waited on a later eager record")


def _eager_waits_capture_recorded(external: bool) -> tuple[str, str]:
    buf, out, side, cap = _probe_setup()
    ev = torch.cuda.Event(external=external)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=cap):
        torch.cuda._sleep(_SLEEP_100MS)
        buf.fill_(3.0)
        ev.record(cap)
    buf.zero_()
    torch.cuda.synchronize()
    graph.replay()
    side.wait_event(ev)
    with torch.cuda.stream(side):
        out.copy_(buf)
    return _check(out, 3.0, "an eager stream waited on an event recorded inside the replayed graph")


def _fence_after_replay() -> tuple[str, str]:
    buf, out, side, cap = _probe_setup()
    pool = BufferPool(buf.device)
    pool.register("probe", policy="ring", num_slots=1, max_shape=(1 << 20,), dtype=torch.float32)
    graph = torch.cuda.CUDAGraph()
    with pool.graph_capture(cap), torch.cuda.graph(graph, stream=cap):
        t = pool.acquire("probe", None, cap)
        torch.cuda._sleep(_SLEEP_100MS)
        t.fill_(3.0)
        pool.release("probe", t, cap)
    graph.replay()
    pool.after_replay(torch.cuda.current_stream())
    t = pool.acquire("probe", None, side)  # waits on the eager fence recorded after the replay
    with torch.cuda.stream(side):
        out.copy_(t)
    pool.release("probe", t, side)
    return _check(out, 3.0, "eager producer after replay ordered by the pool's fence (stream order)")


_PROBES: dict[str, Callable[[], tuple[str, str]]] = {
    "capture-waits-pre-capture-event[plain]": lambda: _capture_waits_pre_capture(False),
    "capture-waits-pre-capture-event[external]": lambda: _capture_waits_pre_capture(True),
    "eager-waits-capture-recorded-event[plain]": lambda: _eager_waits_capture_recorded(False),
    "eager-waits-capture-recorded-event[external]": lambda: _eager_waits_capture_recorded(True),
    "bufreuse-fence-after-replay": _fence_after_replay,
}
