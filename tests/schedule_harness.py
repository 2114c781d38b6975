"""Test helper: the schedule harness's table, orders, modes and bit-for-bit comparison (CPU and GPU halves).

One table (:data:`ROWS`) of named tiny configurations. Each row is run twice over the same
microbatches in the same order: the control (no hooks) and with rings installed, in production mode
(``BufferPool(debug=False)``, no autograd guard, ``BUFREUSE_DEBUG`` unset) — and the modules also run
debug mode on top. Outputs, input gradients and parameter gradients must be bit-equal; a row may
instead expect a named refusal (``ConfigError`` from ``validate``/``install``) or an
``EarlyReuseError`` naming the depth. :func:`compare` says which tensor differed, by how much, in
which row.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

ORDERS = {
    # 1F1B steady state after a warm-up of two (issue 13's schedule): two microbatches in flight.
    "1f1b": ("F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"),
    # interleaved-VPP-like: three in flight.
    "vpp": ("F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"),
    # all forwards, then all backwards: four in flight.
    "fwd_bwd": ("F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"),
    # combined-1F1B-like with delayed wgrad: each backward_dw after the next forward (dispatch included).
    "1f1b_dw": ("F0", "F1", "B0", "F2", "W0", "B1", "F3", "W1", "B2", "W2", "B3", "W3"),
}
"""Named microbatch orders (F<i>: forward of microbatch i, B<i>: its backward, W<i>: ``layer.backward_dw()``
for it — delayed weight gradients)."""

MODES = ("production", "debug")


def in_flight(order: str) -> int:
    """The most microbatches whose forward ran and backward did not, over ``order``."""
    live = peak = 0
    for step in ORDERS[order]:
        live += {"F": 1, "B": -1}.get(step[0], 0)
        peak = max(peak, live)
    return peak


@dataclass(frozen=True, slots=True)
class Row:
    """One named configuration of the harness."""

    name: str
    spec: str
    """``local`` (SequentialMLP), ``te-fake`` (TEGroupedMLP over the fake TE GroupedLinear, CPU) or ``te`` (real TE)."""
    experts: int
    order: str
    dtype: str = "float32"
    fp8: str | None = None
    """None; ``delayed`` / ``current`` (real TE recipes); ``copy`` (the CPU fake saves an input copy, as FP8 does)."""
    recompute: bool = False
    probs_on_input: bool = False
    delayed_wgrad: str | None = None
    """A config field that defers the expert wgrad (``delay_wgrad_compute``, ...), set before the experts are built."""
    slots: int | None = None
    """Ring depth; default: the order's in-flight count."""
    expect: str = "bit-equal"
    """``bit-equal``, ``refused:<requirement key>`` or ``early-reuse:<min depth>``."""
    tags: tuple[str, ...] = field(default=())

    @property
    def depth(self) -> int:
        return self.slots if self.slots is not None else in_flight(self.order)


