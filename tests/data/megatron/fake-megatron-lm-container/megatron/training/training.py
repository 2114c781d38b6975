"""``pretrain(cfg_container, ...)`` building one real megatron-core MoELayer on CPU; prints what it saw."""

import json
import socket

import torch
from megatron.training.arguments import get_args


def setup_model_and_optimizer(model_type, model_provider_func=None, checkpointing_context=None, *, cfg_container=None):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # CPU: no side stream
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type=get_args().moe_token_dispatcher_type,
        use_cpu_initialization=True,
        add_bias_linear=False,
    )
    chunk = torch.nn.Module()
    chunk.config = cfg
    chunk.moe = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False).submodules.mlp(config=cfg)
    return [chunk], None, None


def pretrain(
    cfg_container,
    train_valid_test_dataset_provider,
    model_type,
    forward_step_func,
    model_provider=None,
    store=None,
):
    model, _, _ = setup_model_and_optimizer(model_type, model_provider, cfg_container=cfg_container)
    args = get_args()
    from megatron.core.datasets.utils import compile_helpers  # what initialize does on rank 0

    compile_helpers()
    print(
        "FAKE-PRETRAIN "
        + json.dumps(
            {
                "container": cfg_container,
                "knobs": {k: v for k, v in vars(args).items() if "bufreuse" in k or "hybridep" in k},
                "hooked": "_bufreuse_hooked" in vars(model[0].moe),
                "script_arg": getattr(args, "script_flag", None),
            }
        )
    )
