"""A slot sweep's results as rows: one :class:`SweepRow` per configuration, deltas against the controls.

Rows come from each configuration's ``metrics.json`` (``bufreuse.sweepdir``). Deltas compare with
the control of the same kind: ``slots0`` for eager configurations, ``slots0-graph`` for CUDA-graph
ones. ``bufreuse sweep`` and ``bufreuse demo`` render the same rows
(:mod:`bufreuse.analysis.render.sweep_tables`, :mod:`bufreuse.analysis.render.sweep_plots`).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from bufreuse.sweepdir import SweepDir

__all__ = ["SweepRow", "checksum_mismatches", "load_sweep_rows", "rows_from_metrics"]


@dataclass(kw_only=True, slots=True)
class SweepRow:
    """One configuration's figures (None where the run did not produce them)."""

    config_id: str
    mode: str
    """control, stream-ordered or ring."""
    slots: int
    cuda_graph: bool
    status: str
    """ok, failed, hung, timeout, cancelled, or pending (no metrics.json yet)."""
    max_reserved_bytes: int | None = None
    max_allocated_bytes: int | None = None
    reserved_delta_bytes: int | None = None
    """Max reserved minus the control's."""
    pending_free_bytes: int | None = None
    """Pending-free bytes at the max-active point of the recorded snapshot."""
    step_ms: float | None = None
    """Median step time."""
    step_p10_ms: float | None = None
    step_p90_ms: float | None = None
    step_delta_pct: float | None = None
    """Median step time vs the control's, in percent."""
    tflops: float | None = None
    checksum: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rows_from_metrics(metrics_by_id: dict[str, dict[str, Any] | None]) -> list[SweepRow]:
    """Rows from ``{config_id: metrics.json content or None}``, with deltas against the controls."""
    rows: list[SweepRow] = []
    for cid, m in metrics_by_id.items():
        cfg = _obj((m or {}).get("config"))
        graph = bool(cfg.get("cuda_graph", cid.endswith("-graph")))
        base = cid.removesuffix("-graph")
        mode = str(cfg.get("mode") or ("control" if base == "slots0" else "ring" if base.startswith("slots") else base))
        default_slots = int(base[5:]) if base.startswith("slots") and base[5:].isdigit() else 0
        slots = int(_num(cfg.get("slots")) or default_slots)
        if m is None:
            rows.append(SweepRow(config_id=cid, mode=mode, slots=slots, cuda_graph=graph, status="pending"))
            continue
        step = _obj(m.get("step_ms"))  # a hand-edited or foreign file: wrong types show as "—", not a crash
        rows.append(
            SweepRow(
                config_id=cid,
                mode=mode,
                slots=slots,
                cuda_graph=graph,
                status=str(m.get("status")),
                max_reserved_bytes=_num(m.get("max_reserved_bytes")),
                max_allocated_bytes=_num(m.get("max_allocated_bytes")),
                pending_free_bytes=_num(m.get("pending_free_at_max_active_bytes")),
                step_ms=_num(step.get("median")),
                step_p10_ms=_num(step.get("p10")),
                step_p90_ms=_num(step.get("p90")),
                tflops=_num(m.get("tflops")),
                checksum=m.get("checksum"),
                error=m.get("error"),
            )
        )
    controls = {r.cuda_graph: r for r in rows if r.mode == "control" and r.status == "ok"}
    for r in rows:
        c = controls.get(r.cuda_graph)
        if c is None or r.status != "ok":
            continue
        if r.max_reserved_bytes is not None and c.max_reserved_bytes is not None:
            r.reserved_delta_bytes = r.max_reserved_bytes - c.max_reserved_bytes
        if r.step_ms is not None and c.step_ms:
            r.step_delta_pct = 100.0 * (r.step_ms / c.step_ms - 1.0)
    return rows


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _num(value: Any) -> Any:
    """``value`` when it is a finite number (int or float, not bool), else None."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def load_sweep_rows(folder: str | os.PathLike[str], config_ids: list[str] | None = None) -> list[SweepRow]:
    """Rows of the sweep in ``folder`` (manifest order), unfinished configurations as ``pending``."""
    sweep = SweepDir(folder)
    ids = config_ids if config_ids is not None else sweep.config_ids()
    return rows_from_metrics({cid: sweep.paths(cid).read_metrics() for cid in ids})


def checksum_mismatches(rows: list[SweepRow]) -> dict[str, list[str]]:
    """``{checksum: [config ids]}`` when finished runs disagree (empty when all agree)."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r.status == "ok" and r.checksum is not None:
            groups.setdefault(r.checksum, []).append(r.config_id)
    return groups if len(groups) > 1 else {}
