"""Resolve what the user named (labels, sweep folders, Megatron logs, snapshots) into run records.

``compare`` works on :class:`~.record.RunRecord` only, whatever the run came from:

- a sweep configuration folder (``metrics.json`` from ``bufreuse sweep``), or a label inside the
  latest sweep under the sweeps root: ``control`` (``slots0``), ``feature`` (every other
  configuration with the same ``-graph`` suffix), or any configuration id (``slots4``,
  ``stream-ordered``); a whole sweep folder stands for all its configurations;
- a Megatron run folder or log file (SLURM output), parsed by :mod:`.megatron_log`;
- a bare allocator snapshot (``.pickle``/``.pickle.gz``), read by
  :func:`bufreuse.analysis.snapshot.report_file`.

Ring sizes come from ``metrics.json`` (``ring_bytes``/``ring_slot_bytes``), from Megatron's
printed arguments (slot counts, and the slot size of the static bound that ``bufreuse.config``
computes for ``check-config`` and ``install()`` too), or from the caller (``--slot-bytes``).
"""

from __future__ import annotations

import math
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bufreuse.analysis.runs.comparability import run_config
from bufreuse.analysis.runs.hostlist import HostSet, hosts_from_names, parse_hostlist
from bufreuse.analysis.runs.itertable import IterationTable
from bufreuse.analysis.runs.megatron_log import MegatronLog, describe_dropped, parse_log, steady_mask
from bufreuse.analysis.runs.record import MIB, RunRecord
from bufreuse.config import BUFFERS, BufReuseConfig, check_field_types, static_bounds, tokens_per_microbatch
from bufreuse.errors import ConfigError, InputError, LogFormatError
from bufreuse.fsutil import read_json
from bufreuse.limits import BudgetExceededError
from bufreuse.sweepdir import ConfigPaths, SweepDir, latest_sweep

__all__ = ["resolve_runs", "snapshot_label"]

_CONFIG_NAMES = {"num_experts": "num_moe_experts"}
"""Megatron arguments whose ``TransformerConfig`` field has another name (the bound reads the field)."""
_SNAPSHOT_SUFFIXES = (".pickle", ".pickle.gz", ".pkl", ".pkl.gz")
_LOG_SUFFIXES = (".out", ".log", ".txt", ".err")


def resolve_runs(specs: list[str], *, root: str | os.PathLike[str] | None = None, warmup: int = 3) -> list[RunRecord]:
    """Turn command-line specs into run records, in order (a label may expand to several runs)."""
    if not specs:
        raise InputError("name at least two runs to compare (e.g. `bufreuse compare control feature`)")
    runs: list[RunRecord] = []
    for spec in specs:
        path = Path(spec)
        if path.exists():
            runs.extend(_from_path(path, warmup))
        else:
            runs.extend(_from_label(spec, root))
    _unique_labels(runs)
    return runs


def _from_path(path: Path, warmup: int) -> list[RunRecord]:
    if path.is_dir():
        if SweepDir(path).exists():
            sweep = SweepDir(path)
            return [_from_config(sweep.paths(cid), cid, required=False, named=False) for cid in sweep.config_ids()]
        if (path / "metrics.json").is_file() or (path / "config.json").is_file():
            return [_from_config(ConfigPaths(path), path.name)]
        return [_from_megatron_folder(path, warmup)]
    name = path.name.lower()
    if name.endswith(_SNAPSHOT_SUFFIXES):
        return [_from_snapshot(path)]
    if name == "metrics.json" or name.startswith("metrics.rank"):
        return [_from_config(ConfigPaths(path.parent), path.parent.name)]
    return [_from_megatron_log(path, warmup, label=path.stem)]


