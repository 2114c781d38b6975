"""A training log's iteration lines as typed columns: a fixed few bytes per line, not a Python object each.

The parser (:mod:`.megatron_log`) appends one row per iteration record it reads, every rank's copy
included, to ``array`` columns (:data:`ROW_BYTES` a row). :meth:`IterationTable.finish` then, with
numpy and no per-row Python object: merges duplicates (an iteration keeps its most complete copy,
the last of equals), finds the iteration a CUDA-graph capture lands in, and sets each row's logging
window. The table reads as a sequence of :class:`IterationRecord`, each made when asked for (a copy:
changing it changes nothing), and hands whole columns to statistics. Rows past the
``max_log_iterations`` budget are refused as they are read, so a log of any size costs at most
that many rows.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

from bufreuse.analysis.runs.textfile import LogBudgetError

__all__ = ["FLOAT_COLUMNS", "ROW_BYTES", "IterationRecord", "IterationTable"]


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
    """Memory fields of the line (:data:`~.grammars.MEMORY_FIELDS`) by ``MemoryRecord`` attribute, in MiB."""

    @property
    def clean(self) -> bool:
        """True when the window had no skipped or NaN iteration and a finite (or absent) loss."""
        return self.skipped == 0 and self.nan == 0 and (self.loss is None or math.isfinite(self.loss))


FLOAT_COLUMNS = ("elapsed_ms", "tflops", "loss", "samples_per_s")
"""Optional figures of a row: a float64 column each and a bit in the row's flags (absent is not NaN)."""
_COUNTS = ("skipped", "nan")  # whole numbers read as floats: float64 keeps them exactly as read
_INTS = ("iteration", "total", "line")
_CAPTURED = 1 << len(FLOAT_COLUMNS)  # flag bit: a CUDA-graph capture message came before this row
_INT64_MAX = 2**63 - 1
ROW_BYTES = 8 * (len(FLOAT_COLUMNS) + len(_COUNTS) + len(_INTS)) + 2 + 8
"""Bytes one row costs at most: the columns, fields and flags (one byte each) and the window set by ``finish``
(iteration-line memory fields, printed by ms-swift and Primus only, add 8 bytes each)."""
BASE_ROW_BYTES = 8 + 4 + 2
"""Bytes every row costs: iteration and line number (4 bytes below 2^32), fields and flags. The rest is
paid only when a log needs it: 8 for each figure some line prints nonzero (a count or a figure no line
prints costs nothing), 8 for ``train_iters`` when it changes within the log, 8 for windows that are not
all equal."""
_LAZY = ("total", *FLOAT_COLUMNS, *_COUNTS)
_PUT = tuple((1 << b, n) for b, n in enumerate(FLOAT_COLUMNS)) + tuple((0, n) for n in _COUNTS)
"""Columns made on the first row that needs them (before it: every row had the fill value)."""


