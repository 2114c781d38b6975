"""Compares a DeepEP HybridEP ``dispatch_with_permute`` / ``combine_with_unpermute`` result with the fake's.

Every comparison returns plain facts (JSON-ready) and a list of mismatches, so a run that disagrees still
leaves data. Used by the H200 test (real kernels against ``tests/fakes/deep_ep_hybrid.py``) and on CPU
(the fake against deliberately altered fakes, which shows the comparison can fail).

Inputs carry their token id in columns 0 and 1 (``id % 256``, ``id // 256``; exact in bf16) and small
integers elsewhere, so every permuted row names its token and sums of a few rows are exact whatever
order a kernel adds them in.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["compare_combine", "compare_dispatch", "describe", "make_inputs", "token_ids"]


def make_inputs(
    tokens: int, hidden: int, experts: int, topk: int, *, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden bf16 [T, H], routing_map bool [T, E], probs float32 [T, E])``: top-k of random scores."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (tokens, hidden), generator=g).to(torch.bfloat16)
    ids = torch.arange(tokens)
    x[:, 0], x[:, 1] = (ids % 256).to(torch.bfloat16), (ids // 256).to(torch.bfloat16)
    top = torch.rand(tokens, experts, generator=g).topk(topk)
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, top.indices, True)
    probs = torch.zeros(tokens, experts).scatter(1, top.indices, top.values)
    return x.to(device), routing.to(device), probs.to(device)


def token_ids(rows: torch.Tensor) -> list[int]:
    """Token id of each row made by :func:`make_inputs` (or a row copied from one)."""
    r = rows.detach().float().cpu()
    return (r[:, 0] + 256 * r[:, 1]).round().long().tolist()


def describe(v: Any) -> dict[str, Any]:
    """Type, and for tensors shape / dtype / device (and the value when it has at most 8 elements)."""
    d: dict[str, Any] = {"type": type(v).__name__}
    if isinstance(v, torch.Tensor):
        d.update(shape=list(v.shape), dtype=str(v.dtype).removeprefix("torch."), device=v.device.type)
        if v.numel() <= 8:
            d["value"] = v.detach().cpu().tolist()
    elif isinstance(v, (int, float, bool, str)) or v is None:
        d["value"] = v
    return d


def _ints(t: Any) -> list[int]:
    return [int(v) for v in torch.as_tensor(t).detach().cpu().reshape(-1).tolist()]


def _segments(padded: list[int], raw: list[int], rows: int) -> list[tuple[int, int, int]]:
    """Per expert ``(first row, end of its tokens, end of its padded block)``, clipped to ``rows``."""
    out, off = [], 0
    for p, r in zip(padded, raw, strict=True):
        out.append((min(off, rows), min(off + r, rows), min(off + p, rows)))
        off += p
    return out


def compare_dispatch(real: tuple, fake: tuple, *, budget: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Facts and mismatches of two ``dispatch_with_permute`` results (both forward, both with probs).

    Checked: rows of the output, ``tokens_per_expert`` (returned, padded), the handle's length,
    ``handle[7]`` (raw counts), ``handle[8]`` (tokens), ``handle[-1]`` (overflow flag, which megatron
    reads on the static-budget path only: with ``budget=False``, the dynamic path, upstream leaves it
    unwritten (16,256 and 1,220,041,477 seen on an H100) and it is recorded, not compared); per expert
    the tokens in row order and their hidden rows and probs, bit for bit; the real
    padding rows are zero (the dispatch ring relies on it: docs/megatron.md). Recorded only: what rows
    past the padded splits hold, every handle field's form.
    """
    r_out, r_probs, _, r_tpe, r_h = real
    f_out, f_probs, _, f_tpe, f_h = fake
    facts: dict[str, Any] = {}
    bad: list[str] = []

    def same(name: str, rv: Any, fv: Any) -> None:
        facts[name] = {"real": rv, "fake": fv}
        if rv != fv:
            bad.append(f"{name}: real {rv} != fake {fv}")

    same("rows", int(r_out.shape[0]), int(f_out.shape[0]))
    same("hidden", int(r_out.shape[1]), int(f_out.shape[1]))
    same("handle_len", len(r_h), len(f_h))
    r_pad, f_pad = _ints(r_tpe), _ints(f_tpe)
    same("tokens_per_expert_padded", r_pad, f_pad)
    facts["tokens_per_expert_form"] = {"real": describe(r_tpe), "fake": describe(f_tpe)}
    if len(r_h) != len(f_h) or len(r_h) < 11:
        return facts, bad
    r_raw, f_raw = _ints(r_h[7]), _ints(f_h[7])
    same("handle7_tokens_per_expert", r_raw, f_raw)
    same("handle8_num_tokens", int(r_h[8]), int(f_h[8]))
    if budget:
        same("handle_last_overflow", _ints(r_h[-1]), _ints(f_h[-1]))
    else:
        facts["handle_last_overflow"] = {"real": _ints(r_h[-1]), "fake": _ints(f_h[-1]), "compared": False}
    facts["handle_fields"] = [{"real": describe(a), "fake": describe(b)} for a, b in zip(r_h, f_h, strict=True)]
    facts["handle3_num_dispatched_tokens"] = {"real": _ints(r_h[3]), "fake": _ints(f_h[3])}
    if len(r_raw) != len(r_pad) or len(f_raw) != len(f_pad):
        bad.append("tokens_per_expert and handle[7] disagree in length")
        return facts, bad

    r_seg = _segments(r_pad, r_raw, r_out.shape[0])
    f_seg = _segments(f_pad, f_raw, f_out.shape[0])
    r_cpu, f_cpu = r_out.detach().cpu(), f_out.detach().cpu()
    per_expert, pad_zero = [], []
    for e, ((r0, r1, r2), (f0, f1, _)) in enumerate(zip(r_seg, f_seg, strict=True)):
        r_tok, f_tok = token_ids(r_cpu[r0:r1]), token_ids(f_cpu[f0:f1])
        row = {"expert": e, "first_row": [r0, f0], "tokens_real": r_tok, "tokens_fake": f_tok}
        row["order_equal"] = r_tok == f_tok
        row["same_token_set"] = sorted(r_tok) == sorted(f_tok)
        row["rows_bit_equal"] = r1 - r0 == f1 - f0 and torch.equal(r_cpu[r0:r1], f_cpu[f0:f1])
        if r_probs is not None and f_probs is not None:
            rp, fp = r_probs.detach().cpu()[r0:r1], f_probs.detach().cpu()[f0:f1]
            row["probs_equal"] = rp.shape == fp.shape and torch.equal(rp, fp)
        pad_zero.append(bool((r_cpu[r1:r2] == 0).all()))
        if not pad_zero[-1]:
            bad.append(f"expert {e}: padding rows are not zero")
        for key in ("order_equal", "rows_bit_equal", "probs_equal"):
            if row.get(key) is False:
                hint = "" if row["same_token_set"] or key != "order_equal" else " (different tokens)"
                bad.append(f"expert {e}: {key} is False{hint}")
        per_expert.append(row)
    facts["per_expert"] = per_expert
    facts["probs_form"] = {"real": describe(r_probs), "fake": describe(f_probs)}
    facts["real_padding_rows_zero"] = pad_zero
    end = r_seg[-1][2] if r_seg else 0
    facts["real_rows_past_experts"] = int(r_cpu.shape[0]) - end
    facts["real_rows_past_experts_zero"] = bool((r_cpu[end:] == 0).all())
    return facts, bad


