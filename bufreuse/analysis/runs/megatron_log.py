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
never replaces a complete line).

One pass over the lines as they are read (:class:`~.textfile.LogLines`): the text is never held
whole, iteration lines become rows of an :class:`~.itertable.IterationTable` (a fixed few bytes
each, at most ``max_log_iterations`` of them), and everything else kept is capped (memory reports,
arguments, repeated warnings), so reading a log needs memory bounded by the budgets, not by its size.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bufreuse.analysis.runs.grammars import (
    FIELDS,
    MEMORY_FIELDS,
    NUM,
    TIMING_ATTRS,
    UnknownLines,
    describe_unknown,
    grammar,
    strip_ansi,
)
from bufreuse.analysis.runs.hostlist import HostSet, expand_hostlist, hosts_from_names, parse_hostlist
from bufreuse.analysis.runs.itertable import IterationRecord, IterationTable
from bufreuse.analysis.runs.textfile import LogLines
from bufreuse.errors import LogFormatError
from bufreuse.limits import Limits, current

__all__ = [
    "MAX_ARGS",
    "MAX_LOG_BYTES",
    "MAX_MEMORY_RECORDS",
    "IterationRecord",
    "IterationTable",
    "MegatronLog",
    "MemoryRecord",
    "describe_dropped",
    "expand_hostlist",
    "parse_log",
    "parse_log_text",
    "steady_iterations",
    "steady_mask",
    "steady_rows",
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
_AFTER_RE = re.compile(r"after (\d+) iterations")
_SIZE_RE = re.compile(r"(data|tensor-model|pipeline-model|context|expert-model)-parallel[ -]size:\s*(\d+)")
_NEMO_RE = grammar("nemo-iteration").pattern
_BRIDGE_RE = grammar("bridge-step-time").pattern
_CANCEL_RE = grammar("slurm-cancelled").pattern
_WORKERS_RE = grammar("deepspeed-workers").pattern
_WORLD_INFO_RE = grammar("deepspeed-world-info").pattern
_WORLD_INFO_HOST_RE = re.compile(r"'([^']+)'\s*:")
_PDSH_RE = grammar("pdsh-prefix").pattern
_SOFTWARE_RE = grammar("software-version").pattern
_OOM_RE = grammar("cuda-oom").pattern
_SOFTWARE_KEYS = {"torch version": "torch", "deepspeed info": "deepspeed", "torch cuda version": "cuda"}
_MAX_PDSH_HOSTS = 4096
"""Hosts kept from pdsh line prefixes (a node set larger than this is left unknown, said so)."""
_FILE_JOBID_RE = re.compile(r"(?:^slurm-(\d+)|[-_](\d+))\.(?:out|err)(?:\.gz)?$|^slurm-(\d+)")
"""``slurm-NNN[.out]`` (sbatch's default) or ``name-NNN.out`` / ``name_NNN.err`` (``--output=name-%j.out``)."""
_MEM_LABEL_RE = re.compile(r"mem", re.IGNORECASE)
_MEM_VALUE_RE = {
    "GiB": re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?:GB|GiB|G)?\s*(?:/|$)"),
    "B": re.compile(rf"^\s*({NUM})\s*$"),
}
"""A memory field's value by :attr:`FieldGrammar.unit`; group 1 is the number."""
_KNOWN_FIELD_RE = re.compile(
    r"(?:^|\|)\s*("
    + "|".join(re.escape(k) for k in sorted(FIELDS, key=len, reverse=True))
    + r")\s*:\s*([^|]+?)\s*(?=\|)"
)
"""A ``|``-closed piece whose label is one of :data:`FIELDS` (label and value stripped, as :func:`_field`)."""
_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")  # what str.splitlines splits on

