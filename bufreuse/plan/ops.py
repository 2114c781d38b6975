"""The schedule expanded to stream operations: where each ring buffer is acquired, read and released.

Per MoE layer and pass (``D`` = dispatch output, ``E`` = expert FC2 output; streams as under EP overlap):

======================  ========  =====================================================
op                      stream    buffers
======================  ========  =====================================================
``dispatch.fwd``        comm      acquires D (the dispatch writes it)
``experts.fwd``         compute   reads D, acquires E; releases D at ``forward``
``combine.fwd``         comm      reads E; releases E at ``forward``
``combine.bwd``         comm      releases E at ``backward`` (combine's saved copy is read)
``experts.bwd``         compute   releases D at ``backward``
``experts.wgrad``       compute   releases D at ``wgrad`` (``delay_wgrad_compute``)
``dispatch.bwd``        comm      --
======================  ========  =====================================================

A forward pass runs layers ``0 .. L-1``; a backward pass ``L-1 .. 0``, each preceded by the recomputed
forward ops when the MoE layer is recomputed. A combined-1F1B pair interleaves forward layer ``i`` with
backward layer ``L-1-i`` in the order of megatron's ``TransformerLayerSchedulePlan.run``: combine.bwd(B),
[attention.fwd(F)], experts.bwd(B), dispatch.fwd(F), experts.wgrad(B), dispatch.bwd(B), experts.fwd(F),
combine.fwd(F). Attention carries no ring buffer and is left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from bufreuse.plan.rules import ReleasePoint, ReleaseRule
from bufreuse.plan.schedule import Pass, Step

__all__ = ["COMM", "COMPUTE", "Acq", "Op", "expand"]

COMM = "comm"
COMPUTE = "compute"

Acq = tuple[str, int, int, int, int]
"""One acquisition: ``(buffer, chunk, microbatch, layer, generation)``; generation 1 = the recompute's."""


class Op(NamedTuple):
    """One stream operation of the schedule, in host program order (``index``).

    A named tuple, not a dataclass: a 64-stage, VPP 4, 512-microbatch schedule builds ~10^5 of them.
    """

    index: int
    step: int
    """Index of the schedule step it belongs to."""
    stream: str
    name: str
    microbatch: int
    chunk: int
    layer: int
    acquires: tuple[Acq, ...] = ()
    reads: tuple[Acq, ...] = ()
    releases: tuple[Acq, ...] = ()

    def label(self) -> str:
        return f"{self.name}(mb {self.microbatch}, chunk {self.chunk}, layer {self.layer}) on {self.stream}"