def _rows() -> tuple[Row, ...]:
    rows: list[Row] = []
    for spec in ("local", "te-fake", "te"):
        dtypes = ("bfloat16",) if spec == "te" else ("float32", "bfloat16")
        for experts in (1, 8):
            for order in ORDERS:
                for dtype in dtypes:
                    rows.append(Row(name=f"{spec}-e{experts}-{dtype}-{order}", spec=spec, experts=experts,
                                    order=order, dtype=dtype))  # fmt: skip
        recipes = {"local": (), "te-fake": ("copy",), "te": ("delayed", "current")}[spec]
        for fp8 in recipes:
            for experts in (1, 8):
                rows.append(Row(name=f"{spec}-e{experts}-fp8{fp8}-vpp", spec=spec, experts=experts, order="vpp",
                                dtype="bfloat16", fp8=fp8))  # fmt: skip
        dt = "bfloat16"
        rows += [
            Row(name=f"{spec}-e1-recompute-vpp", spec=spec, experts=1, order="vpp", dtype=dt, recompute=True),
            Row(name=f"{spec}-e8-recompute-1f1b", spec=spec, experts=8, order="1f1b", dtype=dt, recompute=True),
            Row(name=f"{spec}-e1-probs-on-input-vpp", spec=spec, experts=1, order="vpp", dtype=dt,
                probs_on_input=True),
            Row(name=f"{spec}-e8-probs-on-input-1f1b", spec=spec, experts=8, order="1f1b", dtype=dt,
                probs_on_input=True),
            Row(name=f"{spec}-e1-shallow-fwd_bwd", spec=spec, experts=1, order="fwd_bwd", dtype=dt, slots=2,
                expect="early-reuse:3"),
        ]  # fmt: skip
    # Delayed wgrad: the dispatch slot is held until backward_dw (one more slot in flight than 1F1B).
    for spec in ("te-fake", "te"):
        fp8 = "copy" if spec == "te-fake" else "delayed"
        rows += [
            *(Row(name=f"{spec}-e{experts}-delay_wgrad_compute-1f1b_dw", spec=spec, experts=experts,
                  order="1f1b_dw", dtype="bfloat16", delayed_wgrad="delay_wgrad_compute", slots=3)
              for experts in (1, 8)),
            Row(name=f"{spec}-e1-fp8{fp8}-delay_wgrad_compute-1f1b_dw", spec=spec, experts=1, order="1f1b_dw",
                dtype="bfloat16", fp8=fp8, delayed_wgrad="delay_wgrad_compute", slots=3),
            Row(name=f"{spec}-e1-delay_wgrad_compute-shallow", spec=spec, experts=1, order="1f1b_dw",
                dtype="bfloat16", delayed_wgrad="delay_wgrad_compute", slots=2, expect="early-reuse:3"),
        ]  # fmt: skip
    rows += [
        Row(name="te-e1-overlap_dispatch_backward_with_experts_wgrad", spec="te", experts=1, order="1f1b",
            dtype="bfloat16", delayed_wgrad="overlap_dispatch_backward_with_experts_wgrad"),
        Row(name="te-fake-e1-delay_wgrad_compute-graphed", spec="te-fake", experts=1, order="1f1b",
            dtype="bfloat16", delayed_wgrad="delay_wgrad_compute", tags=("graphs",),
            expect="refused:no_graphed_delayed_wgrad"),
    ]  # fmt: skip
    return tuple(rows)


ROWS: tuple[Row, ...] = _rows()
"""The harness table: CPU runs ``local`` and ``te-fake``; the GPU half runs ``local`` and ``te`` (real TE)."""


def rows_for(*specs: str) -> list[Row]:
    return [r for r in ROWS if r.spec in specs]


@contextlib.contextmanager
def mode_env(mode: str) -> Iterator[None]:
    """``BUFREUSE_DEBUG`` unset in production mode, ``1`` in debug mode; restored after."""
    old = os.environ.pop("BUFREUSE_DEBUG", None)
    if mode == "debug":
        os.environ["BUFREUSE_DEBUG"] = "1"
    try:
        yield
    finally:
        os.environ.pop("BUFREUSE_DEBUG", None)
        if old is not None:
            os.environ["BUFREUSE_DEBUG"] = old


def guard(pool, mode: str):
    """Production: nothing. Debug: the pool's autograd guard (strict saved-tensor checks) around the run."""
    return pool.autograd_guard() if mode == "debug" else contextlib.nullcontext()


