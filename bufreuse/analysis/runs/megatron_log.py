"""Parse Megatron-LM training logs (SLURM output included) into iteration and memory records.

Megatron prints one iteration line per logging interval from the last rank::

     [2026-09-09 01:38:01.123456] iteration       12/      30 | consumed samples: ... |
     elapsed time per iteration (ms): 6123.4 | throughput per GPU (TFLOP/s/GPU): 1124.9 | ...
     lm loss: 2.345678E+00 | ... | number of skipped iterations:   0 | number of nan iterations:   0 |

and memory reports from data-parallel rank 0 of each model-parallel group::

    [Rank 0] (after 2 iterations) memory (MB) | allocated: 152545.00 | max allocated: ... |
    reserved: ... | max reserved: ... [| total device memory used: ...]

The parser is robust to launcher prefixes (``0: ``, ``[default3]:``, timestamps), lines of
several ranks interleaved, a partial last line (a killed job), NaN/inf losses and skipped
iterations. It trusts an iteration field only when its closing ``|`` was written, and drops
memory reports from an unterminated last line, so a truncated number is never read as a
value. One pass over the text.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from bufreuse.analysis.runs.textfile import read_log_text
from bufreuse.errors import LogFormatError

__all__ = [
    "IterationRecord",
    "MegatronLog",
    "MemoryRecord",
    "expand_hostlist",
    "parse_log",
    "parse_log_text",
    "steady_iterations",
]

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_ITER_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_FIELD_RE = re.compile(r"^\s*([^:|]+?)\s*:\s*(\S+)\s*$")
_MEM_RE = re.compile(
    r"\[Rank (\d+)\]\s*([^\[\]|]*?)\s*memory \(MB\)"
    rf"\s*\|\s*allocated:\s*({_NUM})\s*\|\s*max allocated:\s*({_NUM})"
    rf"\s*\|\s*(?:reserved|cached):\s*({_NUM})\s*\|\s*max (?:reserved|cached):\s*({_NUM})"
    rf"(?:\s*\|\s*total device memory used:\s*({_NUM}))?"
)
_AFTER_RE = re.compile(r"after (\d+) iterations")
_CAPTURE_RE = re.compile(
    r"capture cuda graph|cuda graph capture|capturing cuda graph|cuda graphs? captured", re.IGNORECASE
)
_ARG_RE = re.compile(r"(?:^|[\s:\]])([a-z_][a-z0-9_]*) \.{3,} (.*?)\s*$")
_NODELIST_RE = re.compile(r"\b(?:SLURM_JOB_NODELIST|SLURM_NODELIST|NodeList|nodelist)\s*[=:]\s*(\S+)")
_JOBID_RE = re.compile(r"\b(?:SLURM_JOB_ID|SLURM_JOBID|JobId)\s*[=:]\s*(\d+)")
_FILE_JOBID_RE = re.compile(r"slurm-(\d+)")

ELAPSED_KEY = "elapsed time per iteration (ms)"
THROUGHPUT_KEY = "throughput per GPU (TFLOP/s/GPU)"
LOSS_KEY = "lm loss"
SKIPPED_KEY = "number of skipped iterations"
NAN_KEY = "number of nan iterations"


@dataclass(kw_only=True, slots=True)
class IterationRecord:
    """One logged iteration line (covers ``log_interval`` iterations when that is > 1)."""

    iteration: int
    """Iteration number as printed (the last iteration of the logging interval)."""
    total: int
    """``train_iters`` as printed."""
    elapsed_ms: float | None
    """Mean wall time per iteration over the interval."""
    tflops: float | None
    """Throughput per GPU; None when Megatron ran without ``--log-throughput``."""
    loss: float | None
    """``lm loss`` (NaN/inf kept as such; None when not printed, as Megatron does for NaN)."""
    skipped: int = 0
    nan: int = 0
    line: int = 0
    """1-based line number in the log, for messages."""

    @property
    def clean(self) -> bool:
        """True when the interval had no skipped or NaN iteration and a finite (or absent) loss."""
        return self.skipped == 0 and self.nan == 0 and (self.loss is None or math.isfinite(self.loss))


@dataclass(kw_only=True, slots=True)
class MemoryRecord:
    """One ``[Rank N] ... memory (MB)`` report; values in MiB as printed."""

    rank: int
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
    """Megatron's printed ``arguments`` block, raw strings."""
    node_list: list[str] | None = None
    job_id: str | None = None
    partial_last_line: bool = False
    warnings: list[str] = field(default_factory=list)

    def peak(self, attr: str) -> float | None:
        """Maximum of a :class:`MemoryRecord` attribute over every rank and report."""
        values = [getattr(m, attr) for m in self.memory if getattr(m, attr) is not None]
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


def _iteration(line: str, lineno: int) -> IterationRecord | None:
    m = _ITER_RE.search(line)
    if m is None:
        return None
    pieces = line[m.end() :].split("|")
    # The text after the last "|" is only complete if a further field starts there; Megatron
    # ends every field with " |", so an unterminated piece is a truncated or foreign tail.
    fields: dict[str, float] = {}
    for piece in pieces[:-1]:
        fm = _FIELD_RE.match(piece)
        if fm:
            value = _number(fm.group(2))
            if value is not None:
                fields[fm.group(1)] = value
    if ELAPSED_KEY not in fields and THROUGHPUT_KEY not in fields:
        return None
    return IterationRecord(
        iteration=int(m.group(1)),
        total=int(m.group(2)),
        elapsed_ms=fields.get(ELAPSED_KEY),
        tflops=fields.get(THROUGHPUT_KEY),
        loss=fields.get(LOSS_KEY),
        skipped=int(fields.get(SKIPPED_KEY, 0) or 0),
        nan=int(fields.get(NAN_KEY, 0) or 0),
        line=lineno,
    )