def _from_label(label: str, root: str | os.PathLike[str] | None) -> list[RunRecord]:
    if "/" in label or os.sep in label or label.lower().endswith(_LOG_SUFFIXES + _SNAPSHOT_SUFFIXES + (".json",)):
        raise InputError(f"{label}: no such file or folder")
    try:
        sweep = latest_sweep(root)
    except InputError as e:
        raise InputError(f"{label!r} is neither a path nor a label that resolves: {e}") from None
    ids = sweep.config_ids()
    control = _control_id(ids)
    if label == "control":
        if control is None:
            raise InputError(f"sweep {sweep.folder} has no control configuration (slots0)")
        chosen = [control]
    elif label == "feature":
        graph = control is not None and control.endswith("-graph")
        chosen = [c for c in ids if c != control and not c.startswith("slots0") and c.endswith("-graph") == graph]
        if not chosen:
            raise InputError(f"sweep {sweep.folder} has no feature configuration (only {', '.join(ids)})")
    elif label in ids:
        chosen = [label]
    else:
        raise InputError(
            f"unknown label {label!r}: not a path, not 'control'/'feature', "
            f"and not a configuration of {sweep.folder} ({', '.join(ids)})"
        )
    group = label == "feature"
    return [_from_config(sweep.paths(cid), cid, required=not group, named=not group) for cid in chosen]


def _control_id(ids: list[str]) -> str | None:
    if "slots0" in ids:
        return "slots0"
    return next((c for c in ids if c.startswith("slots0")), None)


def _from_config(paths: ConfigPaths, label: str, *, required: bool = True, named: bool = True) -> RunRecord:
    """One configuration; an unfinished one is an error when named alone, a ``pending`` run in a group."""
    if not paths.folder.is_dir() and required:
        raise InputError(f"{paths.folder}: no such configuration folder")
    metrics = paths.read_metrics()
    if metrics is None:
        if required:
            raise InputError(f"{paths.folder}: no finished metrics.json (run or resume the sweep first)")
        run = RunRecord(label=label, source=paths.folder, kind="sweep", status="pending", named=named)
        run.warnings.append("no metrics.json yet: still running, or never run")
        return run
    run = RunRecord(label=label, source=paths.folder, kind="sweep", status=str(metrics["status"]), named=named)
    if run.status != "ok":
        run.warnings.append(f"status {run.status}: {metrics.get('error') or 'no error message'}")
        return run
    step = _mapping(metrics, "step_ms", paths)
    values = step.get("values") or []
    if not isinstance(values, list):
        raise InputError(f"{paths.metrics}: step_ms.values is {type(values).__name__}, expected a list of ms")
    run.step_ms = [float(v) for v in values if _finite(v)]
    if not run.step_ms and _finite(step.get("median")):
        run.step_ms = [float(step["median"])]
        run.warnings.append("metrics.json has no per-step values; using the median only")
    run.tflops_value = float(metrics["tflops"]) if _finite(metrics.get("tflops")) else None
    flops = metrics.get("flops_per_step")
    if _finite(flops) and flops > 0 and run.step_ms and step.get("values"):
        # per-step throughput from the same FLOP count the runner divided by the median step time
        run.tflops = [flops / (ms * 1e9) for ms in run.step_ms if ms > 0]
    run.max_allocated_bytes = _int(metrics.get("max_allocated_bytes"))
    run.max_reserved_bytes = _int(metrics.get("max_reserved_bytes"))
    run.device_used_bytes = _int(metrics.get("device_used_bytes"))
    run.pending_free_bytes = _int(metrics.get("pending_free_at_max_active_bytes"))
    ring_bytes = _mapping(metrics, "ring_bytes", paths)
    for name, per_slot in _mapping(metrics, "ring_slot_bytes", paths).items():
        if _int(per_slot):
            run.ring_slot_bytes[name] = int(per_slot)
            run.ring_slots[name] = (_int(ring_bytes.get(name)) or 0) // int(per_slot)
    if run.ring_slot_bytes:
        run.slot_bytes_source = "metrics.json"
    env = _mapping(metrics, "env", paths)
    run.software = {key: str(env[key])[:100] for key in ("torch", "cuda") if isinstance(env.get(key), str) and env[key]}
    run.job_id = str(env["slurm_job_id"]) if env.get("slurm_job_id") else None
    run.nodes = _nodes(env.get("slurm_nodelist"), run.warnings) or _job_nodes(paths.job, run)
    if run.nodes is None and env.get("hostname") and (_int(env.get("world_size")) or 1) <= 1:
        run.nodes = hosts_from_names([str(env["hostname"])])
    return run


