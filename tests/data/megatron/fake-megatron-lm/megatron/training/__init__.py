"""A stand-in Megatron-LM ``megatron.training`` for the entry-wrapper tests (CPU, world size 1).

Mirrors the parts the wrapper relies on: ``pretrain(train_valid_test_dataset_provider,
model_provider, model_type, forward_step_func, ..., extra_args_provider=None, ...)`` parses the
command line with ``extra_args_provider`` (unknown arguments are errors, as upstream), makes the
args available through ``get_args()`` and calls ``model_provider()`` -- once per model chunk with
``vp_stage=i`` under virtual pipelining, as upstream's ``get_model`` does. It prints what it saw as JSON.
"""

import argparse
import json

_ARGS = None


def get_args():
    return _ARGS


def pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults={},  # noqa: B006 - upstream's signature
    store=None,
):
    global _ARGS
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--seq-length", type=int)
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument("--moe-token-dispatcher-type", default="alltoall")
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    parser.add_argument("--distributed-backend", default="nccl")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    _ARGS = parser.parse_args()
    _ARGS.data_parallel_size = 1  # upstream's validate_args derives it from the world size
    vpp = _ARGS.virtual_pipeline_model_parallel_size
    chunks = [model_provider(vp_stage=i) for i in range(vpp)] if vpp else [model_provider()]
    from megatron.core.distributed import param_and_grad_buffer as pgb

    moes = [m for chunk in chunks for m in chunk.modules() if hasattr(m, "token_dispatcher")]
    print(
        "FAKE-PRETRAIN "
        + json.dumps(
            {
                "knobs": {k: v for k, v in vars(_ARGS).items() if "bufreuse" in k or "hybridep" in k},
                "hooked": "_bufreuse_hooked" in vars(moes[0]),
                "hooked_layers": sum("_bufreuse_hooked" in vars(m) for m in moes),
                "chunks": len(chunks),
                "script_arg": getattr(_ARGS, "script_flag", None),
                "gloo_grad_sync": getattr(pgb._coalescing_manager, "_bufreuse_per_op", False),
            }
        )
    )
