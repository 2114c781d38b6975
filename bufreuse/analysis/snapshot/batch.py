"""Report snapshot files: one file, several in worker processes, and the summary over them (ranks).

:func:`report_file` returns the ``--json`` object of one file; :func:`report_files` reports several
(forked worker processes, at most one per file and per CPU) and keeps a bad file's error next to
the others' reports, even when a worker dies; :func:`combine` gives min / median / max of the
headline figures, naming the worst file. Every file is read within the snapshot budgets of a
:class:`bufreuse.limits.Limits`, resolved in the calling process and handed to the workers (the
:func:`bufreuse.limits.override` context does not cross processes).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import statistics
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from bufreuse.analysis.snapshot.budget import SnapshotBudgetError, memory_for, memory_limit
from bufreuse.analysis.snapshot.load import load_snapshot
from bufreuse.analysis.snapshot.report import ReportConfig, Timeline, analyze
from bufreuse.analysis.snapshot.unpickle import ProgressFn
from bufreuse.errors import InputError, exit_code_for
from bufreuse.limits import Limits, current

__all__ = [
    "COMBINED_FIGURES",
    "FileResult",
    "analyze_file",
    "combine",
    "plot_stems",
    "report_file",
    "report_files",
    "unique_labels",
    "worker_count",
]

COMBINED_FIGURES = (
    "max_reserved_bytes",
    "max_active_bytes",
    "pending_free_at_max_active_bytes",
    "final_reserved_bytes",
    "num_trace_events",
    "frees_without_alloc",
)


@dataclass(kw_only=True, slots=True)
class FileResult:
    """One file's report and timeline, or the one-line error that stopped it."""

    file: str
    report: dict[str, Any] | None = None
    error: str | None = None
    """One line naming the file (unescaped text from the file: escape it before rich sees it)."""
    exit_code: int = 0
    """0 when reported; else what the error means at a boundary (2 bad input, 1 internal error)."""
    timeline: Timeline | None = None


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: a loaded pickle is millions of acyclic objects the GC would scan again and again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def report_file(
    path: str | os.PathLike[str],
    *,
    categories: dict[str, str] | None = None,
    config: ReportConfig | None = None,
    limits: Limits | None = None,
) -> dict[str, Any]:
    """The ``--json`` object for one file.

    Raises:
        SnapshotFormatError: the file is unreadable or malformed.
        SnapshotBudgetError: the file needs more than ``limits`` (default: in force) allows.
    """
    config = config or ReportConfig()
    limits = limits or current()
    if categories:
        config = ReportConfig(
            categories={**config.categories, **categories}, site_frame=config.site_frame, site_skip=config.site_skip
        )
    with _gc_paused(), _memory_for(path, limits):
        try:
            return analyze(load_snapshot(path, limits=limits), config)[0]
        except MemoryError:
            raise _memory_error(path, limits) from None


def _memory_for(path: str | os.PathLike[str], limits: Limits) -> Any:
    """The memory limit for reading and analysing ``path``: ``max_memory_bytes``, whatever the file's size."""
    return memory_limit(memory_for(limits))


def _memory_error(path: str | os.PathLike[str], limits: Limits) -> SnapshotBudgetError:
    limit = memory_for(limits)
    return SnapshotBudgetError(
        "max_memory_bytes", value="needs more memory", limit=limit, what=f"{path}: analysing the snapshot"
    )


def analyze_file(
    path: str,
    config: ReportConfig,
    progress: ProgressFn | None = None,
    *,
    raise_errors: bool = False,
    limits: Limits | None = None,
) -> FileResult:
    """Report one file, turning any failure into ``FileResult.error`` (one line naming the file).

    Bad input (``InputError``: format, budget) gets exit code 2; anything else is an internal error
    (exit code 1), still confined to this file. ``raise_errors=True`` lets the exception propagate
    instead (``--debug``).
    """
    limits = limits or current()
    try:
        try:
            with _gc_paused(), _memory_for(path, limits):
                report, timeline = analyze(load_snapshot(path, progress=progress, limits=limits), config)
        except MemoryError:
            raise _memory_error(path, limits) from None
        return FileResult(file=str(path), report=report, timeline=timeline)
    except Exception as e:
        if raise_errors:
            raise
        text = _one_line(e)
        if not isinstance(e, InputError):
            text = f"{path}: internal error: {type(e).__name__}: {text}"
        return FileResult(file=str(path), error=text, exit_code=exit_code_for(e) if isinstance(e, InputError) else 1)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 2000 else text[:1999] + "…"


