"""Stand-in for Megatron-LM's pretrain_gpt.py: builds one real MoELayer on CPU and calls pretrain()."""

import os
import socket

import torch
from megatron.training import get_args, pretrain


def script_args(parser):
    parser.add_argument("--script-flag", default=None)
    return parser


def model_provider():
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
    model = torch.nn.Module()
    model.config = cfg
    model.moe = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False).submodules.mlp(config=cfg)
    return model


if __name__ == "__main__":
    os.environ.setdefault("FAKE_MEGATRON", "1")
    pretrain(None, model_provider, None, None, extra_args_provider=script_args)
