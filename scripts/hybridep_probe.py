#!/usr/bin/env python3
"""Where DeepEP's ``HybridEPBuffer`` constructor dies at world size 1 (scripts/hybridep-device.sh ``probe``).

Builds the buffer in one child process per variant (the keywords megatron-core 0.19.2 passes, DeepEP's
defaults, and the environment switches its constructor reads: ``USE_MNNVL=0`` takes the cudaMalloc / CUDA IPC
path instead of fabric handles, ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=1`` skips the detected count, and
``use_shared_buffer=False``). Each child prints the stage it reaches, so a crash (the constructor's
segmentation fault at world size 1, docs/megatron.md) is located by the last stage and the exit signal. Writes
``$OUT/hybridep-probe.json`` and prints one line per variant; the first variant that builds with megatron's
keywords is written to ``$OUT/hybridep-probe.env`` (``KEY=VALUE`` lines the test can export).

Usage (on the device, after the build): ``python3 scripts/hybridep_probe.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import os, sys, json
def stage(s):
    print("STAGE " + s, flush=True)
stage("import torch")
import torch, torch.distributed as dist
stage("init_process_group nccl")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
group = dist.group.WORLD
stage("import deep_ep")
import hybrid_ep_cpp
from deep_ep import HybridEPBuffer
kw = json.loads(sys.argv[1])
stage("ExtendedMemoryAllocator")
alloc = hybrid_ep_cpp.ExtendedMemoryAllocator()
stage("detect_accessible_ranks")
print("detected ranks:", alloc.detect_accessible_ranks(group), flush=True)
del alloc
stage("HybridEPBuffer(" + ", ".join(f"{k}={v}" for k, v in kw.items()) + ")")
buf = HybridEPBuffer(group=group, hidden_dim=256, max_num_of_tokens_per_rank=256, num_local_experts=4, **kw)
torch.cuda.synchronize()
stage("built")
del buf
dist.destroy_process_group()
stage("done")
"""

MEGATRON_KW = {"use_fp8": False, "num_sms_preprocessing_api": 108}
VARIANTS = [
    ("megatron-keywords", {}, MEGATRON_KW),
    ("deepep-defaults", {}, {}),
    ("USE_MNNVL=0", {"USE_MNNVL": "0"}, MEGATRON_KW),
    ("ranks-per-domain=1", {"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "1"}, MEGATRON_KW),
    ("use_shared_buffer=False", {}, {**MEGATRON_KW, "use_shared_buffer": False}),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(name: str, env_extra: dict[str, str], kw: dict, timeout: int) -> dict:
    env = {**os.environ, **env_extra, "MASTER_PORT": str(_port()), "PYTHONUNBUFFERED": "1"}
    try:
        res = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(kw)], env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, stdout, stderr = res.returncode, res.stdout, res.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = (
            "timeout",
            (e.stdout or b"").decode(errors="replace"),
            (e.stderr or b"").decode(errors="replace"),
        )
    stages = [ln[6:] for ln in stdout.splitlines() if ln.startswith("STAGE ")]
    lines = stderr.splitlines()
    return {
        "variant": name,
        "env": env_extra,
        "keywords": kw,
        "exit": rc,
        "signal": -rc if isinstance(rc, int) and rc < 0 else None,
        "last_stage": stages[-1] if stages else None,
        "built": "built" in stages,
        "stdout_tail": stdout.splitlines()[-15:],
        "stderr_tail": [ln for ln in lines if not ln.startswith("/")][-25:],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=int, default=90)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, env_extra, kw in VARIANTS:
        r = run_variant(name, env_extra, kw, args.timeout)
        results.append(r)
        print(
            f"hybridep-probe: {name}: exit {r['exit']}, last stage {r['last_stage']!r}, built {r['built']}",
            flush=True,
        )
    (args.out / "hybridep-probe.json").write_text(json.dumps(results, indent=2))
    # Only a variant the test can reproduce: megatron's own keywords, with an environment switch at most.
    working = next((r for r in results if r["built"] and r["keywords"] == MEGATRON_KW), None)
    if working is not None:
        (args.out / "hybridep-probe.env").write_text("".join(f"{k}={v}\n" for k, v in working["env"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