def worker_count(n_files: int, workers: int | None = None) -> int:
    """Processes for ``n_files``: ``workers`` (or one per CPU), never more than the files or the CPUs."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    want = workers if workers is not None and workers > 0 else cpus
    return max(1, min(want, n_files, cpus))


def report_files(
    paths: Sequence[str],
    config: ReportConfig,
    *,
    progress: ProgressFn | None = None,
    on_file_done: Callable[[FileResult], None] | None = None,
    workers: int | None = None,
    raise_errors: bool = False,
    limits: Limits | None = None,
) -> list[FileResult]:
    """Report several files (forked workers when more than one), results in input order.

    A file that fails is a ``FileResult`` with ``error`` set; the others are reported. ``workers``
    is capped at :func:`worker_count` (files and CPUs). A worker that dies (killed for memory, say)
    takes only its own file: the files it left are retried one per fresh process. ``limits``
    (default: those in force here) is passed to every worker as an object.
    """
    limits = limits or current()
    if len(paths) == 1:
        res = [analyze_file(paths[0], config, progress, raise_errors=raise_errors, limits=limits)]
        if on_file_done:
            on_file_done(res[0])
        return res
    results: dict[int, FileResult] = {}
    n = worker_count(len(paths), workers)
    # fork: workers inherit the loaded modules (no re-import, no re-run of a ``__main__``); callers
    # must not have threads running when this forks (the CLI's multi-file progress bar has none)
    ctx = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
    broken: list[int] = []

    def done(i: int, res: FileResult) -> None:
        results[i] = res
        if on_file_done:
            on_file_done(res)

    with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
        futs = {
            pool.submit(analyze_file, p, config, raise_errors=raise_errors, limits=limits): i
            for i, p in enumerate(paths)
        }
        for fut in as_completed(futs):
            try:
                done(futs[fut], fut.result())
            except BrokenProcessPool:
                broken.append(futs[fut])
    for i in sorted(broken):  # one process each: the file that kills its worker is the one reported
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            try:
                res = pool.submit(analyze_file, paths[i], config, raise_errors=raise_errors, limits=limits).result()
            except BrokenProcessPool:
                res = FileResult(
                    file=paths[i],
                    error=f"{paths[i]}: the worker process died reading it (killed for memory?)",
                    exit_code=1,
                )
        done(i, res)
    return [results[i] for i in range(len(paths))]


_RANK = re.compile(r"rank[_-]?(\d+)|_(\d+)(?:\.[A-Za-z0-9]+)+$")  # snap_rank3.pickle, P_base_3.pickle.gz


def unique_labels(paths: Sequence[str]) -> list[str]:
    """Each path's shortest run of trailing components that no other path ends in (``slots4/snapshot.pickle.gz``
    for runs of one sweep, the file name alone when names differ); a path given twice gets ``#2``, ``#3``."""
    parts = [PurePath(p).parts or (str(p),) for p in paths]
    out = []
    for mine in parts:
        k = 1
        while k < len(mine) and any(other != mine and other[-k:] == mine[-k:] for other in parts):
            k += 1
        out.append("/".join(mine[-k:]))
    return _number_repeats(out, "#")


_SNAPSHOT_SUFFIX = re.compile(r"(\.(pickle|pkl|pt))?(\.gz)?$", re.IGNORECASE)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def plot_stems(paths: Sequence[str]) -> list[str]:
    """A file-name stem per path for its plot: its :func:`unique_labels` label less the snapshot suffix,
    folders joined by ``-``, characters other than letters, digits, ``._-`` as ``_``; unique, never empty."""
    stems = []
    for label in unique_labels(paths):
        label, _, copy = label.rpartition("#") if "#" in label.rsplit("/", 1)[-1] else (label, "", "")
        *folders, name = label.split("/")
        name = _SNAPSHOT_SUFFIX.sub("", name) or name
        stem = "-".join(_UNSAFE.sub("_", x).strip("._") or "_" for x in [*folders, name])
        stems.append(f"{stem}-{copy}" if copy else stem)
    return _number_repeats(stems, "-")


def _number_repeats(names: list[str], sep: str) -> list[str]:
    """``names`` with the second and later copies of a name suffixed ``{sep}2``, ``{sep}3``, ..."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(f"{name}{sep}{seen[name]}" if seen[name] > 1 else name)
    return out


def combine(results: Sequence[FileResult]) -> dict[str, Any]:
    """Min / median / max of each figure over the files that reported, naming the worst file (rank) by its
    :func:`unique_labels` label (runs of a sweep share a file name: their folders tell them apart)."""
    ok = [r for r in results if r.report is not None]
    label = dict(zip([r.file for r in results], unique_labels([r.file for r in results]), strict=True))
    figures: dict[str, Any] = {}
    for name in COMBINED_FIGURES:
        vals = [(r.report[name], r.file) for r in ok if isinstance(r.report.get(name), int)]  # type: ignore[union-attr]
        if not vals:
            continue
        worst = max(vals, key=lambda v: v[0])
        m = _RANK.search(os.path.basename(worst[1]))
        figures[name] = {
            "min": min(v for v, _ in vals),
            "median": statistics.median(v for v, _ in vals),
            "max": worst[0],
            "worst_file": worst[1],
            "worst_label": label[worst[1]],
            "worst_rank": int(m.group(1) or m.group(2)) if m else None,
        }
    return {"files": len(results), "reported": len(ok), "failed": len(results) - len(ok), "figures": figures}
