"""Parse Megatron-family training logs (SLURM output included) into iteration and memory records.

The line shapes, with an example each, are the table in :mod:`.grammars`: Megatron-LM of every
era (``(ms)`` and ``(s)``, with and without ``[Rank N]``), Megatron-DeepSpeed / BigScience
(``samples per second``, ``TFLOPs``), NeMo 2 / Lightning (``train_step_timing in s``),
Megatron-Bridge's ``Step Time`` line, memory fields of forks on the iteration line (ms-swift
``memory(GiB)``, Primus ``hip mem usage``; unknown ones named in a warning), ``current/average``
pairs (the current value is read), the start-up arguments block and world-size line, SLURM node
lists and cancellations. Any line prefix, ANSI
colour codes, CRLF and gzip'd files are handled; lines of several ranks may interleave.

It trusts an iteration field only when its closing ``|`` was written, and drops memory reports
from an unterminated last line, so a truncated number is never read as a value. An iteration
logged more than once keeps its most complete copy (a fragment cut by another rank's output
never replaces a complete line). One pass over the text.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from bufreuse.analysis.runs.grammars import (
    FIELDS,
    MEMORY_FIELDS,
    TIMING_ATTRS,
    clean_text,
    describe_unknown,
    grammar,
)
from bufreuse.analysis.runs.hostlist import HostSet, expand_hostlist, parse_hostlist
from bufreuse.analysis.runs.textfile import read_log
from bufreuse.errors import LogFormatError
from bufreuse.limits import Limits

__all__ = [
    "MAX_LOG_BYTES",
    "IterationRecord",
    "MegatronLog",
    "MemoryRecord",
    "describe_dropped",
    "expand_hostlist",
    "parse_log",
    "parse_log_text",
    "steady_iterations",
]

MAX_LOG_BYTES = Limits().max_log_bytes
"""The default ``max_log_bytes`` budget: bytes a log is read to after gzip decompression (an alias)."""

_ITER_RE = grammar("iteration").pattern
_MEM_RE = grammar("memory-rank").pattern
_MEM_NORANK_RE = grammar("memory-norank").pattern
_ARG_RE = grammar("argument").pattern
_WORLD_RE = grammar("world-size").pattern
_CAPTURE_RE = grammar("cuda-graph-capture").pattern
_NODELIST_RE = grammar("nodelist").pattern
_JOBID_RE = grammar("jobid").pattern
_FIELD_RE = re.compile(r"^\s*([^:|]+?)\s*:\s*(.+?)\s*$")  # a value with spaces is junk, named in a warning
_AFTER_RE = re.compile(r"after (\d+) iterations")
_SIZE_RE = re.compile(r"(data|tensor-model|pipeline-model|context|expert-model)-parallel[ -]size:\s*(\d+)")
_NEMO_RE = grammar("nemo-iteration").pattern
_BRIDGE_RE = grammar("bridge-step-time").pattern
_CANCEL_RE = grammar("slurm-cancelled").pattern
_FILE_JOBID_RE = re.compile(r"(?:^slurm-(\d+)|[-_](\d+))\.(?:out|err)(?:\.gz)?$|^slurm-(\d+)")
"""``slurm-NNN[.out]`` (sbatch's default) or ``name-NNN.out`` / ``name_NNN.err`` (``--output=name-%j.out``)."""
_MEM_LABEL_RE = re.compile(r"mem", re.IGNORECASE)
_MEM_VALUE_RE = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?:GB|GiB|G)?\s*(?:/|$)")


@dataclass(kw_only=True, slots=True)
class IterationRecord:
    """One logged iteration line: the averages over its logging window of ``window`` iterations."""

    iteration: int
    """Iteration number as printed (the last iteration of the logging window)."""
    total: int
    """``train_iters`` as printed."""
    elapsed_ms: float | None
    """Mean wall time per iteration over the window."""
    tflops: float | None
    """Throughput per GPU; None when the run logged none (``--log-throughput`` off)."""
    loss: float | None
    """``lm loss`` (NaN/inf kept as such; None when not printed, as Megatron does for NaN)."""
    samples_per_s: float | None = None
    skipped: int = 0
    nan: int = 0
    window: int = 1
    """Iterations the line averages over (the gap to the previous logged iteration)."""
    fields: int = 0
    """Fields read from the line (the most complete copy of a duplicated line wins)."""
    line: int = 0
    """1-based line number in the log, for messages."""
    memory_mib: dict[str, float] = field(default_factory=dict)
    """Memory fields of the line (:data:`~.grammars.MEMORY_FIELDS`) by :class:`MemoryRecord` attribute, in MiB."""

    @property
    def clean(self) -> bool:
        """True when the window had no skipped or NaN iteration and a finite (or absent) loss."""
        return self.skipped == 0 and self.nan == 0 and (self.loss is None or math.isfinite(self.loss))