MAX_MEMORY_RECORDS = 16_384
"""``memory (MB)`` reports kept as :class:`MemoryRecord` (Megatron prints one per rank, once); the rest
only raise the peaks, and a warning counts them, so a log repeating one report cannot grow without bound."""
MAX_ARGS = 10_000
"""Printed arguments kept (Megatron prints under 1,000), and at most :data:`_MAX_ARG_CHARS` characters of them."""
_MAX_ARG_CHARS = 8 << 20
_MEMORY_ATTRS = ("allocated_mib", "max_allocated_mib", "reserved_mib", "max_reserved_mib", "device_used_mib")


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
    iterations: IterationTable = field(default_factory=IterationTable)
    """One row per iteration number, in log order (duplicates from several ranks merged); reads as a
    sequence of :class:`IterationRecord` made on access, and gives whole columns (:class:`IterationTable`)."""
    memory: list[MemoryRecord] = field(default_factory=list)
    """The first :data:`MAX_MEMORY_RECORDS` memory reports (later ones only raise ``memory_overflow``)."""
    memory_overflow: dict[str, float] = field(default_factory=dict)
    """Peaks (MiB, by :class:`MemoryRecord` attribute) of the reports past :data:`MAX_MEMORY_RECORDS`."""
    capture_iteration: int | None = None
    """First iteration logged after a CUDA-graph capture message (its time includes the capture)."""
    args: dict[str, str] = field(default_factory=dict)
    """Megatron's printed ``arguments`` block (and world-size line), raw strings."""
    nodes: HostSet | None = None
    nodes_source: str | None = None
    """Where ``nodes`` came from when not a SLURM line: the DeepSpeed launcher's workers line, its world info,
    or pdsh line prefixes."""
    software: dict[str, str] = field(default_factory=dict)
    """Versions the log prints: ``torch``, ``deepspeed``, ``cuda`` (DeepSpeed's environment report, its engine)."""
    oom_events: int = 0
    """Lines saying a rank ran out of GPU memory (``CUDA out of memory``): the peaks are then lower bounds."""
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
        if attr in self.memory_overflow:
            values.append(self.memory_overflow[attr])
        return max(values) if values else self.iterations.memory_peak(attr)


def _number(text: str) -> float | None:
    try:
        return float(text)  # the usual case: what float() reads, the rest below reads the same way
    except ValueError:
        pass
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


class _Tally:
    """How often something happened and its first instance, in constant memory (for one warning)."""

    __slots__ = ("count", "first")

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None

    def append(self, item: str) -> None:
        if not self.count:
            self.first = item
        self.count += 1


def _is_count(value: float) -> bool:
    """A finite whole number >= 0: what a skipped / nan iterations field must hold to count."""
    return math.isfinite(value) and value >= 0 and value == int(value)


def _field(piece: str) -> tuple[str, str] | None:
    r"""``(label, value)`` of one ``label: value`` piece of an iteration line, both stripped; None for no field.

    The label is the text before the first ``:`` (a blank one names no field); a blank value reads as its
    last white-space character (named in a warning when the label is known). Equal to matching
    ``^\s*([^:|]+?)\s*:\s*(.+?)\s*$`` (non-blank label), by str methods: the parser's hot loop.
    """
    head, colon, tail = piece.partition(":")
    label = head.strip()
    if not colon or not label:
        return None
    value = tail.strip()
    if not value:
        if not tail:
            return None
        value = tail[-1]
    return label, value


