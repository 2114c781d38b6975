"""``bufreuse advise``: should the rings be turned on for this run? One answer joined from the existing tools.

It reads one control snapshot once and joins what the project already computes:

- the pending-free queue at the max-active point (``snapshot-report``), split into MoE buffers
  (the built-in ``dispatch_output`` / ``expert_output`` categories, read on Python frames) and the rest;
- the slot depth of each ring: the planner's minimum (:func:`bufreuse.plan.plan_config`) when Megatron
  fields are given, else the most blocks of the site alive at once in this trace (what-if's ``min slots``);
- what-if's predicted max reserved at that depth and at depth + 2 (one slot count for every ring: the largest);
- check-config's unmet requirements (passed in as its ``to_dict()``: this layer does not import integrations);
- the Megatron flags that switch the rings on at that depth.

"Nothing to gain" is said plainly when no MoE buffer waits in the pending-free queue, or when every waiting
buffer's ring would be unused by the config (:func:`bufreuse.config.unused_rings`, the rule ``install()`` and
the planner use: all-to-all at EP = 1 for the dispatch, at EP x expert TP = 1 for the FC2 output). "Cannot
tell" when no MoE buffer is seen but some waiting blocks carry no frames (recorded without stacks, or
allocated before the trace began): what they are cannot be read, so absence is not shown. "Cannot tell" too
when the snapshot has no trace and its final state shows no MoE buffer waiting (the max-active point is
unknown), and when a run that died of out-of-memory shows none or no gain (the trace stops where it died); an
out-of-memory death is a caveat beside any verdict (the peaks are lower bounds).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bufreuse.analysis.snapshot.load import normalise
from bufreuse.analysis.snapshot.report import ReportConfig, analyze
from bufreuse.analysis.snapshot.sites import BEFORE_TRACE_SITE, NO_FRAMES_SITE
from bufreuse.analysis.snapshot.unpickle import load_pickle_file
from bufreuse.analysis.snapshot.whatif import what_if_data
from bufreuse.config import BUFFERS, BufReuseConfig, TorchAssumption, dispatch_path, unused_rings
from bufreuse.errors import InputError

__all__ = ["CATEGORY_BUFFER", "Advice", "advise", "ring_flags"]

CATEGORY_BUFFER = {"dispatch_output": "dispatch", "expert_output": "expert"}
"""Built-in snapshot category -> the bufreuse buffer key whose ring replaces it."""

DEPTH_MARGIN = 2
"""Slots above the required depth that what-if also predicts (the cost of a safety margin)."""


@dataclass(kw_only=True, slots=True)
class Advice:
    """Everything ``bufreuse advise`` prints (``to_json`` is its ``--json``)."""

    file: str
    device: int
    recording: bool
    max_active_bytes: int
    max_reserved_bytes: int
    pending_free_bytes: int
    moe_sites: list[dict[str, Any]]
    frameless: list[dict[str, Any]] = field(default_factory=list)
    """Pending-free groups at max active whose allocation frames are absent (what they are is unknown)."""
    depth: dict[str, int] = field(default_factory=dict)  # buffer key -> slots
    depth_source: str = "none"  # "planner" | "trace" | "none"
    depth_notes: list[str] = field(default_factory=list)
    predictions: list[dict[str, Any]] = field(default_factory=list)
    calibration_error: float | None = None
    unmet: list[dict[str, Any]] = field(default_factory=list)
    checked: bool = False
    flags: list[str] = field(default_factory=list)
    gain: bool = False
    verdict: str = ""
    oom_events: int = 0
    """Out-of-memory events in the trace: the run died, its peaks are lower bounds and the trace stops early."""
    caveats: list[str] = field(default_factory=list)
    """What qualifies the verdict (an out-of-memory death), stated beside it."""
    warnings: list[str] = field(default_factory=list)

    @property
    def moe_pending_bytes(self) -> int:
        return sum(s["total_bytes"] for s in self.moe_sites)

    @property
    def frameless_bytes(self) -> int:
        return sum(s["total_bytes"] for s in self.frameless)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "device": self.device,
            "recording": self.recording,
            "max_active_bytes": self.max_active_bytes,
            "max_reserved_bytes": self.max_reserved_bytes,
            "pending_free_at_max_active_bytes": self.pending_free_bytes,
            "moe_pending_free_at_max_active_bytes": self.moe_pending_bytes,
            "moe_sites": self.moe_sites,
            "frameless_pending_free_at_max_active_bytes": self.frameless_bytes,
            "depth": {"source": self.depth_source, "slots": self.depth, "notes": self.depth_notes},
            "what_if": {"model_calibration_error": self.calibration_error, "predictions": self.predictions},
            "check_config": None if not self.checked else {"ok": not self.unmet, "unmet": self.unmet},
            "flags": self.flags,
            "gain": self.gain,
            "verdict": self.verdict,
            "oom_events": self.oom_events,
            "caveats": self.caveats,
            "warnings": self.warnings,
        }


def ring_flags(depth: Mapping[str, int]) -> list[str]:
    """The Megatron arguments (``bufreuse.config.add_arguments``) that put ``depth[buffer]`` slots on each ring."""
    out = []
    if "dispatch" in depth:
        out += [
            "--moe-hybridep-reuse-dispatch-output-buffers",
            f"--moe-hybridep-num-dispatch-output-buffers {depth['dispatch']}",
        ]
    if "expert" in depth:
        out.append(f"--moe-hybridep-num-expert-output-buffers {depth['expert']}")
    return out


def advise(
    path: str | os.PathLike[str],
    *,
    fields: Mapping[str, Any] | None = None,
    check: Mapping[str, Any] | None = None,
    num_microbatches: int | None = None,
    torch_version: TorchAssumption | None = None,
) -> Advice:
    """Join report, planner, what-if and check-config for one control snapshot (module docstring).

    Args:
        path: a control snapshot (``record_stream`` on the MoE buffers), ideally with a trace.
        fields: flat Megatron fields of the run (``check_file.megatron_fields``), or None.
        check: ``CheckReport.to_dict()`` of the same config (``--assume-enabled``), or None.
        num_microbatches: overrides the config's microbatch count for the planner.
        torch_version: what the EP >= 2 stream rule judges by (default: the installed torch).

    Raises:
        SnapshotFormatError: the file is unreadable or malformed.
    """
    was = gc.isenabled()
    gc.disable()  # a pickle's objects form no cycles (as what-if)
    try:
        raw = load_pickle_file(path)
        data = normalise(raw, path=str(path))
        report, _ = analyze(data, ReportConfig(pending_series_points=0))
        return _join(data, raw, report, fields, check, num_microbatches, torch_version)
    finally:
        if was:
            gc.enable()


def _join(
    data: Any,
    raw: Any,
    report: dict[str, Any],
    fields: Mapping[str, Any] | None,
    check: Mapping[str, Any] | None,
    num_microbatches: int | None,
    torch_version: TorchAssumption | None = None,
) -> Advice:
    moe = [
        {k: g[k] for k in ("category", "site", "count", "size_bytes", "total_bytes", "stream")}
        for g in report["pending_free_groups_at_max_active"]
        if g["category"] in CATEGORY_BUFFER
    ]
    adv = Advice(
        file=str(data.path),
        device=report["device"],
        recording=report["recording"],
        max_active_bytes=report["max_active_bytes"],
        max_reserved_bytes=report["max_reserved_bytes"],
        pending_free_bytes=report["pending_free_at_max_active_bytes"],
        moe_sites=moe,
        frameless=[
            {k: g[k] for k in ("site", "count", "size_bytes", "total_bytes", "stream")}
            for g in report["pending_free_groups_at_max_active"]
            if g["site"] in (NO_FRAMES_SITE, BEFORE_TRACE_SITE)
        ],
        warnings=list(report["warnings"]),
        oom_events=len(report.get("oom_events") or []),
    )
    if adv.oom_events:
        adv.caveats.append(
            f"the run ran out of memory ({adv.oom_events} out-of-memory event{'s' if adv.oom_events > 1 else ''} in "
            "the trace): its max reserved and max active are lower bounds (the allocation that failed is in neither), "
            "and what the trace holds from there on is not what a full step holds"
        )
    unread = _frameless_text(adv.frameless)
    wanted = sorted({CATEGORY_BUFFER[s["category"]] for s in moe}, key=list(BUFFERS).index)
    if check is not None:
        adv.checked = True
        adv.unmet = [
            {k: r[k] for k in ("buffer", "text", "fix", "note")}
            for r in check.get("requirements", [])
            if not r["ok"] and (not wanted or r["buffer"] in wanted)
        ]
    unused = _unused(fields, wanted, torch_version=torch_version) if fields is not None else {}
    if unused and fields is not None:
        # The trace measured MoE pending-free where the EP >= 2 stream rule expects none (a torch before 2.8 whose
        # NCCL records streams, say): the measurement wins; plan as with --moe-bufreuse-keep-unused-rings.
        structural = _unused(fields, wanted, keep=True, torch_version=torch_version)
        contradicted = {b: why for b, why in unused.items() if b in wanted and b not in structural}
        if contradicted:
            for b, why in contradicted.items():
                adv.warnings.append(
                    f"{BUFFERS[b]} waits pending-free in this trace, but install() would leave its ring unused "
                    f"({why}): was the run on another torch or backend? planned with --moe-bufreuse-keep-unused-rings "
                    "(override: keep rings the stream rule leaves unused (use when a trace shows MoE pending-free the "
                    "rule does not predict))"
                )
            fields = {**fields, "moe_bufreuse_keep_unused_rings": True}
            unused = structural
    if not moe and not adv.recording:
        adv.verdict = (
            "cannot tell: the snapshot has no trace (recording was off), so the max-active point is unknown; its final "
            "state shows no MoE buffer pending free, which says nothing about the peak (record with "
            "torch.cuda.memory._record_memory_history() before the run)"
        )
        return adv
    if not moe and unread:
        adv.verdict = f"cannot tell: {unread}, so whether MoE buffers wait in the pending-free queue is unknown"
        return adv
    if unread:
        adv.warnings.append(f"{unread}: the MoE figures count only the blocks with frames and may be low")
    if not moe and adv.oom_events:
        adv.verdict = (
            "cannot tell: no MoE buffer waits in the pending-free queue at the max-active point of what ran, but the "
            "run hit an out-of-memory error, possibly before its MoE layers ran a full step (record a run that "
            "finishes, e.g. with a smaller batch)"
        )
        return adv
    if not moe:
        adv.verdict = (
            "nothing to gain here: no MoE buffer (dispatch or expert output) waits in the pending-free queue at the "
            "max-active point, so a ring would only add its own storage"
        )
        return adv
    if wanted and all(b in unused for b in wanted):
        why = "; ".join(f"{BUFFERS[b]}: {unused[b]}" for b in wanted)
        adv.verdict = (
            f"nothing to gain here: install() would use no ring on this config ({why}); what waits here would "
            "wait with the rings on too"
        )
        return adv
    if fields is not None:
        _planner_depth(adv, fields, wanted, num_microbatches, torch_version)
    if data.traces:
        _predict(adv, data, raw, wanted)
    elif not adv.depth:
        adv.depth_notes.append("no trace: what-if needs one (record with torch.cuda.memory._record_memory_history())")
    adv.flags = ring_flags(adv.depth)
    if adv.flags and fields is not None and fields.get("moe_bufreuse_keep_unused_rings"):
        adv.flags.append("--moe-bufreuse-keep-unused-rings")
    _verdict(adv)
    return adv


def _planner_depth(
    adv: Advice,
    fields: Mapping[str, Any],
    wanted: list[str],
    num_microbatches: int | None,
    torch_version: TorchAssumption | None,
) -> None:
    from bufreuse.plan import plan_config

    try:
        plan = plan_config(fields, num_microbatches=num_microbatches, assume_enabled=True, torch_version=torch_version)
    except InputError as e:
        adv.depth_notes.append(f"planner: {e}")
        return
    for b in plan.buffers:
        if b.buffer not in wanted:
            continue
        if b.unused:
            adv.depth_notes.append(f"planner: {b.ring} is not used ({b.unused})")
            continue
        if b.minimum is None:
            adv.depth_notes.append(f"planner: {b.ring} cannot be a ring ({b.rule.reason})")
            continue
        adv.depth[b.buffer] = b.minimum
    if plan.storage_line():
        adv.depth_notes.append(f"planner: {plan.storage_line()}")
    if adv.depth:
        s = plan.spec
        adv.depth_source = "planner"
        adv.depth_notes.append(
            f"planner: schedule {s.kind.value}, pp={s.pp} rank={s.rank}, {s.microbatches} microbatches, vpp={s.vpp}"
        )


def _predict(adv: Advice, data: Any, raw: Any, wanted: list[str]) -> None:
    """What-if at the depth and depth + 2; the trace's own depth when the planner gave none."""
    if not adv.depth:
        probe = what_if_data(data, raw, [1])  # for the rings' min slots (N = 1 replays only when feasible)
        rings = {CATEGORY_BUFFER[r.name]: r for r in probe.rings if r.name in CATEGORY_BUFFER}
        adv.depth = {b: max(rings[b].min_slots, 1) for b in wanted if b in rings}
        if adv.depth:
            adv.depth_source = "trace"
            planned = any(n.startswith("planner") for n in adv.depth_notes)
            hint = "the planner gave none, see above" if planned else "pass --config or --args for the planner's depth"
            adv.depth_notes.append(f"from the trace: the most blocks of each site alive at once ({hint})")
    if not adv.depth:
        return
    n = max(adv.depth.values())
    res = what_if_data(data, raw, [n, n + DEPTH_MARGIN])
    held = {CATEGORY_BUFFER[r.name]: r.min_slots for r in res.rings if r.name in CATEGORY_BUFFER}
    short = {b: held[b] for b, d in adv.depth.items() if held.get(b, 0) > d}
    if short:  # the planner's schedule holds fewer than this trace did: the ring would raise EarlyReuseError
        for b, m in short.items():
            adv.depth_notes.append(
                f"{b}: this trace holds {m} blocks at once, more than the planner's {adv.depth[b]} (is the config "
                f"this run's? check --num-microbatches); using {m}"
            )
            adv.depth[b] = m
        n = max(adv.depth.values())
        res = what_if_data(data, raw, [n, n + DEPTH_MARGIN])
    if len(set(adv.depth.values())) > 1:
        adv.depth_notes.append(f"what-if puts one slot count on every ring: {n}, the largest")
    adv.calibration_error = res.calibration_error
    adv.warnings.extend(w for w in res.warnings if w not in adv.warnings)
    control = res.calibration.max_reserved
    for p in res.predictions:
        if p.slots == 0:
            continue
        adv.predictions.append(
            {
                "slots": p.slots,
                "feasible": p.feasible,
                "max_reserved_bytes": p.max_reserved,
                "control_model_max_reserved_bytes": control,
                "change": None if p.max_reserved is None or not control else (p.max_reserved - control) / control,
                "ring_bytes": p.ring_bytes,
                "note": p.note,
            }
        )