@dataclass(kw_only=True, slots=True)
class MemoryRecord:
    """One ``... memory (MB)`` report; values in MiB as printed."""

    rank: int | None
    """``[Rank N]``; None for the 2020 shape printed without it."""
    label: str
    after_iterations: int | None
    allocated_mib: float
    max_allocated_mib: float
    reserved_mib: float
    max_reserved_mib: float
    device_used_mib: float | None = None
    line: int = 0


@dataclass(kw_only=True, slots=True)
class MegatronLog:
    """Everything the compare step needs from one log file."""

    source: str
    iterations: list[IterationRecord] = field(default_factory=list)
    """One record per iteration number, in log order (duplicates from several ranks merged)."""
    memory: list[MemoryRecord] = field(default_factory=list)
    capture_iteration: int | None = None
    """First iteration logged after a CUDA-graph capture message (its time includes the capture)."""
    args: dict[str, str] = field(default_factory=dict)
    """Megatron's printed ``arguments`` block (and world-size line), raw strings."""
    nodes: HostSet | None = None
    job_id: str | None = None
    partial_last_line: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def node_list(self) -> list[str] | None:
        """The node names when the node set is known and small enough to expand."""
        return list(self.nodes.hosts) if self.nodes is not None and self.nodes.hosts is not None else None

    def peak(self, attr: str) -> float | None:
        """Maximum of a :class:`MemoryRecord` attribute over every rank and report.

        Without any such report, the same figure from iteration lines' memory fields (ms-swift, Primus).
        """
        values = [getattr(m, attr) for m in self.memory if getattr(m, attr) is not None]
        if not values:
            values = [r.memory_mib[attr] for r in self.iterations if attr in r.memory_mib]
        return max(values) if values else None


def _number(text: str) -> float | None:
    t = text.strip().rstrip(",").lower()
    if t in ("nan", "-nan", "+nan"):
        return math.nan
    if t in ("inf", "+inf", "infinity"):
        return math.inf
    if t in ("-inf", "-infinity"):
        return -math.inf
    try:
        return float(t)
    except ValueError:
        return None


_COUNT_ATTRS = ("skipped", "nan")


def _is_count(value: float) -> bool:
    """A finite whole number >= 0: what a skipped / nan iterations field must hold to count."""
    return math.isfinite(value) and value >= 0 and value == int(value)