def _iterations(
    line: str,
    lineno: int,
    pairs: list[int],
    odd_fields: _Tally,
    *,
    terminated: bool = True,
    fallback: dict[str, float] | None = None,
    unknown_memory: dict[str, None] | None = None,
    fast: bool = True,
) -> list[tuple[int, int, dict[str, float], dict[str, float]]]:
    """Every iteration record on ``line`` (two ranks' lines can share one): ``(iteration, train_iters,
    figures by IterationRecord attribute, memory fields in MiB)``; ``pairs`` counts current/average.

    A known field with no usable value (markup or U+FFFD glued to the number, a count that is
    ``nan``, ``inf``, ``-1`` or ``2.5``) is dropped and named in ``odd_fields``. A NeMo line's last
    field (no closing ``|``) is read when the line is complete. ``fallback`` (Megatron-Bridge's
    ``Step Time`` line) fills timing the line does not print; memory-like labels that are not in
    :data:`MEMORY_FIELDS` are collected in ``unknown_memory``. ``fast`` (the default) reads a segment with
    no memory-like text by :data:`_KNOWN_FIELD_RE`, with the same result as piece by piece (tested).
    """
    matches = _iteration_matches(line)
    nemo_at = {nm.start(1) for nm in _NEMO_RE.finditer(line)} if "Training epoch" in line else set()
    out = []
    for k, m in enumerate(matches):
        end = matches[k + 1].start() if k + 1 < len(matches) else len(line)
        seg = line[m.end() : end]
        last_read = m.start() in nemo_at and terminated and k + 1 == len(matches)
        found: Iterable[tuple[str, str]]
        if last_read or not fast or _MEM_LABEL_RE.search(seg):
            # Megatron ends every field with " |": the piece after the last "|" is cut or foreign.
            pieces = seg.split("|")
            if not last_read:
                pieces = pieces[:-1]
            found = (fv for piece in pieces if (fv := _field(piece)) is not None)
        else:  # no memory-like label: only FIELDS' labels fill anything, and one regex pass finds them
            found = ((fm.group(1), fm.group(2)) for fm in _KNOWN_FIELD_RE.finditer(seg))
        values, memory = _fill(found, lineno, pairs, odd_fields, unknown_memory)
        for attr, v in (fallback or {}).items():
            values.setdefault(attr, v)
        if not any(a in values for a in TIMING_ATTRS):
            continue
        out.append((int(m.group(1)), int(m.group(2)), values, memory))
    return out


def _fill(
    found: Iterable[tuple[str, str]],
    lineno: int,
    pairs: list[int],
    odd_fields: _Tally,
    unknown_memory: dict[str, None] | None,
) -> tuple[dict[str, float], dict[str, float]]:
    """``(figures by IterationRecord attribute, memory fields in MiB)`` of one record's ``(label, value)`` fields."""
    values: dict[str, float] = {}
    memory: dict[str, float] = {}
    for label, value in found:
        if (mspec := MEMORY_FIELDS.get(label)) is not None:
            vm = _MEM_VALUE_RE[mspec.unit].match(value)
            if vm is not None and 0 <= (mv := float(vm.group(1))) < math.inf:
                memory[mspec.attr] = mv * mspec.scale
            else:
                odd_fields.append(f"line {lineno}: {label!r} is {value[:40]!r}")
            continue
        if (spec := FIELDS.get(label)) is None:
            if unknown_memory is not None and len(unknown_memory) < 50 and _MEM_LABEL_RE.search(label):
                unknown_memory[label] = None
            continue
        text = value
        if "/" in text:  # ``current/average``: the window's own value is the current one
            text = text.partition("/")[0]
            pairs[0] += 1
        number = _number(text)
        if number is None or (spec.attr in _COUNT_ATTRS and not _is_count(number)):
            odd_fields.append(f"line {lineno}: {spec.label!r} is {value[:40]!r}")
        else:
            values[spec.attr] = number * spec.scale
    return values, memory


_ITER_AT = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)\s*\|")


def _iteration_matches(line: str) -> list[re.Match[str]]:
    """``_ITER_RE.finditer(line)`` as a list, found by ``str.find`` (3x faster on a long line that says
    "iteration" in its labels): ``\b`` before the word is checked by hand (a word character is
    alphanumeric or ``_``, as for ``re``)."""
    out = []
    pos = line.find("iteration")
    while pos >= 0:
        if pos == 0 or not ((c := line[pos - 1]).isalnum() or c == "_"):
            m = _ITER_AT.match(line, pos)
            if m is not None:
                out.append(m)
                pos = line.find("iteration", m.end())
                continue
        pos = line.find("iteration", pos + 1)
    return out


_SHAPES = 4
"""Iteration-line shapes tried before the general path (a log alternates between a few at most)."""
_MAX_SHAPES_LEARNED = 1000
"""Lines one log may learn a shape from: a log whose every line has its own shape stops paying for it."""


