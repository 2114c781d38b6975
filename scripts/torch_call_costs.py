"""Warm host cost of each torch call the hot path makes, on a CUDA machine (ns per call, median of 7 batches).

The hooks' per-layer-call figure (`bufreuse bench layer`) is measured cold, between TE's and megatron's work;
this is the floor under it: each call in a tight loop, caches warm. `torch.empty` and `record_stream` are what
the control does instead of a ring (TE's allocation of the FC2 output; EP > 1 paths' cross-stream marks).

    python3 scripts/torch_call_costs.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch


def main(out: str) -> None:
    dev = torch.device("cuda")
    base = torch.empty(4096, 1024, device=dev, dtype=torch.bfloat16)
    stream, other = torch.cuda.current_stream(), torch.cuda.Stream()
    event = torch.cuda.Event()
    raw, capturing = torch._C._cuda_getCurrentRawStream, torch._C._cuda_isCurrentStreamCapturing
    record, wait = torch._C._CudaEventBase.record, torch._C._CudaEventBase.wait
    index, rows = torch.cuda.current_device(), slice(None, 2000)
    push = torch._C._autograd._push_saved_tensors_default_hooks
    pop = torch._C._autograd._pop_saved_tensors_default_hooks
    calls = {
        "raw_stream": lambda: raw(index),
        "capturing": lambda: capturing(),
        "slice[:rows]": lambda: base[rows],
        "narrow": lambda: base.narrow(0, 0, 2000),
        "detach": lambda: base.detach(),
        "data_ptr": lambda: base.data_ptr(),
        "len(tensor)": lambda: len(base),
        "tensor.shape[0]": lambda: base.shape[0],
        "as_strided": lambda: base.as_strided((2000, 1024), (1024, 1)),
        "event.record(stream)": lambda: record(event, stream),
        "event.wait(stream)": lambda: wait(event, stream),
        "torch.empty(2000x1024 bf16)": lambda: torch.empty((2000, 1024), device=dev, dtype=torch.bfloat16),
        "record_stream": lambda: base.record_stream(other),
        "noop lambda": lambda: None,
        "push/pop saved hooks": lambda: (push(id, id), pop()),
    }
    result = {}
    for name, call in calls.items():
        for _ in range(2000):
            call()
        batches = []
        for _ in range(7):
            t = time.perf_counter_ns()
            for _ in range(5000):
                call()
            batches.append((time.perf_counter_ns() - t) / 5000)
        result[name] = round(statistics.median(batches), 1)
        torch.cuda.synchronize()
    for name, ns in result.items():
        print(f"{name:32s} {ns:8.1f} ns")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("torch_call_costs: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1])
