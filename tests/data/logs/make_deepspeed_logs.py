"""Write the synthetic Megatron-DeepSpeed logs of this folder (``python tests/data/logs/make_deepspeed_logs.py``).

Synthetic, in the shapes Megatron-DeepSpeed and the DeepSpeed launcher print (checked against public logs):
the launcher's ``Running on the following workers: host-a,host-b`` and ``cmd = pdsh ...`` lines, pdsh's
``host: `` prefix on every line a node prints, each node's ``launch.py`` ``WORLD INFO DICT``, DeepSpeed's
environment report (``torch version ....``, ``deepspeed info ....``, ``torch cuda version ....``), the
``using world size`` line, the ``arguments`` block, the engine's ``DeepSpeed info: version=...`` line, iteration
lines (``elapsed time per iteration (ms)``, ``samples per second``, ``TFLOPs``) and ``[Rank N] ... memory (MB)``.

- ``mds-cluster-a.log`` / ``mds-cluster-b.log``: one experiment on two clusters with two software stacks
  (host-a,host-b on torch 2.1.0a0+fe05266 / DeepSpeed 0.12.3 / CUDA 12.1; node-x,node-y on torch 2.3.1+cu121 /
  DeepSpeed 0.14.4 / CUDA 12.1); b runs about 10.5% faster.
- ``mds-span-short.log`` / ``mds-span-long.log``: one experiment, one cluster; the short run stops at iteration
  120, the long one runs to 2,130 and is about 5% faster over iterations 1-120 but slower from 500 on.

Step times are a fixed pattern (no random numbers), so the files are the same every time they are written.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
FLOP_PER_ITER_PER_GPU = 360.0e12  # TFLOPs = 360 / step seconds
WIGGLE = (0.0, 0.6, -0.4, 0.9, -0.8, 0.3, -0.2, 0.7, -0.6, 0.1)  # percent, one per window, repeating


def _prefix(host: str | None, text: str) -> str:
    return f"{host}: {text}" if host else text


def _log(
    *,
    hosts: list[str],
    torch: str,
    deepspeed: str,
    cuda: str,
    last: int,
    step_ms: callable,  # type: ignore[valid-type]
    stamp: str,
) -> str:
    a, b = hosts
    ts = f"[{stamp} 06:31:{{s:02d}},{{ms:03d}}]"
    out = [
        f"{ts.format(s=1, ms=192)} [INFO] [runner.py:415:main] Using IP address of 10.0.0.11 for node {a}",
        f"{ts.format(s=1, ms=192)} [INFO] [multinode_runner.py:65:get_cmd] Running on the following workers: {a},{b}",
        f"{ts.format(s=1, ms=193)} [INFO] [runner.py:504:main] cmd = pdsh -S -f 1024 -w {a},{b} export "
        "PYTHONPATH=/workspace/Megatron-DeepSpeed; cd /workspace/Megatron-DeepSpeed; python -u -m "
        "deepspeed.launcher.launch --world_info=eyJ9 --node_rank=%n --master_addr=10.0.0.11 --master_port=29500 "
        "pretrain_gpt.py --deepspeed",
    ]
    for host in hosts:
        out += [
            _prefix(
                host,
                f"{ts.format(s=2, ms=517)} [INFO] [launch.py:136:main] WORLD INFO DICT: "
                f"{{'{a}': [0, 1, 2, 3, 4, 5, 6, 7], '{b}': [0, 1, 2, 3, 4, 5, 6, 7]}}",
            ),
            _prefix(
                host,
                f"{ts.format(s=2, ms=517)} [INFO] [launch.py:142:main] nnodes=2, num_local_procs=8, "
                f"node_rank={hosts.index(host)}",
            ),
            _prefix(host, f"{ts.format(s=2, ms=518)} [INFO] [launch.py:156:main] dist_world_size=16"),
        ]
    out += [
        _prefix(a, line)
        for line in (
            "--------------------------------------------------",
            "DeepSpeed general environment info:",
            "torch install path ............... ['/usr/local/lib/python3.10/dist-packages/torch']",
            f"torch version .................... {torch}",
            "deepspeed install path ........... ['/usr/local/lib/python3.10/dist-packages/deepspeed']",
            f"deepspeed info ................... {deepspeed}, unknown, unknown",
            f"torch cuda version ............... {cuda}",
            "torch hip version ................ None",
            f"nvcc version ..................... {cuda}",
            f"deepspeed wheel compiled w. ...... torch {torch[:3]}, cuda {cuda}",
            "using world size: 16, data-parallel-size: 4, tensor-model-parallel size: 2, pipeline-model-parallel "
            "size: 2",
            "using torch.bfloat16 for parameters ...",
            "------------------------ arguments ------------------------",
            "  bf16 ............................................ True",
            "  data_parallel_size .............................. 4",
            "  deepspeed ....................................... True",
            "  fp16 ............................................ False",
            "  global_batch_size ............................... 256",
            "  log_interval .................................... 10",
            "  micro_batch_size ................................ 4",
            "  moe_expert_parallel_size ........................ 4",
            "  num_experts ..................................... [8]",
            "  pipeline_model_parallel_size .................... 2",
            "  recompute_granularity ........................... None",
            "  seq_length ...................................... 2048",
            "  tensor_model_parallel_size ...................... 2",
            "  topk ............................................ 2",
            f"  train_iters ..................................... {last}",
            "  world_size ...................................... 16",
            "-------------------- end of arguments ---------------------",
            "DeepSpeed is enabled.",
            f"{ts.format(s=14, ms=960)} [INFO] [logging.py:96:log_dist] [Rank 0] DeepSpeed info: "
            f"version={deepspeed}, git-hash=unknown, git-branch=unknown",
        )
    ]
    for it in range(10, last + 1, 10):
        ms = step_ms(it) * (1 + WIGGLE[(it // 10) % len(WIGGLE)] / 100)
        tflops = FLOP_PER_ITER_PER_GPU / 1e12 / (ms / 1000)
        out.append(
            _prefix(
                b,
                f" iteration {it:8d}/{last:8d} | consumed samples: {it * 256:12d} | consumed tokens: "
                f"{it * 256 * 2048:12d} | elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.500E-04 | "
                f"global batch size:   256 | lm loss: {7.5 - it / 1000:.6E} | loss scale: 1.0 | grad norm: 1.234 | "
                "num zeros: 0.0 | actual seqlen:  2048 | number of skipped iterations:   0 | "
                f"number of nan iterations:   0 | samples per second: {256 / (ms / 1000):.3f} | "
                f"TFLOPs: {tflops:.2f} |",
            )
        )
        if it == 10:
            for rank, host in ((0, a), (8, b), (15, b)):
                out.append(
                    _prefix(
                        host,
                        f"[Rank {rank}] (after 10 iterations) memory (MB) | allocated: 20480.50 | "
                        f"max allocated: {41210.25 + rank:.2f} | reserved: 46080.00 | max reserved: 46080.00",
                    )
                )
    for host in hosts:
        out.append(_prefix(host, f"{ts.format(s=59, ms=642)} [INFO] [launch.py:347:main] Process 576484 exits "
                                 "successfully."))  # fmt: skip
    return "\n".join(out) + "\n"


def write() -> list[Path]:
    files = {
        "mds-cluster-a.log": _log(hosts=["host-a", "host-b"], torch="2.1.0a0+fe05266", deepspeed="0.12.3",
                                  cuda="12.1", last=200, step_ms=lambda it: 2400.0, stamp="2024-03-02"),
        "mds-cluster-b.log": _log(hosts=["node-x", "node-y"], torch="2.3.1+cu121", deepspeed="0.14.4",
                                  cuda="12.1", last=200, step_ms=lambda it: 2400.0 / 1.105, stamp="2024-05-11"),
        "mds-span-short.log": _log(hosts=["host-a", "host-b"], torch="2.1.0a0+fe05266", deepspeed="0.12.3",
                                   cuda="12.1", last=120, step_ms=lambda it: 2400.0, stamp="2024-03-02"),
        "mds-span-long.log": _log(hosts=["host-a", "host-b"], torch="2.1.0a0+fe05266", deepspeed="0.12.3",
                                  cuda="12.1", last=2130, stamp="2024-03-03",
                                  step_ms=lambda it: 2280.0 if it <= 120 else 2400.0 if it < 500 else 2520.0),
    }  # fmt: skip
    out = []
    for name, text in files.items():
        (HERE / name).write_text(text)
        out.append(HERE / name)
    return out


if __name__ == "__main__":
    for p in write():
        print(p)
