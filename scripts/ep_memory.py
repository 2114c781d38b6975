"""Memory at EP >= 2: one arm of a real megatron-core ``MoELayer`` per launch, per-rank allocator snapshots.

Run under torchrun, one process per EP rank (on the one H200 every rank shares GPU 0 over gloo)::

    torchrun --standalone --nproc-per-node 2 scripts/ep_memory.py --out DIR --arm control
    torchrun --standalone --nproc-per-node 2 scripts/ep_memory.py --out DIR --arm rings [--keep-unused]
    python scripts/ep_memory.py --summarize DIR          # no torchrun: the table, and outputs checked across arms

The layer: megatron-core's ``MoELayer`` with the all-to-all dispatcher (local spec, ``--spec te`` for TE's grouped
experts), dropless unless ``--pad`` (capacity factor 1.0, padded). The arm is installed as production installs it
(``install()`` with no validation aid, the slot size from the project's bound at the real token count, ``--slots``
slots); ``--keep-unused`` sets ``moe_bufreuse_keep_unused_rings``, the one validation knob, to keep rings the
EP >= 2 stream rule leaves unused (so what they cost can be measured). The schedule F0 F1 B0 F2 B1 F3 B2 B3 runs
``--steps`` times with ``torch.cuda.memory._record_memory_history()`` on; each rank writes to ``DIR/<arm>/``:
``rank<r>.pickle`` (torch's own snapshot format, CUDA only) and ``rank<r>.json`` (max reserved / allocated, step
times, which rings ``install()`` used and why not, and a float64 digest of every output and input gradient).

On CPU (gloo, no GPU) it runs the same layer with three CPU shims, each standing in for a megatron-core 0.19.2 line
that assumes CUDA: ``tensor_parallel/mappings.py`` allocates the uneven all-to-all's output on
``torch.cuda.current_device()``; ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` (dropless) copies
the token counts to the host on a CUDA side stream; ``TopKRouter.gating`` moves the router's weight to
``torch.cuda.current_device()`` (so on CPU the layer runs ``MoELayer.forward``'s stages in its order, with the
router's own ``routing`` over CPU logits). No snapshot there; the digests are still compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ARMS = ("control", "rings", "stream-ordered")
ORDER = ("F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3")
"""The schedule: two forwards in flight, as 1F1B's steady state on one pipeline rank."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output folder (DIR/<arm>/rank<r>.*)")
    p.add_argument("--arm", choices=ARMS, default="control")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--spec", choices=("local", "te"), default="local")
    p.add_argument("--pad", action="store_true", help="capacity factor 1.0, padded (default: dropless)")
    p.add_argument("--keep-unused", action="store_true", help="moe_bufreuse_keep_unused_rings (validation knob)")
    p.add_argument("--slots", type=int, default=2, help="ring slots (the schedule's minimum is 2)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per microbatch")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--steps", type=int, default=3, help="schedule repeats (the first is warm-up for the times)")
    p.add_argument("--summarize", type=Path, metavar="DIR", help="print the table for DIR and check the digests")
    p.add_argument("--combine", type=Path, metavar="JSONL",
                   help="combine `bufreuse snapshot-report --json` lines over the ranks of each arm")  # fmt: skip
    args = p.parse_args(argv)
    if args.summarize is None and args.combine is None and args.out is None:
        p.error("--out is required (or --summarize DIR, --combine JSONL)")
    if args.steps < 2 or args.slots < 1 or min(args.hidden, args.ffn, args.tokens, args.experts, args.topk) < 1:
        p.error("--steps >= 2, --slots >= 1 and positive sizes")
    return args


# -- CPU shims (megatron-core 0.19.2 lines that assume CUDA; module docstring) ---------------------------------