class _Shape:
    """One iteration-line shape learned from a line the general path read: a regex over the whole line.

    Logs print one shape millions of times. A line the shape's regex matches whole, with as many
    "iteration" words as the learned line, gives the record :func:`_iterations` would give (tested):
    one iteration match (no other "iteration" word can hide one), the same labels in the same pieces,
    the known ones' values read by :func:`_fill`. Learned only from single-record, non-NeMo lines with
    no memory-like text and no "iteration" outside the shape's own words.
    """

    __slots__ = ("count", "labels", "plan", "rx")

    def __init__(self, rx: re.Pattern[str], labels: list[str], count: int) -> None:
        self.rx, self.labels, self.count = rx, labels, count
        self.plan = [(FIELDS[k].attr, FIELDS[k].scale, FIELDS[k].attr in _COUNT_ATTRS) for k in labels]

    @classmethod
    def learn(cls, line: str) -> _Shape | None:
        if "Training epoch" in line or _MEM_LABEL_RE.search(line):
            return None
        matches = _iteration_matches(line)
        if len(matches) != 1:
            return None
        m = matches[0]
        *pieces, _tail = line[m.end() :].split("|")
        parts = [r"(?P<pre>.*?)iteration\s+(\d+)\s*/\s*(\d+)\s*\|"]
        labels, words = [], 1
        for piece in pieces:
            head, colon, _ = piece.partition(":")
            label = head.strip()
            if not colon:
                parts.append(r"[^|:]*\|")
            elif not label:
                parts.append(r"\s*:[^|]*\|")
            elif label in FIELDS:
                parts.append(rf"\s*{re.escape(label)}\s*:\s*([^|]+?)\s*\|")
                labels.append(label)
            else:
                parts.append(rf"\s*{re.escape(label)}\s*:[^|]*\|")
            words += label.count("iteration")
        if line.count("iteration") != words:
            return None
        parts.append(r"[^|]*")
        return cls(re.compile("".join(parts)), labels, words)

    def read(
        self, line: str, lineno: int, pairs: list[int], odd_fields: _Tally, fallback: dict[str, float] | None
    ) -> list[tuple[int, int, dict[str, float], dict[str, float]]] | None:
        """The line's record as :func:`_iterations` gives it, or None when the line is not of this shape."""
        if line.count("iteration") != self.count:
            return None
        m = self.rx.fullmatch(line)
        if m is None or ((pre := m.group("pre")) and ((c := pre[-1]).isalnum() or c == "_")):
            return None
        groups = m.groups()
        values: dict[str, float] = {}
        odd = False
        for (attr, scale, count), text in zip(self.plan, groups[3:], strict=True):
            if "/" in text:  # as _fill reads it (the plan is _fill's, unrolled for one shape's known labels)
                odd = True
                break
            try:
                v = float(text)
            except ValueError:
                odd = True
                break
            if count and not _is_count(v):
                odd = True
                break
            values[attr] = v * scale
        if odd:  # a value _fill reads its own way, or names: let it, from the start
            values, _ = _fill(zip(self.labels, groups[3:], strict=True), lineno, pairs, odd_fields, None)
        if fallback:
            for attr, v in fallback.items():
                values.setdefault(attr, v)
        if not any(a in values for a in TIMING_ATTRS):
            return []  # as _iterations: no record, its odd fields already counted
        return [(int(groups[1]), int(groups[2]), values, {})]


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


def parse_log_text(text: str, *, source: str = "<text>", memory_only: bool = False) -> MegatronLog:
    """Parse the text of one Megatron log.

    ``memory_only``: a log with memory reports (``[Rank N] ... memory (MB) | ...``) and no iteration line is
    returned (its ``iterations`` empty) instead of refused: what ``compare`` reads as a memory-only run.

    Raises:
        LogFormatError: empty, or no iteration line (the message says what was looked for and found).
        LogBudgetError: more iteration lines than the ``max_log_iterations`` budget.
    """
    return _parse(_split(text), source=source, memory_only=memory_only)