def _iterations(
    line: str,
    lineno: int,
    pairs: list[int],
    odd_fields: list[str],
    *,
    terminated: bool = True,
    fallback: dict[str, float] | None = None,
    unknown_memory: dict[str, None] | None = None,
) -> list[IterationRecord]:
    """Every iteration record on ``line`` (two ranks' lines can share one); ``pairs`` counts current/average.

    A known field with no usable value (markup or U+FFFD glued to the number, a count that is
    ``nan``, ``inf``, ``-1`` or ``2.5``) is dropped and named in ``odd_fields``. A NeMo line's last
    field (no closing ``|``) is read when the line is complete. ``fallback`` (Megatron-Bridge's
    ``Step Time`` line) fills timing the line does not print; memory-like labels that are not in
    :data:`MEMORY_FIELDS` are collected in ``unknown_memory``.
    """
    matches = list(_ITER_RE.finditer(line))
    nemo_at = {nm.start(1) for nm in _NEMO_RE.finditer(line)} if "Training epoch" in line else set()
    out = []
    for k, m in enumerate(matches):
        end = matches[k + 1].start() if k + 1 < len(matches) else len(line)
        # Megatron ends every field with " |": the piece after the last "|" is cut or foreign.
        pieces = line[m.end() : end].split("|")
        if not (m.start() in nemo_at and terminated and k + 1 == len(matches)):
            pieces = pieces[:-1]
        values: dict[str, float] = {}
        memory: dict[str, float] = {}
        for piece in pieces:
            fm = _FIELD_RE.match(piece)
            if not fm:
                continue
            label = fm.group(1)
            if (mspec := MEMORY_FIELDS.get(label)) is not None:
                if (vm := _MEM_VALUE_RE.match(fm.group(2))) is not None and math.isfinite(float(vm.group(1))):
                    memory[mspec.attr] = float(vm.group(1)) * mspec.scale
                else:
                    odd_fields.append(f"line {lineno}: {label!r} is {fm.group(2)[:40]!r}")
                continue
            if (spec := FIELDS.get(label)) is None:
                if unknown_memory is not None and _MEM_LABEL_RE.search(label) and len(unknown_memory) < 50:
                    unknown_memory[label] = None
                continue
            text = printed = fm.group(2)
            if "/" in text:  # ``current/average``: the window's own value is the current one
                text = text.partition("/")[0]
                pairs[0] += 1
            value = _number(text)
            if value is None or (spec.attr in _COUNT_ATTRS and not _is_count(value)):
                odd_fields.append(f"line {lineno}: {spec.label!r} is {printed[:40]!r}")
            else:
                values[spec.attr] = value * spec.scale
        for attr, v in (fallback or {}).items():
            values.setdefault(attr, v)
        if not any(a in values for a in TIMING_ATTRS):
            continue
        out.append(
            IterationRecord(
                iteration=int(m.group(1)),
                total=int(m.group(2)),
                elapsed_ms=values.get("elapsed_ms"),
                tflops=values.get("tflops"),
                loss=values.get("loss"),
                samples_per_s=values.get("samples_per_s"),
                skipped=int(values.get("skipped", 0)),
                nan=int(values.get("nan", 0)),
                fields=len(values) + len(memory),
                line=lineno,
                memory_mib=memory,
            )
        )
    return out


def _memory(line: str, lineno: int) -> list[MemoryRecord]:
    out = []
    for m in _MEM_RE.finditer(line):
        after = _AFTER_RE.search(m.group(2))
        out.append(_mem_record(int(m.group(1)), m.group(2).strip("() "), after, m, 3, lineno))
    if not out and "[Rank" not in line:
        for m in _MEM_NORANK_RE.finditer(line):
            out.append(_mem_record(None, m.group(1), _AFTER_RE.search(m.group(1)), m, 3, lineno))
    return out


def _mem_record(
    rank: int | None, label: str, after: re.Match[str] | None, m: re.Match[str], g: int, lineno: int
) -> MemoryRecord:
    return MemoryRecord(
        rank=rank,
        label=label,
        after_iterations=int(after.group(1)) if after else None,
        allocated_mib=float(m.group(g)),
        max_allocated_mib=float(m.group(g + 1)),
        reserved_mib=float(m.group(g + 2)),
        max_reserved_mib=float(m.group(g + 3)),
        device_used_mib=float(m.group(g + 4)) if m.group(g + 4) else None,
        line=lineno,
    )


REGISTERED_ARG = "bufreuse_registered_bytes"
"""Pseudo-argument holding the entry's ``persistent bytes`` list (``name=bytes, ...``), when the log has it."""


def parse_log_text(text: str, *, source: str = "<text>") -> MegatronLog:
    """Parse the text of one Megatron log.

    Raises:
        LogFormatError: empty, or no iteration line (the message says what was looked for and found).
    """
    return _parse([text], source=source)