def _from_megatron_folder(folder: Path, warmup: int) -> RunRecord:
    candidates = sorted(p for p in folder.iterdir() if p.is_file() and p.name.lower().endswith(_LOG_SUFFIXES))
    best: tuple[int, RunRecord] | None = None
    for path in candidates:
        try:
            run = _from_megatron_log(path, warmup, label=folder.name)
        except BudgetExceededError:
            raise  # a log over a budget is refused out loud, never passed over for another file
        except LogFormatError:
            continue
        n = len(run.step_ms) + sum(run.dropped.values())
        if best is None or n > best[0]:
            best = (n, run)
    if best is None:
        raise InputError(f"{folder}: no sweep metrics and no log file with Megatron iteration lines in it")
    run = best[1]
    if run.nodes is None:
        run.nodes = _job_nodes(folder / "job.json", run)
    return run


def _from_megatron_log(path: Path, warmup: int, *, label: str) -> RunRecord:
    log = parse_log(path, memory_only=True)
    if not len(log.iterations):
        return _memory_only(path, log, label)
    rows, dropped = _steady(log, warmup)
    if not _size(rows):
        raise LogFormatError(f"{path}: no steady-state iterations: {describe_dropped(dropped, warmup=warmup)}")
    run = RunRecord(label=label, source=path, kind="megatron", dropped=dropped, warnings=list(log.warnings))
    table = log.iterations
    timed, rated = _present(table, rows, "elapsed_ms"), _present(table, rows, "tflops")
    del rows
    run.step_ms, run.step_windows = _column(log, timed, "elapsed_ms"), _column(log, timed, "window")
    run.tflops = _column(log, rated, "tflops")
    # one copy of the windows when both series have the same rows: compare holds every run's series at once
    same = timed is rated or (not isinstance(timed, slice) and not isinstance(rated, slice)
                              and np.array_equal(timed, rated))  # fmt: skip
    run.tflops_windows = run.step_windows if same else _column(log, rated, "window")
    run.step_iters = _iterations(log, timed)
    run.tflops_iters = run.step_iters if same else _iterations(log, rated)
    del timed, rated
    run.config = run_config(log.args)
    _log_common(path, log, run)
    return run


def _log_common(path: Path, log: MegatronLog, run: RunRecord) -> None:
    """What every log gives besides its iterations: memory peaks, node set, job id, ring slots."""
    for attr, target in (
        ("max_allocated_mib", "max_allocated_bytes"),
        ("max_reserved_mib", "max_reserved_bytes"),
        ("device_used_mib", "device_used_bytes"),
    ):
        peak = log.peak(attr)
        if peak is not None:
            setattr(run, target, round(peak * MIB))
    run.nodes, run.nodes_source, run.job_id = log.nodes, log.nodes_source, log.job_id
    run.software = dict(log.software)
    run.oom_events = log.oom_events
    if run.nodes is None:
        run.nodes = _job_nodes(path.parent / "job.json", run)
    _rings_from_args(log.args, run)


def _memory_only(path: Path, log: MegatronLog, label: str) -> RunRecord:
    """A log of memory reports and no iteration line (the lines people paste into issues): memory only."""
    run = RunRecord(label=label, source=path, kind="megatron", warnings=list(log.warnings), memory_only=True)
    run.config = run_config(log.args)
    _log_common(path, log, run)
    ranks = sorted({m.rank for m in log.memory if m.rank is not None})
    shown = ", ".join(str(r) for r in ranks[:8]) + (", ..." if len(ranks) > 8 else "")
    over = f"the {len(ranks)} rank(s) it reports ({shown})" if ranks else "the reports it holds (rank not printed)"
    run.warnings.insert(0, f"memory reports only, no iteration line: compared on memory; its peaks are over {over}")
    return run


def _steady(log: MegatronLog, warmup: int) -> tuple[np.ndarray | slice, dict[str, int]]:
    """The steady rows: a slice when they are one run of consecutive rows (a long log's usual case: no
    8-byte row number each), else their row numbers."""
    mask, dropped = steady_mask(log, warmup=warmup)
    count = int(np.count_nonzero(mask))
    if count:
        first = int(np.argmax(mask))
        if bool(mask[first : first + count].all()):
            return slice(first, first + count), dropped
    return np.flatnonzero(mask), dropped


def _size(rows: np.ndarray | slice) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else int(rows.size)