def _split(text: str) -> Iterator[str]:
    """The lines of ``text``, line ends kept, one at a time (as :class:`LogLines` reads a file)."""
    start, n = 0, len(text)
    while start < n:
        end = text.find("\n", start)
        chunk = text[start : n if end < 0 else end + 1]
        yield from chunk.splitlines(keepends=True)  # the rarer line ends (\r, \f, U+2028) inside it
        start += len(chunk)


def _clean_lines(raw: Iterable[str], state: dict[str, object]) -> Iterator[tuple[int, str, bool]]:
    r"""``(line number, line, terminated)`` as ``clean_text(whole text).splitlines()`` would give them.

    Works on lines with their ends (``raw``), so the text is never held whole. ``clean_text`` strips
    ANSI codes, then turns each ``"\r\n"`` into ``"\n"``, and ``splitlines`` reads ``"\r\n"`` as one
    line end: codes between ``"\r"`` and ``"\n"`` (``"\r\x1b[0m\n"``), which split them into two raw
    lines, make each of those steps join two pieces here. A last line of nothing but codes is no line.
    ``terminated``: the line has an end (all but a last line cut by a killed job). Sets
    ``state["content"]`` (any non-space text), ``state["head"]`` (the first 4 KiB, for the binary
    check) and ``state["partial"]``.
    """
    content = False

    def replaced() -> Iterator[str]:  # the pieces of the stripped text after "\r\n" -> "\n"
        nonlocal content
        prev: str | None = None
        for r in raw:
            if not content and not r.isspace():
                content = True
            s = strip_ansi(r)
            if not s:
                continue  # the last line, nothing but codes
            if prev is not None:
                if prev.endswith("\r") and s == "\n":
                    s, prev = prev[:-1] + "\n", None  # a "\r\n" split by codes
                else:
                    yield prev[:-2] + "\n" if prev.endswith("\r\n") else prev
            prev = s
        if prev is not None:
            yield prev[:-2] + "\n" if prev.endswith("\r\n") else prev

    head: list[str] = []
    head_len, n = 0, 0
    pending: str | None = None
    for t in replaced():
        if head_len < 4096:
            head.append(t[: 4096 - head_len])
            head_len += len(head[-1])
        if pending is not None:
            if pending.endswith("\r") and t == "\n":
                pending = pending[:-1] + "\n"  # "\r\n" is one line end
                continue
            n += 1
            yield n, pending[:-1] if pending[-1] in _BREAKS else pending, True
        pending = t
    state["partial"] = pending is None or not pending.endswith(("\n", "\r"))
    if pending is not None:
        yield n + 1, pending[:-1] if pending[-1] in _BREAKS else pending, not state["partial"]
    state["content"], state["head"] = content, "".join(head)