def _parse(box: list[str], *, source: str) -> MegatronLog:
    """Parse the text ``box`` holds, taking it out of the box: once split into lines the text is dropped,
    and each line once read, so a large log is held about once (not as text, cleaned text and lines)."""
    log = MegatronLog(source=source)
    text = box.pop()
    if not text or text.isspace():
        raise LogFormatError(f"{source}: empty log")
    text = clean_text(text)
    log.partial_last_line = not text.endswith(("\n", "\r"))
    head = text[:4096]  # for the "no iteration lines" message (binary data?)
    lines: list[str | None] = text.splitlines()  # type: ignore[assignment]
    del text
    n_lines = len(lines)
    unread: list[str] = []  # lines with no iteration record: what that message describes when none had one
    by_iteration: dict[int, IterationRecord] = {}
    conflicts: set[int] = set()
    capture_pending = False
    pairs, odd_memory, odd_fields = [0], [], []
    unknown_memory: dict[str, None] = {}
    bridge: dict[str, float] | None = None  # Megatron-Bridge's Step Time line, for the next iteration line
    for i in range(1, n_lines + 1):
        line, lines[i - 1] = lines[i - 1], None  # read once: the list holds no text behind the cursor
        terminated = i < n_lines or not log.partial_last_line
        records = (
            _iterations(line, i, pairs, odd_fields, terminated=terminated, fallback=bridge,
                        unknown_memory=unknown_memory)
            if "iteration" in line
            else []
        )  # fmt: skip
        if records:
            bridge = None
        elif not by_iteration:
            unread.append(line)
        for rec in records:
            old = by_iteration.get(rec.iteration)
            if old is not None:
                if (old.elapsed_ms, old.tflops) != (rec.elapsed_ms, rec.tflops) and old.fields == rec.fields:
                    conflicts.add(rec.iteration)
                if old.fields > rec.fields:
                    continue  # a fragment never replaces a more complete copy
                del by_iteration[rec.iteration]
            by_iteration[rec.iteration] = rec
            if capture_pending:
                log.capture_iteration = rec.iteration
                capture_pending = False
        if records:
            continue
        if "memory (MB)" in line:
            found = _memory(line, i)
            if terminated:
                log.memory.extend(found)
                if not found:
                    odd_memory.append(i)
            elif found:
                log.warnings.append(f"line {i}: memory report on the unterminated last line ignored")
            continue
        if "Step Time" in line and (bm := _BRIDGE_RE.search(line)):
            bridge = {"elapsed_ms": float(bm.group(1)) * 1000.0, "tflops": float(bm.group(2))}
            continue
        if "CANCELLED" in line and (cm := _CANCEL_RE.search(line)):
            why = " ".join(cm.group(4).split())
            log.warnings.append(
                f"line {i}: the job was cancelled at {cm.group(3)}{' ' + why.lower() if why else ''} "
                "(slurmstepd): the run did not finish"
            )
            continue
        if _CAPTURE_RE.search(line) and "validation" not in line.lower():
            capture_pending = True
            continue
        if "bufreuse-megatron: hooked" in line and "persistent bytes" in line:
            # what install() registered in this run (the ring bytes compare explains the allocated delta with)
            log.args.setdefault(REGISTERED_ARG, line.split("persistent bytes", 1)[1].split(";", 1)[0].strip())
            continue
        if " ..." in line and (am := _ARG_RE.search(line)):
            log.args.setdefault(am.group(1), am.group(2))
            continue
        if "using world size" in line and (wm := _WORLD_RE.search(line)):
            log.args.setdefault("world_size", wm.group(1))
            for name, value in _SIZE_RE.findall(line, wm.end()):  # the first of a name wins (not encoder-...)
                log.args.setdefault(name.replace("-", "_") + "_parallel_size", value)
            continue
        if log.nodes is None and (nm := _NODELIST_RE.search(line)):
            try:
                log.nodes = parse_hostlist(nm.group(1))
            except ValueError as e:
                log.warnings.append(f"line {i}: {e}")
        if log.job_id is None and (jm := _JOBID_RE.search(line)):
            log.job_id = jm.group(1)
    log.iterations = sorted(by_iteration.values(), key=lambda r: r.line)
    _set_windows(log)
    if conflicts:
        shown = ", ".join(str(c) for c in sorted(conflicts)[:5])
        log.warnings.append(f"iterations logged more than once with different values (kept the last): {shown}")
    if pairs[0]:
        log.warnings.append("fields printed as current/average: the current value (the window's own) is read")
    if odd_memory:
        log.warnings.append(
            f"{len(odd_memory)} 'memory (MB)' line(s) in no known shape ignored (first: line {odd_memory[0]})"
        )
    if odd_fields:
        log.warnings.append(
            f"{len(odd_fields)} iteration field(s) with no usable value ignored (a count must be a whole number"
            f" >= 0; first: {odd_fields[0]})"
        )
    if unknown_memory:
        log.warnings.append(
            "memory field(s) on iteration lines not read (meaning unknown): "
            + ", ".join(repr(x) for x in list(unknown_memory)[:8])
        )
    if capture_pending:
        log.warnings.append("CUDA-graph capture message with no iteration logged after it")
    if log.job_id is None and (fm := _FILE_JOBID_RE.search(os.path.basename(source))):
        log.job_id = next(g for g in fm.groups() if g)
    if not log.iterations:
        binary = "\x00" in head or head[:1] == "\ufffd"
        what = describe_unknown(head if binary else "\n".join(unread))
        raise LogFormatError(f"{source}: no Megatron iteration lines: {what}")
    return log


