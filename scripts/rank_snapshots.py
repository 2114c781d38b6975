"""Run a module as ``python -m`` would, with this process's CUDA allocator history on; dump this rank's snapshot.

Megatron-LM 0.19's ``--record-memory-history --memory-snapshot-path PATH`` starts the history on every rank
(``training/utils/utils.py:start_memory_history_recording``, 100,000 entries, only on the config-container path)
but only the last rank writes a snapshot, to PATH itself, at every log interval (``training/training.py``
``training_log``: ``is_last_rank()``). At EP = 2 every rank's snapshot is wanted, so this launcher records and
dumps per rank instead (run without Megatron's flag, which would re-arm the history at its own size):

    python3 scripts/rank_snapshots.py --out DIR [--max-entries N] -m MODULE [ARGS...]

It writes DIR/rank<RANK>.pickle (RANK from torchrun's environment, 0 without one) when MODULE returns or exits,
and prints one line with this rank's max allocated / max reserved (Megatron prints memory for data-parallel
rank 0 only). Without CUDA it runs MODULE and says that nothing was recorded.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path


def parse(argv: list[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """Our options before ``-m MODULE``; the module's arguments after it, untouched."""
    if "-m" not in argv:
        raise SystemExit("rank_snapshots: usage: rank_snapshots.py --out DIR [--max-entries N] -m MODULE [ARGS...]")
    i = argv.index("-m")
    if i + 1 >= len(argv):
        raise SystemExit("rank_snapshots: -m needs a module name")
    p = argparse.ArgumentParser(prog="rank_snapshots.py")
    p.add_argument("--out", type=Path, required=True, help="folder for rank<RANK>.pickle")
    p.add_argument("--max-entries", type=int, default=1_000_000, help="allocator trace entries kept (the newest)")
    ns = p.parse_args(argv[:i])
    if ns.max_entries < 1:
        p.error("--max-entries must be >= 1")
    return ns, argv[i + 1], argv[i + 2 :]


def main(argv: list[str] | None = None) -> int:
    ns, module, rest = parse(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    import torch

    cuda = torch.cuda.is_available()
    if cuda:  # before the model exists, so every allocation of the run is in the trace
        torch.cuda.memory._record_memory_history(max_entries=ns.max_entries, stacks="python")
    else:
        print(f"[rank_snapshots] rank {rank}: no CUDA, no allocator history recorded", flush=True)
    sys.argv = [module, *rest]
    sys.path[0] = os.getcwd()  # as `python -m` has it: this script's folder must not shadow the module's imports
    try:  # a SystemExit (Megatron's, the entry's exit code) passes through after the dump
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        if cuda:
            ns.out.mkdir(parents=True, exist_ok=True)
            path = ns.out / f"rank{rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(None)
            alloc, res = torch.cuda.max_memory_allocated() / 2**20, torch.cuda.max_memory_reserved() / 2**20
            print(f"[rank_snapshots] rank {rank}: max allocated {alloc:.1f} MiB, max reserved {res:.1f} MiB; "
                  f"snapshot {path}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