def _verdict(adv: Advice) -> None:
    mib = adv.moe_pending_bytes / 2**20
    at = next((p for p in adv.predictions if p["feasible"]), None)
    if adv.predictions and at is None:
        adv.verdict = (
            f"rings at {adv.predictions[0]['slots']} slot(s) are too few for this trace "
            f"({adv.predictions[0]['note']}): check the schedule (--num-microbatches) before turning them on"
        )
        return
    if at is None:
        adv.gain = True
        if adv.recording:
            adv.verdict = f"{mib:,.0f} MiB of MoE buffers wait pending-free at max active; no prediction"
        else:
            adv.verdict = (
                f"{mib:,.0f} MiB of MoE buffers wait pending-free in the snapshot's final state; no trace, so the "
                "max-active point and a prediction are unknown (record with torch.cuda.memory._record_memory_history())"
            )
        return
    change = at["change"]
    adv.gain = change is not None and change < 0
    saved = (at["control_model_max_reserved_bytes"] - at["max_reserved_bytes"]) / 2**20
    if adv.gain:
        adv.verdict = (
            f"turn it on: {mib:,.0f} MiB of MoE buffers wait pending-free at max active; at {at['slots']} slot(s) "
            f"what-if predicts {saved:,.0f} MiB less max reserved ({change:+.1%})"
        )
    elif adv.oom_events:
        adv.verdict = (
            f"cannot tell: {mib:,.0f} MiB of MoE buffers wait pending-free, and what-if predicts {-saved:+,.0f} MiB "
            f"max reserved ({change:+.1%}) at {at['slots']} slot(s), but only over a run that hit an out-of-memory "
            "error (its peaks are lower bounds)"
        )
    else:
        adv.verdict = (
            f"nothing to gain here: {mib:,.0f} MiB of MoE buffers wait pending-free, but the ring storage at "
            f"{at['slots']} slot(s) costs as much: what-if predicts {-saved:+,.0f} MiB max reserved ({change:+.1%})"
        )