class IterationTable(Sequence[IterationRecord]):
    """Iteration rows in columns; append while parsing, :meth:`finish` once, then read."""

    def __init__(self, *, limit: int | None = None, source: str = "<text>") -> None:
        self._cols: dict[str, array] = {"iteration": array("q"), "line": array("I")}  # and _LAZY ones when needed
        self._total0 = 0  # train_iters of the first row: the fill of the lazy "total" column
        self._fields, self._flags = array("B"), array("B")
        self._memory: dict[str, array] = {}
        self._limit, self._source = limit, source
        self._n = 0
        self._final: dict[str, np.ndarray] | None = None
        self.oversized = 0
        """Records dropped because a number (iteration, ``train_iters``) does not fit 64 bits."""
        self.conflicts: list[int] = []
        """Iterations logged more than once with different values at the same completeness (sorted)."""
        self.capture_iteration: int | None = None
        self.capture_unresolved = False
        """True when the last capture message has no iteration logged after it."""
        self.interval = 1
        """The logging interval windows are capped at: ``log_interval`` as printed, else the usual gap."""
        self.known_interval = False
        """True when ``interval`` is the printed ``log_interval``."""
        self.long_gaps = 0
        """Rows that follow a gap longer than ``interval`` (the logging interval, printed or the usual gap)."""

    # -- while parsing ------------------------------------------------------------------------------------

    def append(
        self, iteration: int, total: int, values: dict[str, float], memory: dict[str, float], *, line: int,
        captured: bool = False,
    ) -> bool:  # fmt: skip
        """Add one record; False (and counted in ``oversized``) when a number does not fit 64 bits.

        Raises:
            LogBudgetError: the table already holds ``limit`` rows (the ``max_log_iterations`` budget).
        """
        if iteration > _INT64_MAX or total > _INT64_MAX:
            self.oversized += 1
            return False
        if self._limit is not None and self._n >= self._limit:
            raise LogBudgetError(
                "max_log_iterations", value=f"more than {self._limit:,}", limit=self._limit,
                what=f"{self._source}: iteration lines (every rank's copy counted)",
            )  # fmt: skip
        c = self._cols
        c["iteration"].append(iteration)
        try:
            c["line"].append(line)
        except OverflowError:  # past 2^32 - 1 (a 4 GiB log of short lines): 8 bytes a line number from here
            c["line"] = array("q", c["line"])
            c["line"].append(line)
        if not self._n:
            self._total0 = total
        if (col := c.get("total")) is not None:
            col.append(total)
        elif total != self._total0:
            c["total"] = array("q", [self._total0]) * self._n
            c["total"].append(total)
        flags = _CAPTURED if captured else 0
        for bit, name in _PUT:  # the figures, then the counts (absent: 0, no flag bit)
            v = values.get(name)
            if v is not None:
                flags |= bit
            if (col := c.get(name)) is not None:
                col.append(0.0 if v is None else v)
            elif v:  # nonzero (or NaN): the column starts here, zeros before
                c[name] = array("d", [0.0]) * self._n
                c[name].append(v)
        self._fields.append(min(255, len(values) + len(memory)))
        self._flags.append(flags)
        if memory or self._memory:
            for name, v in memory.items():
                col = self._memory.get(name)
                if col is None:
                    col = self._memory[name] = array("d", [math.nan]) * self._n
                col.append(v)
            for name, col in self._memory.items():
                if name not in memory:
                    col.append(math.nan)
        self._n += 1
        return True

    # -- once, at the end ----------------------------------------------------------------------------------

    def finish(self, *, log_interval: str | None, capture_pending: bool) -> None:
        """Merge duplicates, resolve the capture iteration, set windows; no appends after this.

        ``log_interval``: Megatron's printed argument (None: not printed); ``capture_pending``: a
        capture message came after the last record.
        """
        col: dict[str, np.ndarray] = {
            n: np.frombuffer(a, dtype=np.uint32 if a.typecode == "I" else np.int64)
            for n, a in self._cols.items()
            if n in _INTS
        }
        col.update({n: np.frombuffer(a, dtype=np.float64) for n, a in self._cols.items() if n not in _INTS})
        for name in _LAZY:  # never made: every row holds the fill, one value read as a whole column
            if name not in col:
                fill = np.int64(self._total0) if name == "total" else np.float64(0.0)
                col[name] = np.broadcast_to(fill, (self._n,))
        col["fields"] = np.frombuffer(self._fields, dtype=np.uint8)
        col["flags"] = np.frombuffer(self._flags, dtype=np.uint8)
        col.update({f"mem:{n}": np.frombuffer(a, dtype=np.float64) for n, a in self._memory.items()})
        self._cols, self._memory = {}, {}  # the views hold the buffers now: each goes with its view
        self._fields = self._flags = array("B")
        it = col["iteration"]
        skipped = np.zeros(self._n, dtype=bool)
        keep: np.ndarray | None = None
        if self._n > 1 and not bool(np.all(it[1:] > it[:-1])):
            keep = self._merge(col, skipped)
        del it
        self._resolve_capture(col, skipped, capture_pending)
        del skipped
        if keep is not None:
            kept = int(np.count_nonzero(keep))
            for name in list(col):  # one column at a time: the full one is dropped as its copy is made
                a = col[name]
                col[name] = np.broadcast_to(a[:1].reshape(()) if a.size else a.dtype.type(0), (kept,)) if (
                    a.ndim and a.strides[0] == 0) else a[keep]  # fmt: skip
        self._final = col
        self._n = int(col["iteration"].size)
        self._set_windows(log_interval, in_order=keep is None)

    def _merge(self, col: dict[str, np.ndarray], skipped: np.ndarray) -> np.ndarray:
        """Rows to keep: one per iteration, its most complete copy (the last of equals), in log order.

        Replays the order the lines came in for the iterations that have copies, so a fragment read
        after a complete copy is ``skipped`` (it never replaces it) and conflicts are found as read.
        """
        it, fields, flags = col["iteration"], col["fields"], col["flags"]
        e, t = col["elapsed_ms"], col["tflops"]
        order = np.argsort(it, kind="stable")
        first = np.ones(it.size, dtype=bool)  # the first row of an iteration's copies, in sorted order
        np.not_equal(it[order[1:]], it[order[:-1]], out=first[1:])
        starts = np.flatnonzero(first)
        del first
        sizes = np.diff(starts, append=it.size)
        copied = sizes > 1
        starts, sizes = starts[copied], sizes[copied]
        keep = np.ones(it.size, dtype=bool)
        conflicts = []

        def timing(r: int) -> tuple[float | None, float | None]:
            f = int(flags[r])
            return (float(e[r]) if f & 1 else None, float(t[r]) if f & 2 else None)

        for at in range(0, starts.size, 4096):  # Python lists of 4,096 groups at a time
            for s, size in zip(starts[at : at + 4096].tolist(), sizes[at : at + 4096].tolist(), strict=True):
                rows = order[s : s + size].tolist()
                keep[rows] = False
                kept = rows[0]
                conflict = False
                for r in rows[1:]:
                    if fields[kept] == fields[r] and timing(kept) != timing(r):
                        conflict = True
                    if fields[kept] > fields[r]:
                        skipped[r] = True  # a fragment never replaces a more complete copy
                    else:
                        kept = r
                keep[kept] = True
                if conflict:
                    conflicts.append(int(it[kept]))
        self.conflicts = conflicts  # ascending: the groups are visited in iteration order
        return keep

    def _resolve_capture(self, col: dict[str, np.ndarray], skipped: np.ndarray, pending: bool) -> None:
        """The iteration of the first row kept as read after the last capture message that has one."""
        marks = np.flatnonzero(col["flags"] & _CAPTURED)
        if marks.size:
            taken = np.flatnonzero(~skipped)
            reached = marks[marks <= (taken[-1] if taken.size else -1)]
            if reached.size:
                first = taken[np.searchsorted(taken, reached[-1])]
                self.capture_iteration = int(col["iteration"][first])
            pending = pending or reached.size < marks.size
        self.capture_unresolved = pending

    def _set_windows(self, log_interval: str | None, *, in_order: bool) -> None:
        """Each row's window: ``min(gap to the previous logged iteration, logging interval)``, at least 1.

        Megatron averages a line over the ``log_interval`` iterations before it, so a longer gap
        (lines cut or lost) still weighs one interval; without ``log_interval`` printed the most
        common gap (the smallest of ties) stands in. ``in_order``: rows are in iteration order already
        (no sort needed: the usual log).
        """
        col = self._final
        assert col is not None
        it = col["iteration"]
        col["window"] = np.broadcast_to(np.int64(1), (it.size,))
        if not it.size:
            return
        order = None if in_order else np.argsort(it, kind="stable")
        gaps = np.diff(it if order is None else it[order])
        try:
            interval = int(log_interval or "")
            known = interval >= 1
        except ValueError:
            known = False
        if not known:
            if gaps.size and int(gaps.min()) == int(gaps.max()):
                interval = int(gaps[0])  # one gap throughout (the usual log): no sorted copy to count it
            elif gaps.size:
                values, counts = np.unique(gaps, return_counts=True)
                interval = int(values[np.argmax(counts)])
                del values, counts
            else:
                interval = 1
        interval = min(max(1, interval), _INT64_MAX)
        self.interval, self.known_interval = interval, known
        self.long_gaps = int(np.count_nonzero(gaps > interval))
        first = 0 if order is None else int(order[0])
        head = max(1, min(int(it[first]), interval))
        np.minimum(gaps, interval, out=gaps)  # gaps are >= 1: the iterations are distinct
        if not gaps.size or (int(gaps[0]) == head and not bool(np.any(gaps != head))):
            col["window"] = np.broadcast_to(np.int64(head), (it.size,))  # one window for every row: no column
            return
        windows = np.empty(it.size, dtype=np.int64)
        windows[first] = head
        if order is None:
            windows[1:] = gaps
        else:
            windows[order[1:]] = gaps
        col["window"] = windows

    # -- reading -------------------------------------------------------------------------------------------

    def _columns(self) -> dict[str, np.ndarray]:
        if self._final is None:
            if self._n:
                raise RuntimeError("IterationTable read before finish()")
            self.finish(log_interval=None, capture_pending=False)  # an empty table reads as one
        assert self._final is not None
        return self._final

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> IterationRecord: ...
    @overload
    def __getitem__(self, i: slice) -> list[IterationRecord]: ...
    def __getitem__(self, i: int | slice) -> IterationRecord | list[IterationRecord]:
        if isinstance(i, slice):
            return [self._record(k) for k in range(*i.indices(self._n))]
        k = i + self._n if i < 0 else i
        if not 0 <= k < self._n:
            raise IndexError("iteration row out of range")
        return self._record(k)

    def __iter__(self) -> Iterator[IterationRecord]:
        for k in range(self._n):
            yield self._record(k)

    def __eq__(self, other: object) -> bool:
        """Equal to a list, tuple or table of equal records (as the list this table replaced was)."""
        if not isinstance(other, list | tuple | IterationTable):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def _record(self, k: int) -> IterationRecord:
        c = self._columns()
        flags = int(c["flags"][k])
        opt = {n: float(c[n][k]) if flags & (1 << b) else None for b, n in enumerate(FLOAT_COLUMNS)}
        memory = {n[4:]: float(a[k]) for n, a in c.items() if n.startswith("mem:") and not math.isnan(a[k])}
        return IterationRecord(
            iteration=int(c["iteration"][k]), total=int(c["total"][k]), **opt,
            skipped=int(c["skipped"][k]), nan=int(c["nan"][k]), window=int(c["window"][k]),
            fields=int(c["fields"][k]), line=int(c["line"][k]), memory_mib=memory,
        )  # fmt: skip

    def column(self, name: str) -> np.ndarray:
        """A whole column, read-only: ``iteration``, ``window``, ``line``, a count or a :data:`FLOAT_COLUMNS`
        name (absent values read 0: see :meth:`present`)."""
        out = self._columns()[name].view()
        out.flags.writeable = False
        return out

    def present(self, name: str) -> np.ndarray:
        """Rows that printed the :data:`FLOAT_COLUMNS` figure ``name``."""
        return (self._columns()["flags"] & (1 << FLOAT_COLUMNS.index(name))) != 0

    def clean(self) -> np.ndarray:
        """Rows with no skipped or NaN iteration and a finite (or absent) loss (:attr:`IterationRecord.clean`)."""
        c = self._columns()
        loss_ok = ~self.present("loss") | np.isfinite(c["loss"])
        return (c["skipped"] == 0) & (c["nan"] == 0) & loss_ok

    def memory_peak(self, attr: str) -> float | None:
        """Largest iteration-line memory figure ``attr`` (MiB), None if no line printed it."""
        a = self._columns().get(f"mem:{attr}")
        if a is None or not a.size or bool(np.isnan(a).all()):
            return None
        return float(np.nanmax(a))

    def take(self, rows: np.ndarray) -> IterationTable:
        """A finished table of ``rows`` (row numbers, in the order given); copies those rows' columns."""
        sub = IterationTable(limit=None, source=self._source)
        sub._final = {n: a[rows] for n, a in self._columns().items()}
        sub._n = int(rows.size)
        sub.capture_iteration, sub.interval = self.capture_iteration, self.interval
        return sub