def max_abs_diff(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def compare(row: str, mode: str, ref: tuple, got: tuple) -> list[str]:
    """Every tensor of ``got`` that is not bit-equal to ``ref``, named, with its max abs difference.

    ``ref`` / ``got``: (outputs, input grads, {param name: grad}).
    """
    import torch

    problems = []
    for kind, r, g in (("output", ref[0], got[0]), ("input grad", ref[1], got[1])):
        for i, (a, b) in enumerate(zip(r, g, strict=True)):
            if b is None or not torch.equal(a, b):
                d = "missing" if b is None else f"max abs diff {max_abs_diff(a, b):.3e}"
                problems.append(f"[{row}/{mode}] {kind} of microbatch {i}: {d}")
    if set(ref[2]) != set(got[2]):
        problems.append(f"[{row}/{mode}] parameter grads differ in names: {sorted(set(ref[2]) ^ set(got[2]))}")
    for n in sorted(set(ref[2]) & set(got[2])):
        if not torch.equal(ref[2][n], got[2][n]):
            problems.append(f"[{row}/{mode}] param grad {n}: max abs diff {max_abs_diff(ref[2][n], got[2][n]):.3e}")
    return problems


def write_summary(section: str, data: object) -> None:
    """Merge ``{section: data}`` into ``$OUT/megatron-gpu-summary.json`` (no-op without ``$OUT``)."""
    import json
    from pathlib import Path

    out = os.environ.get("OUT")
    if not out:
        return
    path = Path(out, "megatron-gpu-summary.json")
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary[section] = data
    path.write_text(json.dumps(summary, indent=1, default=str))


def control_is_deterministic(row: str, mode: str, first: tuple, second: tuple) -> None:
    """Assert the control's two runs are bit-equal: bit-equality against the control means nothing otherwise."""
    problems = compare(f"{row} (control vs control)", mode, first, second)
    assert not problems, "the control is not deterministic run to run:\n" + "\n".join(problems)


# -- allocation probes by the control's own allocation sites (GPU; from torch.cuda.memory._snapshot()) ------

Frame = tuple[str, str, int]
MOE_LAYER = "megatron/core/transformer/moe/moe_layer.py"
EXPERTS = "megatron/core/transformer/moe/experts.py"


def alloc_stacks(snapshot: dict) -> list[list[Frame]]:
    """Python frames ``(filename, function, line)`` of every ``alloc`` event, innermost first."""
    return [
        [
            (f["filename"], f["name"], int(f.get("line", 0)))
            for f in e.get("frames", [])
            if f["filename"].endswith(".py")
        ]
        for trace in snapshot["device_traces"]
        for e in trace
        if e["action"] == "alloc"
    ]


def innermost_megatron(stack: list[Frame]) -> Frame | None:
    """The innermost megatron-core frame: where megatron (not torch, not bufreuse) asked for the memory."""
    return next((fr for fr in stack if "megatron/core/" in fr[0]), None)


def _through(stack: list[Frame], file: str, function: str) -> bool:
    return any(f.endswith(file) and n == function for f, n, _ in stack)


def expert_output_allocs(stacks: list[list[Frame]]) -> int:
    """Allocations made directly by whatever runs as ``MoELayer.experts`` (SequentialMLP).

    In the control that is ``SequentialMLP.forward``'s ``torch.cat`` of the FC2 outputs (innermost megatron
    frame ``experts.py:forward``). A replacement ``experts.forward`` that allocated its output per call
    would show with ``moe_layer.py:routed_experts_compute`` as its innermost megatron frame (its caller),
    whatever bufreuse's own functions are called; the expert MLPs' own allocations (``mlp.py``) are not
    counted in either arm.
    """
    n = 0
    for st in stacks:
        inner = innermost_megatron(st)
        if inner is None:
            continue
        if (inner[0].endswith(EXPERTS) and inner[1] == "forward") or (
            inner[0].endswith(MOE_LAYER) and inner[1] == "routed_experts_compute"
        ):
            n += 1
    return n


def dispatch_stage_allocs(stacks: list[list[Frame]]) -> int:
    """Allocations under megatron's ``MoELayer.dispatch`` (which calls ``token_dispatcher.token_dispatch``):
    the all-to-all outputs, or anything a hooked ``token_dispatch`` allocates per call."""
    return sum(1 for st in stacks if _through(st, MOE_LAYER, "dispatch"))


def layer_allocs(stacks: list[list[Frame]]) -> int:
    """Allocations under the MoE layer at all (the recording saw the run)."""
    return sum(1 for st in stacks if any(f.endswith(MOE_LAYER) for f, _, _ in st))