def _frameless_text(groups: list[dict[str, Any]]) -> str:
    """What the frameless pending-free groups are and how to record them, or "" when there are none."""
    parts = []
    for site, why in (
        (NO_FRAMES_SITE, "carry no frames (record with torch.cuda.memory._record_memory_history(stacks='python'))"),
        (BEFORE_TRACE_SITE, "were allocated before the trace began, so their frames are not in it (record with "
                            "a larger max_entries)"),
    ):  # fmt: skip
        g = [x for x in groups if x["site"] == site]
        if g:
            count, total = sum(x["count"] for x in g), sum(x["total_bytes"] for x in g)
            parts.append(f"{count} pending-free block(s) at max active ({total / 2**20:,.0f} MiB) {why}")
    return "; ".join(parts)


def _unused(
    fields: Mapping[str, Any], wanted: list[str], *, keep: bool = False, torch_version: TorchAssumption | None = None
) -> dict[str, str]:
    """``{buffer key: why}`` for the wanted buffers the config leaves unused, with their rings assumed on.

    ``keep`` takes out the EP >= 2 stream rule (``moe_bufreuse_keep_unused_rings``): what remains are the EP = 1
    and EP x ETP = 1 reasons, where there is no allocation or no second stream at all.
    """
    knobs = BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers="dispatch" in wanted,
        moe_hybridep_num_expert_output_buffers=1 if "expert" in wanted else 0,
        moe_bufreuse_keep_unused_rings=keep,
    )
    return unused_rings(fields, knobs, dispatch_path(fields), torch_version=torch_version)
