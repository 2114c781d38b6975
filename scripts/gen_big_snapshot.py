"""Write a synthetic allocator snapshot with N trace events (default 1,000,000) for the benchmark.

Shape (what the performance target in issue 4 specifies): every trace entry has its own freshly
built frame list of ~12 frames (the frame dicts come from a shared pool, as torch's frame cache
makes them), two streams, allocation sizes log-uniform from 512 B to 64 MiB, and at least 10% of
frees pass through the pending-free state (``free_requested`` some events before
``free_completed``, as ``record_stream`` does). Segment events keep reserved memory consistent,
and the final ``segments`` match the trace end, including 4 GiB allocated before the trace began.

Usage: ``python scripts/gen_big_snapshot.py OUT.pickle [--events N] [--seed S] [--gzip]``
(1,000,000 events: ~180 MB, ~40 s on a 2-core machine).
"""

from __future__ import annotations

import argparse
import gzip
import math
import pickle
import random
from pathlib import Path

MiB = 1 << 20
SEG = 2 * MiB
STREAMS = (0, 0x5A3F10)
WEIGHTS = 4096 * MiB

_INTERNAL = [
    "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py",
    "/usr/lib/python3.11/site-packages/torch/autograd/function.py",
    "/usr/lib/python3.11/site-packages/torch/_tensor.py",
    "/usr/lib/python3.11/contextlib.py",
    "<frozen runpy>",
]
_USER = [
    ("megatron/core/transformer/moe/token_dispatcher.py", ("dispatch", "token_permutation", "_pre_dispatch")),
    ("megatron/core/transformer/moe/fused_a2a.py", ("forward", "hybrid_ep_dispatch")),
    ("megatron/core/transformer/moe/experts.py", ("forward", "expert_fc2", "_apply_fc1")),
    ("megatron/core/transformer/attention.py", ("forward", "_core_attention")),
    ("megatron/core/transformer/transformer_layer.py", ("forward", "_forward_mlp")),
    ("megatron/training/training.py", ("train_step", "forward_backward_func")),
    ("pretrain_gpt.py", ("forward_step", "main")),
]


def _frame_pool(rng: random.Random, n: int) -> tuple[list[dict], list[dict]]:
    internal = [
        {"filename": rng.choice(_INTERNAL), "line": rng.randrange(1, 3000), "name": f"_call_impl_{i % 40}"}
        for i in range(n // 3)
    ]
    user = []
    for _ in range(n - n // 3):
        fname, names = rng.choice(_USER)
        user.append({"filename": "/workspace/" + fname, "line": rng.randrange(1, 2000), "name": rng.choice(names)})
    return internal, user


def _seg_size(size: int) -> int:
    """Segments come in power-of-two sizes from 2 MiB, so freed ones are reused as torch's cache does."""
    return max(SEG, 1 << (size - 1).bit_length())


def _size(rng: random.Random) -> int:
    return int(2 ** rng.uniform(math.log2(512), math.log2(64 * MiB))) // 512 * 512


def generate(n_events: int, seed: int = 0) -> dict:
    """Return the snapshot dict (plain data, as torch writes it)."""
    rng = random.Random(seed)
    internal, user = _frame_pool(rng, 3000)
    trace: list[dict] = []
    live: dict[int, tuple[int, int]] = {}  # addr -> (size, stream), allocated
    pending: dict[int, tuple[int, int]] = {}  # addr -> (size, stream), free requested
    cached: dict[tuple[int, int], list[int]] = {}  # (segment size, stream) -> addrs of empty segments
    next_addr = 0x7F0000000000
    t = 1_700_000_000_000_000

    def _release(addr: int, size: int, stream: int) -> None:
        """The block's segment goes back to the cache; now and then the cache is trimmed (empty_cache)."""
        seg = _seg_size(size)
        if rng.random() < 0.002:
            emit("segment_free", addr, seg, stream)
        else:
            cached.setdefault((seg, stream), []).append(addr)

    def emit(action: str, addr: int, size: int, stream: int) -> None:
        nonlocal t
        t += rng.randrange(1, 50)
        k = rng.randrange(3, 7)
        frames = [rng.choice(internal) for _ in range(k)] + [rng.choice(user) for _ in range(12 - k)]
        trace.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": stream,
                "time_us": t,
                "compile_context": "N/A",
                "user_metadata": "",
                "frames": frames,
            }
        )

    while len(trace) < n_events:
        r = rng.random()
        if pending and (r < 0.12 or len(pending) > 64):
            addr = rng.choice(list(pending)) if len(pending) < 8 else next(iter(pending))
            size, stream = pending.pop(addr)
            emit("free_completed", addr, size, stream)
            _release(addr, size, stream)
        elif live and (r < 0.55 or len(live) > 400):
            addr = rng.choice(list(live)) if len(live) < 16 else next(iter(live))
            size, stream = live.pop(addr)
            emit("free_requested", addr, size, stream)
            if rng.random() < 0.25:  # record_stream: completes later
                pending[addr] = (size, stream)
            else:
                emit("free_completed", addr, size, stream)
                _release(addr, size, stream)
        else:
            size, stream = _size(rng), rng.choice(STREAMS)
            seg = _seg_size(size)
            free_list = cached.setdefault((seg, stream), [])
            if free_list:
                addr = free_list.pop()
            else:
                addr = next_addr
                next_addr += seg
                emit("segment_alloc", addr, seg, stream)
            live[addr] = (size, stream)
            emit("alloc", addr, size, stream)
    del trace[n_events:]
    return {"segments": _final_segments(trace), "device_traces": [trace]}


def _final_segments(trace: list[dict]) -> list[dict]:
    """Segments at dump time, replaying the (possibly cut) trace: one block per segment."""
    segs: dict[int, dict] = {}
    for e in trace:
        a, act = e["addr"], e["action"]
        if act == "segment_alloc":
            segs[a] = {"size": e["size"], "stream": e["stream"], "state": "inactive", "req": 0}
        elif act == "segment_free":
            segs.pop(a, None)
        elif act in ("alloc", "free_requested", "free_completed") and a in segs:
            state = {"alloc": "active_allocated", "free_requested": "active_pending_free"}.get(act, "inactive")
            segs[a]["state"], segs[a]["req"] = state, e["size"]
    out = [_segment(0x10000000, WEIGHTS, 0, "active_allocated", WEIGHTS)]
    for a, s in segs.items():
        out.append(_segment(a, s["size"], s["stream"], s["state"], s["req"]))
    return out


def _segment(addr: int, total: int, stream: int, state: str, req: int) -> dict:
    active = state != "inactive"
    blocks = [{"address": addr, "size": total, "requested_size": req if active else 0, "state": state, "frames": []}]
    return {
        "device": 0,
        "address": addr,
        "total_size": total,
        "allocated_size": total if state == "active_allocated" else 0,
        "active_size": total if active else 0,
        "requested_size": req if active else 0,
        "stream": stream,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gzip", action="store_true", help="gzip the output (level 6)")
    args = p.parse_args()
    data = pickle.dumps(generate(args.events, args.seed), protocol=pickle.DEFAULT_PROTOCOL)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(gzip.compress(data, 6) if args.gzip else data)
    print(f"{args.out}: {args.events} events, {args.out.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