def compare_combine(
    name: str, real: torch.Tensor | None, fake: torch.Tensor | None, routed: torch.Tensor
) -> tuple[dict[str, Any], list[str]]:
    """Facts and mismatches of one combine output (``[T, ...]``): bit-equal rows for ``routed`` tokens.

    Rows of tokens that kept no expert are compared apart (the fake returns zeros there).
    """
    if real is None or fake is None:
        facts = {"real": describe(real), "fake": describe(fake)}
        return {name: facts}, ([] if real is None and fake is None else [f"{name}: one side is None"])
    r, f = real.detach().cpu(), fake.detach().cpu()
    facts: dict[str, Any] = {"real": describe(real), "fake": describe(fake)}
    bad: list[str] = []
    if r.shape != f.shape or r.dtype != f.dtype:
        bad.append(f"{name}: real {tuple(r.shape)} {r.dtype} vs fake {tuple(f.shape)} {f.dtype}")
        return {name: facts}, bad
    keep = routed.cpu()
    diff = (r[keep].float() - f[keep].float()).abs()
    facts["routed_bit_equal"] = torch.equal(r[keep], f[keep])
    facts["routed_max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
    facts["unrouted_tokens"] = int((~keep).sum())
    facts["unrouted_equal"] = torch.equal(r[~keep], f[~keep])
    if not facts["routed_bit_equal"]:
        bad.append(f"{name}: routed tokens differ (max abs diff {facts['routed_max_abs_diff']})")
    if not facts["unrouted_equal"]:
        bad.append(f"{name}: rows of tokens with no kept expert differ (the fake returns zeros)")
    return {name: facts}, bad