def _present(table: IterationTable, rows: np.ndarray | slice, name: str) -> np.ndarray | slice:
    """The ``rows`` that printed figure ``name``: ``rows`` itself when all did (the figures of a slice read
    as views), else their row numbers."""
    shown = table.present(name)[rows]
    if bool(shown.all()):
        return rows
    return (np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows)[shown]


def _iterations(log: MegatronLog, rows: np.ndarray | slice) -> Sequence[int]:
    """The iteration ending each window at ``rows``: a ``range`` when they step evenly (a log's usual case: no
    8 bytes a window kept for the span check), else the column."""
    ends = _column(log, rows, "iteration")
    if len(ends) >= 2:
        a = np.asarray(ends, dtype=np.int64)
        step = int(a[1] - a[0])
        if step > 0 and bool(np.all(np.diff(a) == step)):
            return range(int(a[0]), int(a[-1]) + 1, step)
    return ends


def _column(log: MegatronLog, rows: np.ndarray | slice, name: str) -> Sequence[Any]:
    """Column ``name`` of ``log.iterations`` at ``rows``: a read-only view for a slice (it keeps that column
    alone alive once the log goes; a window column of one value keeps nothing, and windows of 1 are left
    empty: one each), else an ``array`` of 8 bytes a value, written in place."""
    table = log.iterations
    if isinstance(rows, slice):
        view = table.column(name)[rows]
        if name == "window" and (not view.size or view.strides[0] == 0):
            one = int(view[0]) if view.size else 1
            return [] if one == 1 else np.broadcast_to(np.int64(one), view.shape)
        return view
    if name in ("window", "iteration"):
        out: array[Any] = array("q", [0]) * rows.size
        np.take(table.column(name).astype(np.int64, copy=False), rows, out=np.frombuffer(out, dtype=np.int64))
    else:
        out = array("d", [0.0]) * rows.size
        np.take(table.column(name), rows, out=np.frombuffer(out, dtype=np.float64))
    return out


def _from_snapshot(path: Path) -> RunRecord:
    from bufreuse.analysis.snapshot.batch import report_file

    report = report_file(path)
    run = RunRecord(label=snapshot_label(path), source=path, kind="snapshot")
    run.max_reserved_bytes = _int(report.get("max_reserved_bytes"))
    run.max_active_bytes = _int(report.get("max_active_bytes"))
    run.pending_free_bytes = _int(report.get("pending_free_at_max_active_bytes"))
    ooms = report.get("oom_events")
    run.oom_events = len(ooms) if isinstance(ooms, list) else 0
    run.warnings.extend(str(w) for w in report.get("warnings") or [])
    return run


def _rings_from_args(args: dict[str, str], run: RunRecord) -> None:
    """Slot counts from Megatron's printed arguments, and the slot size of the static bound.

    The bound is :func:`bufreuse.config.static_bounds`, the one ``check-config`` reports and
    ``install()`` registers, so ``compare`` explains a run's allocated delta with the same bytes.
    """
    cfg = _typed_args(args)
    try:
        knobs = BufReuseConfig.from_mapping(cfg)
    except ConfigError as e:
        run.warnings.append(f"bufreuse arguments in the log: {e}")
        return
    for key, name in BUFFERS.items():
        if knobs.slots(key):
            run.ring_slots[name] = knobs.slots(key)
    path = _dispatch_path(cfg)
    if not run.ring_slots or path is None:
        return
    try:  # a printed size that is no number (markup, U+FFFD glued to it, inf): no bound, said so
        check_field_types(cfg, "Megatron arguments in the log")
    except ConfigError as e:
        run.warnings.append(f"{e}; ring slot bytes not derived")
        return
    tokens = tokens_per_microbatch(cfg, seq_length=cfg.get("seq_length"), micro_batch_size=cfg.get("micro_batch_size"))
    bounds = {BUFFERS[key]: b for key, b in static_bounds(cfg, knobs, path=path, tokens=tokens).items()}
    registered = _registered(args)
    for name, b in bounds.items():
        # enabled but not registered (an EP = 1 identity dispatch): no ring bytes. The entry's own line says
        # what install() registered in that run, and wins (runs recorded before the EP = 1 rule had a ring).
        unused = name not in registered if registered is not None else not b.slots
        if unused and isinstance(run.ring_slots.get(name), int):
            del run.ring_slots[name]
    sized = {name: b for name, b in bounds.items() if name in run.ring_slots and b.slot_bytes > 0}
    if not sized:
        return
    for name, b in sized.items():
        run.ring_slot_bytes[name] = b.slot_bytes
    shapes = {(b.rows, b.hidden, b.element_size) for b in sized.values()}
    if len(shapes) == 1:
        rows, hidden, element = shapes.pop()
        what = f"{rows} rows × {hidden} hidden × {element} B"
    else:
        what = "; ".join(f"{n} {b.rows} rows × {b.hidden} hidden × {b.element_size} B" for n, b in sized.items())
    run.slot_bytes_source = f"Megatron arguments ({what}; {next(iter(sized.values())).source})"