def _set_windows(log: MegatronLog) -> None:
    """Each record's window: the iterations its line averages over.

    Megatron averages a line over the ``log_interval`` iterations before it, so a gap longer than
    the interval (lines cut out of the log, ``[...]``, or lost) still weighs one interval. With
    ``log_interval`` printed, windows are ``min(gap, log_interval)``; without it, the most common
    gap stands in, and the longer gaps are named in a warning.
    """
    ordered = sorted(log.iterations, key=lambda r: r.iteration)
    if not ordered:
        return
    gaps = [b.iteration - a.iteration for a, b in itertools.pairwise(ordered)]
    try:
        interval = int(log.args.get("log_interval", ""))
        known = interval >= 1
    except ValueError:
        known = False
    if not known:
        interval = max(sorted(set(gaps)), key=gaps.count) if gaps else 1
    interval = max(1, interval)
    ordered[0].window = max(1, min(ordered[0].iteration, interval))
    long = 0
    for rec, gap in zip(ordered[1:], gaps, strict=True):
        rec.window = max(1, min(gap, interval))
        long += gap > interval
    if long:
        src = f"log_interval is {interval}" if known else f"log_interval is not printed; the usual gap is {interval}"
        log.warnings.append(
            f"{long} iteration line(s) follow a gap longer than the logging interval (lines elided or lost; "
            f"{src}): each weighs {interval} iteration(s), not its gap"
        )


def parse_log(path: str | os.PathLike[str]) -> MegatronLog:
    """Read and parse one log file, plain or gzip'd (undecodable bytes replaced, never fatal)."""
    p = Path(path)
    try:
        text, cut = read_log(p)  # streamed, bounded, FIFOs refused (textfile)
    except FileNotFoundError:
        raise LogFormatError(f"{p}: no such log file") from None
    except IsADirectoryError:
        raise LogFormatError(f"{p}: is a folder, not a log file") from None
    except OSError as e:
        raise LogFormatError(f"{p}: cannot read ({e.strerror})") from None
    box = [text]
    del text  # _parse takes it out of the box: no second reference while the lines are parsed
    log = _parse(box, source=str(p))
    if cut:
        log.warnings.insert(0, cut)
    return log


def steady_iterations(log: MegatronLog, *, warmup: int = 3) -> tuple[list[IterationRecord], dict[str, int]]:
    """The log windows that count for statistics, and how many were dropped for which reason.

    ``warmup`` counts iterations, not log lines: a window that overlaps the first ``warmup``
    iterations of the log is dropped whole. Also dropped: every window up to and including the one
    that captured a CUDA graph, and windows with skipped/NaN iterations or a non-finite loss.
    """
    if warmup < 0:
        raise LogFormatError(f"--warmup must be >= 0, got {warmup}")
    dropped = {"warmup": 0, "before_capture": 0, "skipped_or_nan": 0}
    kept: list[IterationRecord] = []
    first = min(log.iterations, key=lambda r: r.iteration, default=None)
    start = first.iteration - first.window if first is not None else 0
    for rec in log.iterations:
        if rec.iteration - rec.window < start + warmup:
            dropped["warmup"] += 1
        elif log.capture_iteration is not None and rec.iteration <= log.capture_iteration:
            dropped["before_capture"] += 1
        elif not rec.clean:
            dropped["skipped_or_nan"] += 1
        else:
            kept.append(rec)
    return kept, dropped


def describe_dropped(dropped: dict[str, int], *, warmup: int) -> str:
    """Why no window is left, in words, with the hint that applies (never a raw dict)."""
    words = {
        "warmup": f"overlap the first {warmup} iterations (--warmup)",
        "before_capture": "come before or include a CUDA-graph capture",
        "skipped_or_nan": "had skipped or NaN iterations (fp16 loss-scale skips?) or a non-finite loss",
    }
    total = sum(dropped.values())
    parts = [f"{n} {words[k]}" for k, n in dropped.items() if n]
    text = f"all {total} logged windows were dropped: " + "; ".join(parts) if parts else "no logged windows"
    if dropped.get("warmup"):
        text += " (lower --warmup?)"
    return text
