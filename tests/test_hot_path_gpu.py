"""The hooks add no host-device synchronisation (H200): the hooked stages under torch's sync debug mode.

A real megatron-core ``MoELayer`` (real TE ``TEGroupedMLP`` when Transformer Engine imports, else the
local ``SequentialMLP``) at EP = 1, pad-to-capacity (megatron's dropless path copies token counts to the
host itself), in production mode, with both rings (the dispatch ring exercised at EP = 1). Each arm's
layer calls run under ``torch.cuda.set_sync_debug_mode("warn")``: the rings arm must warn exactly as often
as the control (megatron's own syncs, if any), and a deliberate ``.item()`` proves the detector sees a sync.
"""

from __future__ import annotations

import os
import socket
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from megatron_cpu import install_exercising_rings  # noqa: E402

from bufreuse.config import BufReuseConfig  # noqa: E402
from bufreuse.pool import BufferPool  # noqa: E402

pytestmark = pytest.mark.gpu
SEQ, MBS, HIDDEN = 128, 2, 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def parallel():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    yield
    ps.destroy_model_parallel()


def _te() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def _layer():
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    te = _te()
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=512, num_attention_heads=8, num_moe_experts=8,
        moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=te, add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
    )  # fmt: skip
    spec = (
        get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True)
        if te
        else get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    )
    return spec.submodules.mlp(config=cfg).cuda()


def _calls(layer, n: int = 3) -> None:
    for _ in range(n):
        x = torch.randn(SEQ, MBS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)[0]
        y.backward(torch.ones_like(y))
        del x, y


def _syncs(fn) -> int:
    """Sync warnings ``fn`` raises under torch's sync debug mode (``warn``)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def _knobs() -> BufReuseConfig:
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=3,
        moe_hybridep_num_expert_output_buffers=3,
    )


@pytest.mark.parametrize("exercise_dispatch", [False, True], ids=["expert-ring", "both-rings"])
def test_hooked_stages_add_no_host_device_sync(parallel, exercise_dispatch: bool) -> None:
    # the detector sees a sync (positive control)
    assert _syncs(lambda: torch.ones(1, device="cuda").item()) >= 1
    layer = _layer()
    _calls(layer)  # warm-up: lazy inits and first-call syncs out of the way
    control = _syncs(lambda: _calls(layer))
    pool = BufferPool("cuda")
    assert not pool.debug
    # EP = 1 leaves both rings unused in production: ring them anyway (the expert ring alone, or both)
    with install_exercising_rings(layer, pool, _knobs(), tokens=SEQ * MBS, ring_identity_dispatch=exercise_dispatch):
        _calls(layer)  # the rings' warm-up
        rings = _syncs(lambda: _calls(layer))
        stats = pool.stats()
    torch.cuda.synchronize()
    assert rings == control, f"the hooks added {rings - control} host-device sync(s) (control {control})"
    # the hooks really ran: every call acquired the expert ring (and the dispatch ring when exercised)
    assert stats["expert_fc2_output"].acquisitions == 6
    assert ("dispatch_output" in stats) is exercise_dispatch
