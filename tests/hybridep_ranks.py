"""One rank of a real DeepEP HybridEP run on the one GPU, for ``tests/test_hybridep_output_token_gpu.py``.

``python tests/hybridep_ranks.py RANK WORLD PORT OUT_JSON``: each rank sets device 0, joins a gloo group
(several processes share the GPU; HybridEP exchanges its buffers by CUDA IPC, ``USE_MNNVL=0``), builds
``HybridEPBuffer`` with megatron-core's keywords and checks, on its own tokens:

- ``dispatch_with_permute(output_token=slot)`` writes into ``slot`` (same storage) exactly the rows a plain
  dispatch returns, over every row inside the padded splits, even when ``slot`` held NaN (a reused ring
  slot holds the previous microbatch's data): no stale row survives, padding rows are zero;
- ``combine_with_unpermute`` of both gives the same tokens back (the combine of the slot reads it as-is);
- a slot of the wrong shape or dtype is refused by the patched kernel wrapper with a one-line error.

It writes what it saw to OUT_JSON before anything can fail, so a crash still leaves facts.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybridep_compare import make_inputs

HIDDEN, EXPERTS, TOPK, TOKENS, PAD = 512, 4, 2, 256, 16


def _budget(world: int) -> int:
    """A static budget every rank's padded dispatch fits (the flex dispatcher's rank-capacity bound)."""
    b = TOKENS * world * TOPK
    return b + (-b % PAD)


def run(rank: int, world: int, port: int) -> dict:
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from deep_ep import HybridEPBuffer

    facts: dict = {"rank": rank, "world": world, "device": torch.cuda.get_device_name()}
    local = EXPERTS // world
    buf = HybridEPBuffer(
        group=dist.group.WORLD, hidden_dim=HIDDEN, max_num_of_tokens_per_rank=TOKENS, num_local_experts=local,
        use_fp8=False, num_sms_preprocessing_api=108,
    )  # fmt: skip
    x, rm, probs = make_inputs(TOKENS, HIDDEN, EXPERTS, TOPK, seed=17 + rank, device="cuda")
    budget = _budget(world)
    kw = dict(
        routing_map=rm, probs=probs, scaling_factor=None, num_of_experts_per_rank=local, pad_multiple=PAD,
        num_permuted_tokens=budget, non_blocking=True,
    )  # fmt: skip  # megatron's HybridEPDispatch.forward keywords on the static-budget path
    ref = buf.dispatch_with_permute(hidden=x, **kw)
    slot = torch.full((budget, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = buf.dispatch_with_permute(hidden=x, output_token=slot, **kw)
    torch.cuda.synchronize()
    rows = int(got[3].sum())  # padded tokens per local expert: the rows the kernels write
    facts["same_storage"] = got[0].data_ptr() == slot.data_ptr()
    facts["rows_written"], facts["budget"] = rows, budget
    facts["rows_equal"] = bool(torch.equal(got[0][:rows], ref[0][:rows]))
    facts["nan_rows_inside_splits"] = int(torch.isnan(got[0][:rows].float()).any(1).sum())
    facts["probs_equal"] = bool(torch.equal(got[1][:rows], ref[1][:rows]))
    y_ref = buf.combine_with_unpermute(hidden=(ref[0] * 2).contiguous(), handle=ref[4], pad_multiple=PAD)
    y_got = buf.combine_with_unpermute(hidden=got[0].mul_(2), handle=got[4], pad_multiple=PAD)
    torch.cuda.synchronize()
    facts["combine_equal"] = bool(torch.equal(y_ref[0], y_got[0]))
    facts["combine_nonzero"] = bool(y_got[0].abs().sum() > 0)  # positive control: combine really returned tokens
    refusals = {}
    for name, bad in (
        ("shape", torch.empty((budget - PAD, HIDDEN), dtype=torch.bfloat16, device="cuda")),
        ("dtype", torch.empty((budget, HIDDEN), dtype=torch.float32, device="cuda")),
    ):
        try:
            buf.dispatch_with_permute(hidden=x, output_token=bad, **kw)
            refusals[name] = "accepted"
        except RuntimeError as e:
            refusals[name] = str(e).strip().splitlines()[0][:300]
    facts["refusals"] = refusals
    dist.barrier()
    return facts


def main(argv: list[str]) -> int:
    rank, world, port, out = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    facts: dict = {"rank": rank, "world": world, "env": {k: os.environ.get(k, "") for k in ("USE_MNNVL", "LD_PRELOAD")}}
    try:
        facts.update(run(rank, world, port))
        rc = 0
    except Exception as e:  # recorded: a crash in the kernels is data too
        facts["error"] = f"{type(e).__name__}: {e}"[:2000]
        facts["traceback"] = traceback.format_exc()[-4000:]
        rc = 1
    out.write_text(json.dumps(facts, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