def _memory(line: str, lineno: int) -> list[MemoryRecord]:
    out = []
    for m in _MEM_RE.finditer(line):
        after = _AFTER_RE.search(m.group(2))
        out.append(
            MemoryRecord(
                rank=int(m.group(1)),
                label=m.group(2).strip("() "),
                after_iterations=int(after.group(1)) if after else None,
                allocated_mib=float(m.group(3)),
                max_allocated_mib=float(m.group(4)),
                reserved_mib=float(m.group(5)),
                max_reserved_mib=float(m.group(6)),
                device_used_mib=float(m.group(7)) if m.group(7) else None,
                line=lineno,
            )
        )
    return out


def parse_log_text(text: str, *, source: str = "<text>") -> MegatronLog:
    """Parse the text of one Megatron log; raises :class:`LogFormatError` when it has no iteration line."""
    log = MegatronLog(source=source)
    if not text.strip():
        raise LogFormatError(f"{source}: empty log")
    lines = text.splitlines()
    log.partial_last_line = not text.endswith(("\n", "\r"))
    by_iteration: dict[int, IterationRecord] = {}
    conflicts: set[int] = set()
    capture_pending = False
    for i, line in enumerate(lines, start=1):
        terminated = i < len(lines) or not log.partial_last_line
        rec = _iteration(line, i)
        if rec is not None:
            old = by_iteration.pop(rec.iteration, None)
            if old is not None and (old.elapsed_ms, old.tflops) != (rec.elapsed_ms, rec.tflops):
                conflicts.add(rec.iteration)
            by_iteration[rec.iteration] = rec
            if capture_pending:
                log.capture_iteration = rec.iteration
                capture_pending = False
            continue
        if "memory (MB)" in line:
            if terminated:
                log.memory.extend(_memory(line, i))
            elif _MEM_RE.search(line):
                log.warnings.append(f"line {i}: memory report on the unterminated last line ignored")
            continue
        if _CAPTURE_RE.search(line) and "validation" not in line.lower():
            capture_pending = True
            continue
        if " ..." in line and (am := _ARG_RE.search(line)):
            log.args.setdefault(am.group(1), am.group(2))
            continue
        if log.node_list is None and (nm := _NODELIST_RE.search(line)):
            try:
                log.node_list = expand_hostlist(nm.group(1))
            except ValueError as e:
                log.warnings.append(f"line {i}: {e}")
        if log.job_id is None and (jm := _JOBID_RE.search(line)):
            log.job_id = jm.group(1)
    log.iterations = sorted(by_iteration.values(), key=lambda r: r.line)
    if conflicts:
        shown = ", ".join(str(c) for c in sorted(conflicts)[:5])
        log.warnings.append(f"iterations logged more than once with different values (kept the last): {shown}")
    if capture_pending:
        log.warnings.append("CUDA-graph capture message with no iteration logged after it")
    if log.job_id is None and (fm := _FILE_JOBID_RE.search(os.path.basename(source))):
        log.job_id = fm.group(1)
    if not log.iterations:
        raise LogFormatError(
            f"{source}: no Megatron iteration lines ('iteration N/ M | ... elapsed time per iteration (ms): X |')"
        )
    return log


def parse_log(path: str | os.PathLike[str]) -> MegatronLog:
    """Read and parse one log file (undecodable bytes replaced, never fatal)."""
    p = Path(path)
    try:
        text = read_log_text(p)
    except FileNotFoundError:
        raise LogFormatError(f"{p}: no such log file") from None
    except OSError as e:
        raise LogFormatError(f"{p}: cannot read ({e.strerror})") from None
    return parse_log_text(text, source=str(p))


def steady_iterations(log: MegatronLog, *, warmup: int = 3) -> tuple[list[IterationRecord], dict[str, int]]:
    """The iterations that count for statistics, and how many were dropped for which reason.

    Drops the first ``warmup`` logged iterations, every iteration up to and including the one
    that captured a CUDA graph, and intervals with skipped/NaN iterations or a non-finite loss.
    """
    if warmup < 0:
        raise LogFormatError(f"--warmup must be >= 0, got {warmup}")
    dropped = {"warmup": 0, "before_capture": 0, "skipped_or_nan": 0}
    kept: list[IterationRecord] = []
    for index, rec in enumerate(log.iterations):
        if index < warmup:
            dropped["warmup"] += 1
        elif log.capture_iteration is not None and rec.iteration <= log.capture_iteration:
            dropped["before_capture"] += 1
        elif not rec.clean:
            dropped["skipped_or_nan"] += 1
        else:
            kept.append(rec)
    return kept, dropped


def expand_hostlist(expr: str) -> list[str]:
    """Expand a SLURM host list (``node[01-04,07],gpu-a[1-2]``) into host names, zero padding kept."""
    expr = expr.strip().strip("\"'")
    hosts: list[str] = []
    for part in _split_top(expr):
        hosts.extend(_expand_one(part))
    return hosts


def _split_top(expr: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {expr!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in host list {expr!r}")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_one(part: str) -> list[str]:
    start = part.find("[")
    if start < 0:
        return [part]
    end = part.index("]", start)
    head, body, tail = part[:start], part[start + 1 : end], part[end + 1 :]
    values: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not sep:
            values.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"bad range {item!r} in host list {part!r}")
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return [head + v + rest for v in values for rest in _expand_one(tail)]