def _parse(raw: Iterable[str], *, source: str, memory_only: bool = False) -> MegatronLog:
    """Parse the lines ``raw`` yields (line ends kept) one at a time, in memory bounded by the budgets."""
    log = MegatronLog(source=source)
    limits = current()
    table = IterationTable(limit=limits.max_log_iterations, source=source)
    unknown = UnknownLines()  # what the "no iteration lines" error describes when no line had a record
    capture_pending = False
    pairs, odd_memory, odd_fields = [0], _Tally(), _Tally()
    repeated: dict[str, list[int]] = {}  # per-line warning kind: [its index in log.warnings, lines past the first]
    unknown_memory: dict[str, None] = {}
    memory_kept, arg_chars, args_dropped = 0, 0, 0
    bridge: dict[str, float] | None = None  # Megatron-Bridge's Step Time line, for the next iteration line
    state: dict[str, object] = {}
    shapes: list[_Shape] = []  # the line shapes last learned, newest first
    learned = 0
    workers: list[str] = []  # the DeepSpeed launcher's "Running on the following workers" line
    world_info: list[str] = []  # its launch.py "WORLD INFO DICT" keys
    pdsh: dict[str, None] = {}  # hosts of pdsh "host: [timestamp]" line prefixes, in order seen

    def warn_once(kind: str, text: str) -> None:
        if kind in repeated:
            repeated[kind][1] += 1
        else:
            repeated[kind] = [len(log.warnings), 0]
            log.warnings.append(text)

    for i, line, terminated in _clean_lines(raw, state):
        records = None
        if "iteration" in line:
            for shape in shapes:
                if (records := shape.read(line, i, pairs, odd_fields, bridge)) is not None:
                    break
            if records is None:
                records = _iterations(line, i, pairs, odd_fields, terminated=terminated, fallback=bridge,
                                      unknown_memory=unknown_memory)  # fmt: skip
                if len(records) == 1 and learned < _MAX_SHAPES_LEARNED:
                    learned += 1
                    if (new := _Shape.learn(line)) is not None:
                        shapes = [new, *shapes[: _SHAPES - 1]]
        if records:
            bridge = None
            for iteration, total, values, memory in records:
                if table.append(iteration, total, values, memory, line=i, captured=capture_pending):
                    capture_pending = False
            continue
        if not len(table):
            unknown.add(line)
        if line.find(": [", 0, 260) >= 0 and len(pdsh) < _MAX_PDSH_HOSTS and (pm := _PDSH_RE.match(line)):
            pdsh[pm.group(1)] = None
        if ("of memory" in line or "OutOfMemory" in line) and _OOM_RE.search(line):
            if not log.oom_events:
                log.warnings.append(f"line {i}: a rank ran out of GPU memory ({line.strip()[:120]})")
            log.oom_events += 1
            continue
        if "memory (MB)" in line:
            found = _memory(line, i)
            if not terminated:
                if found:
                    log.warnings.append(f"line {i}: memory report on the unterminated last line ignored")
                continue
            if not found:
                odd_memory.append(str(i))
            for rec in found:
                if memory_kept < MAX_MEMORY_RECORDS:
                    log.memory.append(rec)
                    memory_kept += 1
                    continue
                for attr in _MEMORY_ATTRS:
                    v = getattr(rec, attr)
                    if v is not None and not (v <= log.memory_overflow.get(attr, -math.inf)):
                        log.memory_overflow[attr] = v
                warn_once("memory-cap", f"memory reports past the first {MAX_MEMORY_RECORDS:,} are not kept "
                          "(their peaks are)")  # fmt: skip
            continue
        if "Step Time" in line and (bm := _BRIDGE_RE.search(line)):
            bridge = {"elapsed_ms": float(bm.group(1)) * 1000.0, "tflops": float(bm.group(2))}
            continue
        if "CANCELLED" in line and (cm := _CANCEL_RE.search(line)):
            why = " ".join(cm.group(4).split())
            warn_once("cancelled", f"line {i}: the job was cancelled at {cm.group(3)}{' ' + why.lower() if why else ''}"
                      " (slurmstepd): the run did not finish")  # fmt: skip
            continue
        if _CAPTURE_RE.search(line) and "validation" not in line.lower():
            capture_pending = True
            continue
        if "bufreuse-megatron: hooked" in line and "persistent bytes" in line:
            # what install() registered in this run (the ring bytes compare explains the allocated delta with)
            value = line.split("persistent bytes", 1)[1].split(";", 1)[0].strip()
            if REGISTERED_ARG not in log.args and arg_chars + len(value) <= _MAX_ARG_CHARS:
                log.args[REGISTERED_ARG] = value
                arg_chars += len(value)
            continue
        if ("version" in line or "deepspeed info" in line) and (sm := _SOFTWARE_RE.search(line)):
            key = _SOFTWARE_KEYS[sm.group(1)] if sm.group(1) else "deepspeed"
            log.software.setdefault(key, (sm.group(2) or sm.group(3))[:100])
            continue
        if "Running on the following workers" in line and (wm := _WORKERS_RE.search(line)):
            workers = workers or wm.group(1).split(",")
            continue
        if "WORLD INFO DICT" in line and (wi := _WORLD_INFO_RE.search(line)):
            world_info = world_info or _WORLD_INFO_HOST_RE.findall(wi.group(1))
            continue
        if " ..." in line and (am := _ARG_RE.search(line)):
            name, value = am.group(1), am.group(2)
            if name not in log.args:
                if len(log.args) < MAX_ARGS and arg_chars + len(name) + len(value) <= _MAX_ARG_CHARS:
                    log.args[name] = value
                    arg_chars += len(name) + len(value)
                else:
                    args_dropped += 1
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
                warn_once("nodelist", f"line {i}: {e}")
        if log.job_id is None and (jm := _JOBID_RE.search(line)):
            log.job_id = jm.group(1)
    if not state["content"]:
        raise LogFormatError(f"{source}: empty log")
    _launcher_nodes(log, workers, world_info, list(pdsh))
    log.partial_last_line = bool(state["partial"])
    for at, more in repeated.values():
        if more:
            log.warnings[at] += f" (and {more:,} more such line(s))"
    table.finish(log_interval=log.args.get("log_interval"), capture_pending=capture_pending)
    log.iterations = table
    log.capture_iteration = table.capture_iteration
    if table.long_gaps:
        interval = table.interval
        src = (
            f"log_interval is {interval}"
            if table.known_interval
            else f"log_interval is not printed; the usual gap is {interval}"
        )
        log.warnings.append(
            f"{table.long_gaps} iteration line(s) follow a gap longer than the logging interval (lines elided or "
            f"lost; {src}): each weighs {interval} iteration(s), not its gap"
        )
    if table.conflicts:
        shown = ", ".join(str(c) for c in table.conflicts[:5])
        log.warnings.append(f"iterations logged more than once with different values (kept the last): {shown}")
    if table.oversized:
        log.warnings.append(f"{table.oversized} iteration line(s) with an iteration number or train_iters past "
                            "2**63 - 1 ignored")  # fmt: skip
    if pairs[0]:
        log.warnings.append("fields printed as current/average: the current value (the window's own) is read")
    if odd_memory.count:
        log.warnings.append(
            f"{odd_memory.count} 'memory (MB)' line(s) in no known shape ignored (first: line {odd_memory.first})"
        )
    if odd_fields.count:
        log.warnings.append(
            f"{odd_fields.count} iteration field(s) with no usable value ignored (a count must be a whole number"
            f" >= 0; first: {odd_fields.first})"
        )
    if unknown_memory:
        log.warnings.append(
            "memory field(s) on iteration lines not read (meaning unknown): "
            + ", ".join(repr(x) for x in list(unknown_memory)[:8])
        )
    if args_dropped:
        log.warnings.append(f"{args_dropped:,} argument line(s) past the first {MAX_ARGS:,} arguments (or "
                            f"{_MAX_ARG_CHARS >> 20} MiB of them) ignored")  # fmt: skip
    if table.capture_unresolved:
        log.warnings.append("CUDA-graph capture message with no iteration logged after it")
    if log.job_id is None and (fm := _FILE_JOBID_RE.search(os.path.basename(source))):
        log.job_id = next(g for g in fm.groups() if g)
    if not len(table):
        reports = len(log.memory) + (1 if log.memory_overflow else 0)
        if memory_only and reports:
            return log
        head = str(state["head"])
        binary = "\x00" in head or head[:1] == "\ufffd"
        what = describe_unknown(head) if binary else unknown.describe()
        if reports or odd_memory.count:
            what += (
                f"; of those, {len(log.memory):,} memory report(s) ('[Rank N] (after K iterations) memory (MB) | "
                f"allocated: ... |') read" + (f" and {odd_memory.count:,} 'memory (MB)' line(s) in no known shape"
                                              if odd_memory.count else "")
            )  # fmt: skip
        raise LogFormatError(f"{source}: no Megatron iteration lines: {what}")
    return log