class _Builder:
    def __init__(self, rules: Mapping[str, ReleaseRule]) -> None:
        self.ops: list[Op] = []
        self.step = 0
        self.d = rules.get("dispatch")
        self.e = rules.get("expert")
        self.recompute = any(r.recompute for r in rules.values())
        self.wgrad = any(r.point is ReleasePoint.WGRAD for r in rules.values())

    def add(self, stream: str, name: str, p: Pass, layer: int, **bufs: tuple[Acq, ...]) -> None:
        self.ops.append(Op(len(self.ops), self.step, stream, name, p.microbatch, p.chunk, layer, **bufs))

    def _at(self, rule: ReleaseRule | None, point: ReleasePoint, acq: Acq) -> tuple[Acq, ...]:
        if rule is None:
            return ()
        if rule.recompute and acq[4] == 0:  # the checkpointed forward saves nothing
            return (acq,) if point is ReleasePoint.FORWARD else ()
        return (acq,) if rule.point is point else ()

    def forward_ops(self, p: Pass, layer: int, gen: int) -> list[tuple[str, str, dict]]:
        d: Acq = ("dispatch", p.chunk, p.microbatch, layer, gen)
        e: Acq = ("expert", p.chunk, p.microbatch, layer, gen)
        has_d, has_e = self.d is not None, self.e is not None
        fwd = ReleasePoint.FORWARD
        tag = "recompute" if gen else "fwd"
        return [
            (COMM, f"dispatch.{tag}", {"acquires": (d,) if has_d else ()}),
            (
                COMPUTE,
                f"experts.{tag}",
                {
                    "reads": (d,) if has_d else (),
                    "acquires": (e,) if has_e else (),
                    "releases": self._at(self.d, fwd, d),
                },
            ),
            (COMM, f"combine.{tag}", {"reads": (e,) if has_e else (), "releases": self._at(self.e, fwd, e)}),
        ]

    def backward_ops(self, p: Pass, layer: int) -> list[tuple[str, str, dict] | None]:
        gen = 1 if self.recompute else 0
        d: Acq = ("dispatch", p.chunk, p.microbatch, layer, gen)
        e: Acq = ("expert", p.chunk, p.microbatch, layer, gen)
        ops: list[tuple[str, str, dict] | None] = [
            (COMM, "combine.bwd", {"releases": self._at(self.e, ReleasePoint.BACKWARD, e)}),
            (COMPUTE, "experts.bwd", {"releases": self._at(self.d, ReleasePoint.BACKWARD, d)}),
            (COMPUTE, "experts.wgrad", {"releases": self._at(self.d, ReleasePoint.WGRAD, d)}),
            (COMM, "dispatch.bwd", {}),
        ]
        if not self.wgrad:
            ops[2] = None  # no delayed wgrad: nothing to release there, leave the op out
        return ops

    def emit(self, p: Pass, layer: int, ops: list[tuple[str, str, dict] | None]) -> None:
        for item in ops:
            if item is not None:
                self.add(item[0], item[1], p, layer, **item[2])

    def forward_layer(self, p: Pass, layer: int) -> None:
        self.emit(p, layer, self.forward_ops(p, layer, 0))

    def backward_layer(self, p: Pass, layer: int) -> None:
        if self.recompute:
            self.emit(p, layer, self.forward_ops(p, layer, 1))
        self.emit(p, layer, self.backward_ops(p, layer))

    def pair(self, f: Pass, fl: int, b: Pass, bl: int) -> None:
        if self.recompute:
            self.emit(b, bl, self.forward_ops(b, bl, 1))
        fo = self.forward_ops(f, fl, 0)
        bo = self.backward_ops(b, bl)
        # TransformerLayerSchedulePlan.run: combine.bwd, experts.bwd, dispatch.fwd, experts.wgrad,
        # dispatch.bwd, experts.fwd, combine.fwd
        order = [(b, bl, bo[0]), (b, bl, bo[1]), (f, fl, fo[0]), (b, bl, bo[2]), (b, bl, bo[3])]
        order += [(f, fl, fo[1]), (f, fl, fo[2])]
        for p, layer, item in order:
            if item is not None:
                self.add(item[0], item[1], p, layer, **item[2])


def expand(steps: Sequence[Step], layers_per_chunk: Sequence[int], rules: Mapping[str, ReleaseRule]) -> list[Op]:
    """The stream operations of ``steps`` with ``layers_per_chunk[c]`` MoE layers in chunk ``c``.

    ``rules`` holds the buffers on a ring (``dispatch``/``expert``); a buffer not in it is not tracked.
    A refused rule must be filtered out by the caller.
    """
    b = _Builder(rules)
    for i, step in enumerate(steps):
        b.step = i
        f, bw = step.forward, step.backward
        nf = layers_per_chunk[f.chunk] if f is not None else 0
        nb = layers_per_chunk[bw.chunk] if bw is not None else 0
        both = min(nf, nb)
        for k in range(both):
            b.pair(f, k, bw, nb - 1 - k)  # type: ignore[arg-type]
        for k in range(both, nb):
            b.backward_layer(bw, nb - 1 - k)  # type: ignore[arg-type]
        for k in range(both, nf):
            b.forward_layer(f, k)  # type: ignore[arg-type]
    return b.ops
