"""Stand-in for Megatron-LM's pretrain_gpt.py: builds one real MoELayer on CPU and calls pretrain()."""

import os
import socket

import torch
from megatron.training import get_args, pretrain


def script_args(parser):
    parser.add_argument("--script-flag", default=None)
    return parser


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """One model chunk: its share of ``--num-layers`` MoE layers (PP x VPP split), on CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = get_args()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)  # one process: rank 0 of the configured pipeline
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # CPU: no side stream
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    cfg = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=args.num_experts,
        moe_router_topk=min(2, args.num_experts),
        moe_router_pre_softmax=args.num_experts == 1,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        use_cpu_initialization=True,
        add_bias_linear=False,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32 if pp > 1 else None,
    )
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False).submodules.mlp
    model = torch.nn.Module()
    model.config = cfg
    per_chunk = args.num_layers // (pp * (vpp or 1))
    model.moe = spec(config=cfg)
    model.more = torch.nn.ModuleList([spec(config=cfg) for _ in range(per_chunk - 1)])
    return model


if __name__ == "__main__":
    os.environ.setdefault("FAKE_MEGATRON", "1")
    pretrain(None, model_provider, None, None, extra_args_provider=script_args)