def _launcher_nodes(log: MegatronLog, workers: list[str], world_info: list[str], pdsh: list[str]) -> None:
    """The node set the DeepSpeed launcher names: its workers line (what ran, preferred over a SLURM allocation),
    else its world info, else (no node set from any line) the hosts of pdsh line prefixes."""
    if workers:
        log.nodes, log.nodes_source = hosts_from_names(workers), "the DeepSpeed launcher's workers line"
    elif world_info:
        log.nodes, log.nodes_source = hosts_from_names(world_info), "the DeepSpeed launcher's WORLD INFO DICT"
    elif pdsh and log.nodes is None:
        log.nodes = hosts_from_names(pdsh)
        log.nodes_source = f"pdsh line prefixes (the {len(pdsh)} host(s) that printed DeepSpeed log lines)"
        if len(pdsh) >= _MAX_PDSH_HOSTS:
            log.nodes, log.nodes_source = None, None
            log.warnings.append(f"over {_MAX_PDSH_HOSTS:,} hosts in pdsh line prefixes: node set not read")


def parse_log(path: str | os.PathLike[str], *, memory_only: bool = False) -> MegatronLog:
    """Read and parse one log file, plain or gzip'd (undecodable bytes replaced, never fatal), line by line.

    ``memory_only``: as :func:`parse_log_text`.

    Raises:
        LogFormatError: unreadable, refused by :mod:`.textfile`, empty or with no iteration line.
        LogBudgetError: over ``max_log_bytes``, ``max_log_line_bytes`` or ``max_log_iterations``.
    """
    p = Path(path)
    lines = LogLines(p)  # streamed, bounded, FIFOs refused (textfile)
    log = _parse(lines, source=str(p), memory_only=memory_only)
    if lines.warning:
        log.warnings.insert(0, lines.warning)
    return log


