"""The demo's orchestration: every analysis end to end over recorded sweeps, no GPU needed.

For the recordings in ``examples/`` (sweep folders as written by ``bufreuse sweep``) this runs,
in order: a snapshot report of every allocator snapshot, the sweep table and its
plots, and ``compare control feature`` with its plots, and writes everything as text, JSON, CSV
and PNG into one output folder::

    <out>/snapshots.txt, snapshots.json            snapshot-report of every snapshot file
    <out>/snapshots/<file>.png                     its reserved / allocated / active timeline
    <out>/<sweep>/sweep-table.{txt,json,csv}       analysis.runs.sweep_rows rows
    <out>/<sweep>/reserved_vs_slots.png, step_time_vs_slots.png
    <out>/<sweep>/compare.{txt,json,csv}, compare-{memory,throughput,iterations}.png
    <out>/summary.txt, summary.json                what the demo found, in a few lines

The time goes into loading the snapshots and drawing the plots. Imports no torch. ``bufreuse demo``
(:mod:`bufreuse.cli.demo`) prints the summary.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bufreuse.analysis.render.compare_tables import comparison_text
from bufreuse.analysis.render.export import csv_text, json_ready, png_bytes, renderable_text
from bufreuse.analysis.render.plots import comparison_figures, sweep_figures, timeline_figure
from bufreuse.analysis.render.snapshot_tables import file_renderable, snapshots_table
from bufreuse.analysis.render.sweep_tables import sweep_table
from bufreuse.analysis.runs.compare import ComparisonResult, compare_runs
from bufreuse.analysis.runs.record import MIB
from bufreuse.analysis.runs.resolve import resolve_runs
from bufreuse.analysis.runs.sweep_rows import load_sweep_rows
from bufreuse.analysis.snapshot.batch import analyze_file
from bufreuse.analysis.snapshot.report import ReportConfig
from bufreuse.errors import InputError
from bufreuse.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text
from bufreuse.sweepdir import SweepDir

__all__ = ["DEFAULT_DEMO_OUT", "DemoResult", "default_examples_dir", "find_sweeps", "run_demo"]

DEFAULT_DEMO_OUT = Path("bufreuse-demo")
_SNAPSHOT_SUFFIXES = (".pickle", ".pickle.gz", ".pkl", ".pkl.gz")
StepFn = Callable[[str], None]


@dataclass(kw_only=True, slots=True)
class DemoResult:
    """What the demo read and wrote; ``summary`` is what the CLI prints."""

    out: Path
    examples: Path
    sweeps: list[str] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)


def default_examples_dir() -> Path:
    """``./examples`` if it holds a sweep, else the ``examples/`` folder of a source checkout of bufreuse."""
    local = Path("examples")
    if local.is_dir() and any(local.rglob(SweepDir.MANIFEST)):
        return local
    return Path(__file__).resolve().parents[1] / "examples"


def find_sweeps(folder: str | os.PathLike[str]) -> list[SweepDir]:
    """Sweep folders at or below ``folder`` (a folder with a ``manifest.json``), sorted by path."""
    base = Path(folder)
    if not base.is_dir():
        raise InputError(f"{base}: no such examples folder (pass --examples DIR)")
    found = sorted({p.parent for p in base.rglob(SweepDir.MANIFEST)})
    return [SweepDir(p) for p in found]


def run_demo(
    examples: str | os.PathLike[str], out: str | os.PathLike[str] = DEFAULT_DEMO_OUT, *, step: StepFn | None = None
) -> DemoResult:
    """Run every analysis over the sweeps and snapshots under ``examples``; write into ``out``."""
    examples, out = Path(examples), Path(out)
    sweeps = find_sweeps(examples)
    if not sweeps:
        raise InputError(f"{examples}: no recorded sweep (no manifest.json) to run the demo on")
    note = step or (lambda _msg: None)
    result = DemoResult(out=out, examples=examples)

    note("snapshot reports")
    snapshots = sorted(p for p in examples.rglob("*") if p.is_file() and p.name.endswith(_SNAPSHOT_SUFFIXES))
    result.snapshots, files = _snapshot_outputs(snapshots, examples, out)
    result.files.extend(files)

    for sweep in sweeps:
        name = sweep.folder.relative_to(examples).as_posix() if sweep.folder != examples else sweep.folder.name
        result.sweeps.append(name)
        folder = out / name.replace("/", "__")
        run = run_title(sweep, name)
        note(f"sweep table: {name}")
        result.files.extend(_sweep_outputs(sweep, folder, name, result.summary, run))
        note(f"compare control feature: {name}")
        result.files.extend(_compare_outputs(sweep, folder, name, result.summary, run))
    for snap in result.snapshots:
        if "error" in snap:
            result.summary.append(f"snapshot {snap['file']}: unreadable: {snap['error']}")
            continue
        result.summary.append(
            f"snapshot {snap['file']}: max reserved (traced steps) {_mib(snap.get('max_reserved_bytes'))} MiB, "
            f"pending-free at max active {_mib(snap.get('pending_free_at_max_active_bytes'))} MiB"
        )
    result.files.append(atomic_write_text(out / "summary.txt", "\n".join(result.summary) + "\n"))
    result.files.append(
        atomic_write_json(
            out / "summary.json",
            json_ready(
                {
                    "examples": str(examples),
                    "sweeps": result.sweeps,
                    "summary": result.summary,
                    "files": [str(p) for p in result.files],
                }
            ),
        )
    )
    return result


def run_title(sweep: SweepDir, name: str) -> str:
    """``name: proxy, 32768 tokens x 4096 hidden, 8 experts top-2, bf16, NVIDIA H200`` from the manifest
    and the first finished run's environment (what a figure's title names)."""
    try:
        p = sweep.read_manifest().get("params") or {}
    except (OSError, ValueError, InputError):
        p = {}
    if not isinstance(p, dict):
        p = {}
    parts = [str(p["workload"])] if p.get("workload") else []
    if p.get("tokens") and p.get("hidden"):
        parts.append(f"{p['tokens']} tokens x {p['hidden']} hidden")
    if p.get("local_experts"):
        parts.append(f"{p['local_experts']} experts" + (f" top-{p['topk']}" if p.get("topk") else ""))
    if p.get("dtype"):
        parts.append(str(p["dtype"]))
    for cid in sweep.config_ids():
        m = sweep.paths(cid).read_metrics()
        env = m.get("env") if isinstance(m, dict) and m.get("status") == "ok" else None  # refused runs: not named
        if isinstance(env, dict) and env.get("gpu"):
            ranks = env.get("world_size")
            many = isinstance(ranks, int) and not isinstance(ranks, bool) and ranks > 1
            parts.append(str(env["gpu"]) + (f" x{ranks}" if many else ""))
            break
    return f"{name}: {', '.join(parts)}" if parts else name


def _snapshot_outputs(paths: list[Path], base: Path, out: Path) -> tuple[list[dict[str, Any]], list[Path]]:
    """``snapshot-report`` over every file: JSON reports, the report text, a timeline PNG per file."""
    if not paths:
        return [], []
    config = ReportConfig(timeline_points=600)
    reports: list[dict[str, Any]] = []
    renderables: list[Any] = []
    files: list[Path] = []
    for path in paths:
        name = path.relative_to(base).as_posix()
        res = analyze_file(str(path), config)
        if res.report is None:  # one bad recording must not hide the others
            reports.append({"file": name, "error": res.error or "unreadable"})
            continue
        report = {**res.report, "file": name}
        reports.append(report)
        renderables.append(file_renderable(report))
        if res.timeline is not None:
            png = out / "snapshots" / (_strip_snapshot_suffix(name).replace("/", "__") + ".png")
            reserved = _mib(report["max_reserved_bytes"])
            title = f"{name} (device {report['device']}): max reserved (traced steps) {reserved} MiB"
            files.append(atomic_write_bytes(png, png_bytes(timeline_figure(res.timeline, title=title))))
    text = renderable_text(snapshots_table(reports)) + "".join(renderable_text(r) for r in renderables)
    files.insert(0, atomic_write_json(out / "snapshots.json", json_ready(reports)))
    files.insert(1, atomic_write_text(out / "snapshots.txt", text))
    return reports, files


def _strip_snapshot_suffix(name: str) -> str:
    """``a.v2/slots0/snapshot.pickle.gz`` -> ``a.v2/slots0/snapshot`` (dots in folder names kept)."""
    for suffix in sorted(_SNAPSHOT_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _sweep_outputs(sweep: SweepDir, folder: Path, name: str, summary: list[str], run: str) -> list[Path]:
    rows = load_sweep_rows(sweep.folder)
    dicts = [r.to_dict() for r in rows]
    files = [
        atomic_write_text(folder / "sweep-table.txt", renderable_text(sweep_table(rows, title=f"sweep {name}"))),
        atomic_write_json(folder / "sweep-table.json", json_ready(dicts)),
        atomic_write_text(folder / "sweep-table.csv", csv_text(dicts)),
        *(atomic_write_bytes(folder / file, png_bytes(fig)) for file, fig in sweep_figures(rows, run=run).items()),
    ]
    ok = [r for r in rows if r.status == "ok"]
    control = next((r for r in ok if r.mode == "control"), None)
    for r in ok:
        if r is control or control is None or r.max_reserved_bytes is None or not control.max_reserved_bytes:
            continue
        step = f", step {r.step_delta_pct:+.1f}%" if r.step_delta_pct is not None else ""
        summary.append(
            f"{name}: {r.config_id} peak reserved (whole process) {_mib(r.max_reserved_bytes)} MiB vs control "
            f"{_mib(control.max_reserved_bytes)} MiB ({(r.max_reserved_bytes / control.max_reserved_bytes - 1):+.0%})"
            f"{step}"
        )
    bad = [f"{r.config_id} {r.status}" for r in rows if r.status != "ok"]
    if bad:
        summary.append(f"{name}: not ok: {', '.join(bad)}")
    return files


def _compare_outputs(sweep: SweepDir, folder: Path, name: str, summary: list[str], run: str) -> list[Path]:
    try:
        result = _compare_in(sweep)
    except InputError as e:
        summary.append(f"{name}: compare skipped: {e}")
        return []
    files = [
        atomic_write_text(folder / "compare.csv", csv_text(result.to_rows())),
        atomic_write_json(folder / "compare.json", json_ready(result.to_dict())),
        atomic_write_text(folder / "compare.txt", comparison_text(result)),
        *(
            atomic_write_bytes(folder / file, png_bytes(fig))
            for file, fig in comparison_figures(result, run=run).items()
        ),
    ]
    for comp in result.comparisons:
        verdicts = ", ".join(
            f"{m.title} {m.delta_pct:+.1f}% {m.verdict}"
            for m in comp.metrics
            if m.delta_pct is not None and m.metric in ("max_reserved_mib", "step_ms_median", "tflops_median")
        )
        summary.append(f"{name}: compare {comp.label} vs {result.baseline}: {verdicts or comp.status}")
    return files


def _compare_in(sweep: SweepDir) -> ComparisonResult:
    """``compare control feature`` resolved inside this sweep (not the latest under a root)."""
    ids = sweep.config_ids()
    control = "slots0" if "slots0" in ids else next((c for c in ids if c.startswith("slots0")), None)
    if control is None:
        raise InputError(f"{sweep.folder}: no control configuration (slots0)")
    graph = control.endswith("-graph")
    feature = [c for c in ids if not c.startswith("slots0") and c.endswith("-graph") == graph]
    finished = [c for c in feature if sweep.paths(c).read_metrics() is not None]
    if not finished:
        raise InputError(f"{sweep.folder}: no finished feature configuration")
    runs = resolve_runs([str(sweep.folder / c) for c in [control, *finished]])
    for run in runs[1:]:
        run.named = False  # the whole sweep: a failed run stays a labelled row of it
    return compare_runs(runs)


def _mib(v: Any) -> str:
    return f"{v / MIB:,.0f}" if isinstance(v, int | float) else "—"
