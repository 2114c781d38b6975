"""Real Transformer Engine, both routes of the expert-output ring, without megatron in between.

- **module route** (what Hopper runs): TE's ``GroupedLinear.forward(inp, m_splits, out=)`` through
  :func:`bufreuse.integrations.te.out_route.grouped_linear_into`, the FC2 output written into a ring slot;
- **op-fuser route** (what megatron's fused ``TEGroupedMLP`` uses where TE fuses it, SM100):
  ``te.ops.Sequential([GroupedLinear, SwiGLU, GroupedLinear])`` with ``op_kwargs={-1: {OUTPUT_BUFFER_KEY: slot}}``
  (:func:`bufreuse.integrations.te.out_route.output_buffer_op_kwargs`); on Hopper TE runs it unfused, which is
  the same caller-visible contract.

Each runs 4 microbatches in an interleaved order (F0 F1 B0 F2 B1 F3 B2 B3) through a 2-slot ring in
production mode (``debug=False``) and debug mode, bf16 and FP8 (delayed and current scaling), and
compares the FC2 outputs, input gradients and weight gradients bit for bit with ``out=None``. The
slot is released at the consumer by fact (``track_saved`` + ``release_when_unsaved``): TE must not
save its own output, so every release happens at once (``deferred_releases == 0``) and the slot is
rewritten while earlier backwards are still pending.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")

from schedule_harness import MODES, mode_env, write_summary  # noqa: E402

from bufreuse.pool import BufferPool  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.te]
E, H, F = 4, 256, 512
SPLITS = (32, 64, 16, 48)  # multiples of 16: FP8 GEMMs need aligned splits
ROWS = sum(SPLITS)
ORDER = ("F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3")
RECIPES = ("bf16", "fp8-delayed", "fp8-current")
RESULTS: dict[str, dict] = {}


def _recipe(name: str):
    from transformer_engine.common import recipe as te_recipe

    if name == "fp8-delayed":
        return te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16)
    if name == "fp8-current":
        return te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    return None


def _autocast(name: str):
    import transformer_engine.pytorch as te

    r = _recipe(name)
    return te.autocast(enabled=True, recipe=r) if r is not None else contextlib.nullcontext()


def _inputs(cols: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(11)
    return [torch.randn(ROWS, cols, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]


def _grads(cols: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(12)
    return [torch.randn(ROWS, cols, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]


def _module(kind: str):
    import transformer_engine.pytorch as te

    torch.manual_seed(5)
    if kind == "module":
        return te.GroupedLinear(E, H, F, bias=False, params_dtype=torch.bfloat16, device="cuda")
    ops = te.ops
    return ops.Sequential(
        ops.GroupedLinear(E, H, 2 * F, bias=False, device="cuda", dtype=torch.bfloat16),
        ops.SwiGLU(),
        ops.GroupedLinear(E, F, H, bias=False, device="cuda", dtype=torch.bfloat16),
    )


def _out_cols(kind: str) -> int:
    return F if kind == "module" else H


def _forward(kind: str, mod, x, slot):
    """The FC2 output of ``mod`` for ``x``; written into ``slot`` when one is given."""
    from bufreuse.integrations.te.out_route import grouped_linear_into, output_buffer_op_kwargs

    if kind == "module":
        splits = torch.tensor(SPLITS, dtype=torch.int64, device="cuda")
        if slot is None:
            return mod(x, splits)
        return grouped_linear_into(mod, x, splits, slot)
    from transformer_engine.pytorch.ops.basic import grouped_linear as ops_gl

    splits = torch.tensor(SPLITS, dtype=torch.int64, device="cuda")
    kwargs = {} if slot is None else {"op_kwargs": output_buffer_op_kwargs(ops_gl, slot, (ROWS, H))}
    return mod(x, splits, splits, **kwargs)


def _run(kind: str, recipe: str, pool: BufferPool | None) -> tuple[list, list, dict, list]:
    mod = _module(kind)
    xs = [x.clone().requires_grad_(True) for x in _inputs(H)]
    gs = _grads(_out_cols(kind))
    outs, consumed, ptrs = {}, {}, []
    for step in ORDER:
        i = int(step[1:])
        if step[0] == "F":
            slot = pool.acquire("expert", (ROWS, _out_cols(kind))) if pool is not None else None
            track = pool.track_saved() if pool is not None else contextlib.nullcontext()
            with track, _autocast(recipe):
                y = _forward(kind, mod, xs[i], slot)
                z = y * 2.0  # the consumer (combine's stand-in): a scalar multiply saves nothing
            # The test's own copy is a reader of the slot too: it goes before the release (debug mode poisons a
            # released slot at once on its stream, so a copy after the release reads NaN -- a stale read).
            outs[i], consumed[i] = y.detach().clone(), z
            if slot is not None:
                assert y.data_ptr() == slot.data_ptr(), "TE did not write into the slot"
                ptrs.append(slot.data_ptr())
                pool.release_when_unsaved("expert", slot)
        else:
            consumed[i].backward(gs[i])
    torch.cuda.synchronize()
    params = {n: p.grad.clone() for n, p in mod.named_parameters() if p.grad is not None}
    return [outs[i] for i in sorted(outs)], [x.grad for x in xs], params, ptrs


def _fp8_ok(recipe: str) -> None:
    if recipe == "bf16":
        return
    import transformer_engine.pytorch as te

    ok, why = te.is_fp8_available(return_reason=True)
    if not ok:
        pytest.fail(f"FP8 not available on this GPU: {why}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["module", "op-fuser"])
def test_real_te_fc2_output_in_ring_slot_is_bit_equal(kind: str, recipe: str, mode: str) -> None:
    _fp8_ok(recipe)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    ref = _run(kind, recipe, None)
    with mode_env(mode):
        pool = BufferPool("cuda")
        assert pool.debug is (mode == "debug")
        pool.register("expert", policy="ring", num_slots=2, max_shape=(ROWS, _out_cols(kind)), dtype=torch.bfloat16)
        guard = pool.autograd_guard() if mode == "debug" else contextlib.nullcontext()
        with guard:
            got = _run(kind, recipe, pool)
    for name, a, b in (("FC2 output", ref[0], got[0]), ("input grad", ref[1], got[1])):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(u, v), f"[{kind}/{recipe}/{mode}] {name} of microbatch {i} differs"
    assert set(ref[2]) == set(got[2]) and ref[2], (sorted(ref[2]), sorted(got[2]))
    for n in ref[2]:
        assert torch.equal(ref[2][n], got[2][n]), f"[{kind}/{recipe}/{mode}] weight grad {n} differs"
    s = pool.stats()["expert"]
    assert s.acquisitions == s.releases == 4, s
    assert s.deferred_releases == 0, f"TE saved its own FC2 output ({s})"
    assert len(set(got[3])) == 2, "two slots alternate over the four microbatches"
    RESULTS[f"{kind}/{recipe}/{mode}"] = {"outcome": "bit-equal", "stats": dataclasses.asdict(s)}
    write_summary("te_routes", RESULTS)
