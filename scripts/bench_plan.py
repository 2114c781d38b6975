"""Time ``bufreuse plan`` on a large schedule: 64 stages, VPP 4, 512 microbatches (target: < 2 s on the CPU box).

Runs the command end to end in a fresh interpreter (import + file read + plan + render), and the library
call alone, and prints both. Usage: ``python scripts/bench_plan.py [--layers-per-chunk L] [--slots N]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = """\
num_layers: {num_layers}
hidden_size: 7168
num_moe_experts: 256
moe_router_topk: 8
moe_token_dispatcher_type: flex
moe_flex_dispatcher_backend: hybridep
expert_model_parallel_size: 64
moe_expert_rank_capacity_factor: 1.25
pipeline_model_parallel_size: 64
virtual_pipeline_model_parallel_size: 4
overlap_moe_expert_parallel_comm: true
bf16: true
seq_length: 4096
micro_batch_size: 1
num_microbatches: 512
moe_hybridep_reuse_dispatch_output_buffers: true
moe_hybridep_num_dispatch_output_buffers: {slots}
moe_hybridep_num_expert_output_buffers: {slots}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers-per-chunk", type=int, default=1)
    parser.add_argument("--slots", type=int, default=4, help="configured slots (below the minimum: hazards run too)")
    args = parser.parse_args()
    text = CONFIG.format(num_layers=64 * 4 * args.layers_per_chunk, slots=args.slots)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "big.yaml"
        cfg.write_text(text)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "bufreuse", "plan", str(cfg), "--json"], capture_output=True, text=True, check=False
        )
        cli_s = time.perf_counter() - t0
        from bufreuse.config import load_megatron_file
        from bufreuse.integrations.check_file import megatron_fields
        from bufreuse.plan import plan_config

        fields = megatron_fields(load_megatron_file(cfg))
        t0 = time.perf_counter()
        report = plan_config(fields)
        lib_s = time.perf_counter() - t0
    mins = {b.buffer: b.minimum for b in report.buffers}
    print(
        f"64 stages, VPP 4, 512 microbatches, {args.layers_per_chunk} MoE layer(s)/chunk, {args.slots} slots: "
        f"CLI {cli_s:.2f} s (exit {proc.returncode}), plan_config {lib_s:.2f} s, minimum {mins}"
    )


if __name__ == "__main__":
    main()