def apply_cpu_shims() -> None:
    """The EP harness's shims (``tests/ep_harness.py``: each names the megatron-core line it stands in for): the
    dry run on CPU takes them from the tests, where every CPU shim lives, rather than a copy."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ep_harness import apply_shims

    apply_shims("cpu")


# -- one arm ----------------------------------------------------------------------------------------------------


def build_layer(args: argparse.Namespace, ep: int, device: str) -> Any:
    import torch
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=8,
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_router_pre_softmax=args.topk == 1,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep,
        use_cpu_initialization=True,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        moe_expert_capacity_factor=1.0 if args.pad else None,
        moe_pad_expert_input_to_capacity=args.pad,
        moe_grouped_gemm=args.spec == "te",
    )
    if args.spec == "te":
        spec = specs.get_gpt_layer_with_transformer_engine_spec(num_experts=args.experts, moe_grouped_gemm=True)
    else:
        spec = specs.get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    layer = spec.submodules.mlp(config=cfg).to(dtype)
    return layer.cuda() if device == "cuda" else layer


def _forward(layer: Any, device: str) -> Any:
    """``MoELayer.forward`` on CUDA; on CPU its stages in its order (the router shim of the module docstring)."""
    if device == "cuda":
        return lambda x: layer(x)[0]
    import torch

    def cpu_forward(x: Any) -> Any:
        logits = torch.nn.functional.linear(x.view(-1, x.shape[-1]), layer.router.weight)
        probs, routing_map = layer.router.routing(logits)
        h, p = layer.preprocess(x, probs, routing_map)
        d, p = layer.dispatch(h, p)
        out, _ = layer.routed_experts_compute(d, p)
        return layer.postprocess(layer.combine(out), None)

    return cpu_forward


def knobs_for(args: argparse.Namespace) -> Any:
    from bufreuse.config import BufReuseConfig

    if args.arm == "control":
        return None
    policy = "ring" if args.arm == "rings" else "stream-ordered"
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=args.slots,
        moe_hybridep_num_expert_output_buffers=args.slots,
        moe_bufreuse_dispatch_policy=policy,
        moe_bufreuse_expert_policy=policy,
        moe_bufreuse_keep_unused_rings=args.keep_unused,
    )


def run_arm(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        # gloo: every rank shares GPU 0 (one H200); NCCL needs one GPU per rank
        torch.cuda.set_device(0 if args.backend == "gloo" else int(os.environ.get("LOCAL_RANK", "0")))
    elif args.backend == "nccl":
        print("ep_memory: --backend nccl needs CUDA", file=sys.stderr)
        return 2
    dist.init_process_group(args.backend)
    from megatron.core import parallel_state as ps

    if device == "cpu":
        apply_cpu_shims()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    layer = build_layer(args, world, device)
    knobs = knobs_for(args)
    out_dir = args.out / (args.arm + ("-kept" if args.keep_unused and knobs is not None else ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    if device == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    inst = pool = None
    summary: dict[str, Any] = {"arm": out_dir.name, "rank": rank, "ep": world, "device": device,
                               "backend": args.backend, "spec": args.spec, "routing": "pad" if args.pad else "dropless",
                               "tokens": args.tokens, "hidden": args.hidden, "slots": args.slots}  # fmt: skip
    if knobs is not None:
        from bufreuse.config import static_bounds
        from bufreuse.integrations.megatron import install
        from bufreuse.pool import BufferPool

        pool = BufferPool(device)
        inst = install(layer, pool, knobs, tokens=args.tokens)
        summary["unused"] = dict(inst.unused)
        summary["rings"] = sorted(pool.names())
        summary["bounds"] = {b: {"rows": bd.rows, "slot_bytes": bd.slot_bytes, "slots": bd.slots, "source": bd.source}
                             for b, bd in static_bounds(layer.config, knobs, path="alltoall",
                                                        tokens=args.tokens).items()}  # fmt: skip
    dtype = next(layer.parameters()).dtype
    forward = _forward(layer, device)
    gens = [torch.Generator().manual_seed(1000 * (rank + 1) + i) for i in range(4)]
    xs = [torch.randn(args.tokens, 1, args.hidden, generator=g).to(device=device, dtype=dtype) for g in gens]
    digest: list[float] = []
    times = []
    for step in range(args.steps):
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        live: dict[int, tuple[Any, Any]] = {}
        for op in ORDER:
            i = int(op[1])
            if op[0] == "F":
                x = xs[i].detach().requires_grad_(True)
                y = forward(x)
                live[i] = (x, y)
            else:
                x, y = live.pop(i)
                y.backward(torch.ones_like(y))
                if step == args.steps - 1:
                    digest += [float(y.double().sum()), float(x.grad.double().sum())]
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
    summary["step_s"] = [round(t, 6) for t in times]
    summary["digest"] = digest
    if pool is not None:
        summary["ring_stats"] = {n: _stats(s) for n, s in pool.stats().items()}
        summary["ring_bytes"] = int(sum(pool.ring_bytes().values()))  # after use: slots are made on first acquire
    if device == "cuda":
        summary["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        summary["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.memory._dump_snapshot(str(out_dir / f"rank{rank}.pickle"))
        torch.cuda.memory._record_memory_history(None)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    if inst is not None:
        inst.uninstall()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def _stats(s: Any) -> dict[str, Any]:
    fields = ("acquisitions", "releases", "deferred_releases", "gpu_waits", "peak_held", "persistent_bytes")
    return {f: getattr(s, f) for f in fields if hasattr(s, f)}


# -- summary (no torch) -----------------------------------------------------------------------------------------


def summarize(root: Path) -> int:
    """One line per arm and rank; exit 1 if an arm's outputs or input gradients differ from the control's."""
    rows = {}
    for f in sorted(root.glob("*/rank*.json")):
        d = json.loads(f.read_text())
        rows[(d["arm"], d["rank"])] = d
    if not rows:
        print(f"ep_memory: no rank*.json under {root}", file=sys.stderr)
        return 2
    bad = []
    print(f"{'arm':<22}{'rank':>5}{'max reserved':>14}{'max alloc':>12}{'ring MiB':>10}{'step ms':>9}  rings / unused")
    for (arm, rank), d in sorted(rows.items()):
        step = sorted(d["step_s"][1:])[len(d["step_s"][1:]) // 2] * 1e3
        used = ",".join(d.get("rings", [])) or "-"
        unused = "; ".join(f"{b}: {w}" for b, w in d.get("unused", {}).items())
        ring = f"{d['ring_bytes'] / 2**20:,.1f}" if "ring_bytes" in d else "-"
        print(f"{arm:<22}{rank:>5}{_mib(d, 'max_reserved_bytes'):>14}{_mib(d, 'max_allocated_bytes'):>12}{ring:>10}"
              f"{step:>9.1f}  {used}{' | unused ' + unused if unused else ''}")  # fmt: skip
        ref = rows.get(("control", rank))
        if ref is not None and arm != "control" and d["digest"] != ref["digest"]:
            bad.append(f"{arm} rank {rank}: outputs/input grads differ from the control ({d['digest']} vs "
                       f"{ref['digest']})")  # fmt: skip
    for b in bad:
        print("DIFFERS: " + b)
    return 1 if bad else 0


def combine(jsonl: Path) -> int:
    """Per arm (the snapshot's folder), combined over its ranks' ``snapshot-report --json`` lines: each rank's max
    reserved and their sum (the ranks share one GPU), MoE and all pending-free at each rank's max active, and the
    largest pending-free anywhere in any rank's trace."""
    from bufreuse.analysis.snapshot.sites import RING_CATEGORIES  # torch-free: what a ring replaces

    arms: dict[str, list[dict]] = {}
    for line in jsonl.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            arms.setdefault(Path(d["file"]).parent.name, []).append(d)
    if not arms:
        print(f"ep_memory: no reports in {jsonl}", file=sys.stderr)
        return 2
    print(f"{'arm (combined over ranks)':<26}{'ranks':>6}{'max reserved, each':>22}{'sum':>8}"
          f"{'MoE pending@max active':>24}{'all pending@max active':>24}{'max pending':>13}")  # fmt: skip
    for arm, ds in sorted(arms.items()):
        ds.sort(key=lambda d: d["file"])
        each = "/".join(f"{d['max_reserved_bytes'] / 2**20:,.0f}" for d in ds)
        moe = sum(sum(v for k, v in d["pending_free_by_category_at_max_active"].items() if k in RING_CATEGORIES)
                  for d in ds)  # fmt: skip
        pend = sum(d["pending_free_at_max_active_bytes"] for d in ds)
        peak = max(d["max_pending_free_bytes"] for d in ds)
        total = sum(d["max_reserved_bytes"] for d in ds)
        print(f"{arm:<26}{len(ds):>6}{each:>22}{total / 2**20:>8,.0f}{moe / 2**20:>24,.1f}{pend / 2**20:>24,.1f}"
              f"{peak / 2**20:>13,.1f}")  # fmt: skip
    print("MiB; sum = what the ranks reserve together on the one GPU (their maxima need not coincide)")
    return 0


def _mib(d: dict, key: str) -> str:
    return f"{d[key] / 2**20:,.0f}" if key in d else "-"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.summarize is not None:
        return summarize(args.summarize)
    if args.combine is not None:
        return combine(args.combine)
    return run_arm(args)


if __name__ == "__main__":
    sys.exit(main())