def steady_rows(log: MegatronLog, *, warmup: int = 3) -> tuple[np.ndarray, dict[str, int]]:
    """Row numbers (into ``log.iterations``) of the log windows that count for statistics, and how many
    were dropped for which reason (see :func:`steady_iterations`); no per-row Python object."""
    mask, dropped = steady_mask(log, warmup=warmup)
    return np.flatnonzero(mask), dropped


def steady_mask(log: MegatronLog, *, warmup: int = 3) -> tuple[np.ndarray, dict[str, int]]:
    """:func:`steady_rows` as one bool a row (a long log's steady rows need no 8-byte row numbers)."""
    if warmup < 0:
        raise LogFormatError(f"--warmup must be >= 0, got {warmup}")
    table = log.iterations
    dropped = {"warmup": 0, "before_capture": 0, "skipped_or_nan": 0}
    if not len(table):
        return np.zeros(0, dtype=bool), dropped
    it, window = table.column("iteration"), table.column("window")
    first = int(np.argmin(it))
    start = int(it[first]) - int(window[first])
    threshold = start + warmup  # a Python int: --warmup may be any size
    if threshold > np.iinfo(np.int64).max:
        early = np.ones(it.size, dtype=bool)
    elif window.strides[0] == 0:  # one window for every row: compare with a number, no column of differences
        early = it < threshold + int(window[0])
    else:
        early = (it - window) < threshold
    rest = ~early
    capture = log.capture_iteration
    before = rest & (it <= capture) if capture is not None else np.zeros(it.size, dtype=bool)
    rest &= ~before
    unclean = rest & ~table.clean()
    rest &= ~unclean
    dropped.update(warmup=int(early.sum()), before_capture=int(before.sum()), skipped_or_nan=int(unclean.sum()))
    return rest, dropped


def steady_iterations(log: MegatronLog, *, warmup: int = 3) -> tuple[IterationTable, dict[str, int]]:
    """The log windows that count for statistics, and how many were dropped for which reason.

    ``warmup`` counts iterations, not log lines: a window that overlaps the first ``warmup``
    iterations of the log is dropped whole. Also dropped: every window up to and including the one
    that captured a CUDA graph, and windows with skipped/NaN iterations or a non-finite loss. The
    windows come as a table of their rows (records made on access); :func:`steady_rows` gives row numbers.
    """
    rows, dropped = steady_rows(log, warmup=warmup)
    return log.iterations.take(rows), dropped


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