def _registered(args: dict[str, str]) -> set[str] | None:
    """Ring names the run's ``bufreuse-megatron: hooked ... persistent bytes`` line lists (None: no such line)."""
    from bufreuse.analysis.runs.megatron_log import REGISTERED_ARG

    text = args.get(REGISTERED_ARG)
    if text is None:
        return None
    return {part.split("=", 1)[0].strip() for part in text.split(",") if "=" in part}


def _dispatch_path(cfg: dict[str, Any]) -> str | None:
    """The dispatcher path whose static bound applies: ``alltoall``, ``hybridep`` (flex), or None."""
    kind = cfg.get("moe_token_dispatcher_type")
    if kind == "alltoall":
        return "alltoall"
    if kind == "flex" and cfg.get("moe_flex_dispatcher_backend") == "hybridep":
        return "hybridep"
    return None


def _typed_args(args: dict[str, str]) -> dict[str, Any]:
    """Megatron's printed ``name .... value`` strings as Python values, under TransformerConfig names."""
    out: dict[str, Any] = {}
    for name, text in args.items():
        key = _CONFIG_NAMES.get(name, name)
        value: Any = {"True": True, "False": False, "None": None}.get(text, text)
        if isinstance(value, str):
            for conv in (int, float):
                try:
                    value = conv(text)
                    break
                except ValueError:
                    pass
        out[key] = value
    return out


def snapshot_label(path: Path) -> str:
    """A snapshot's label: its name less the snapshot suffix (``opt-1.3b.pickle.gz`` → ``opt-1.3b``)."""
    name = path.name
    for suffix in sorted(_SNAPSHOT_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)] or name
    return path.stem or name


def _job_nodes(job_json: Path, run: RunRecord) -> HostSet | None:
    try:
        job = read_json(job_json)
    except (OSError, ValueError):
        return None
    if not isinstance(job, dict):
        return None
    run.job_id = run.job_id or (str(job["job_id"]) if job.get("job_id") else None)
    for key in ("nodelist", "node_list", "NodeList", "nodes"):
        nodes = job.get(key)
        if isinstance(nodes, list) and nodes:
            return hosts_from_names(nodes)
        if isinstance(nodes, str) and nodes:
            return _nodes(nodes, run.warnings)
    return None


def _nodes(value: Any, warnings: list[str]) -> HostSet | None:
    if not value or not isinstance(value, str):
        return None
    try:
        return parse_hostlist(value)
    except ValueError as e:
        warnings.append(str(e))
        return None


def _unique_labels(runs: list[RunRecord]) -> None:
    seen: dict[str, int] = {}
    for run in runs:
        if run.label in seen:
            seen[run.label] += 1
            run.label = f"{run.source.parent.name}/{run.label}" if run.source.parent.name else run.label
            if run.label in seen:
                run.label = f"{run.label}#{seen[run.label]}"
        seen.setdefault(run.label, 1)


def _mapping(metrics: dict[str, Any], key: str, paths: ConfigPaths) -> dict[str, Any]:
    """``metrics[key]`` as a dict (``{}`` when absent or null); another type is a bad file, not a crash."""
    value = metrics.get(key) or {}
    if not isinstance(value, dict):
        raise InputError(f"{paths.metrics}: {key} is {type(value).__name__}, expected an object (JSON {{...}})")
    return value


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> int | None:
    return int(v) if _finite(v) else None
