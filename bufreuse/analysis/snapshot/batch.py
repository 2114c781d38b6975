"""Report snapshot files: one file, several in worker processes, and the summary over them (ranks).

:func:`report_file` returns the ``--json`` object of one file; :func:`report_files` reports several
(one forked process per file) and keeps a bad file's error next to the others' reports;
:func:`combine` gives min / median / max of the headline figures, naming the worst file.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import statistics
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bufreuse.analysis.snapshot.load import load_snapshot
from bufreuse.analysis.snapshot.report import ReportConfig, Timeline, analyze
from bufreuse.analysis.snapshot.unpickle import ProgressFn
from bufreuse.errors import SnapshotFormatError

__all__ = ["COMBINED_FIGURES", "FileResult", "analyze_file", "combine", "report_file", "report_files"]

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
    path: str | os.PathLike[str], *, categories: dict[str, str] | None = None, config: ReportConfig | None = None
) -> dict[str, Any]:
    """The ``--json`` object for one file; raises ``SnapshotFormatError`` on bad input."""
    config = config or ReportConfig()
    if categories:
        config = ReportConfig(
            categories={**config.categories, **categories}, site_frame=config.site_frame, site_skip=config.site_skip
        )
    with _gc_paused():
        return analyze(load_snapshot(path), config)[0]


def analyze_file(
    path: str, config: ReportConfig, progress: ProgressFn | None = None, *, raise_errors: bool = False
) -> FileResult:
    """Report one file, turning bad input into ``FileResult.error`` (one line naming the file).

    ``raise_errors=True`` lets the ``SnapshotFormatError`` propagate instead (``--debug``).
    """
    try:
        with _gc_paused():
            report, timeline = analyze(load_snapshot(path, progress=progress), config)
        return FileResult(file=str(path), report=report, timeline=timeline)
    except SnapshotFormatError as e:
        if raise_errors:
            raise
        return FileResult(file=str(path), error=" ".join(str(e).split()))


def report_files(
    paths: Sequence[str],
    config: ReportConfig,
    *,
    progress: ProgressFn | None = None,
    on_file_done: Callable[[FileResult], None] | None = None,
    workers: int | None = None,
    raise_errors: bool = False,
) -> list[FileResult]:
    """Report several files (one process per file when more than one), results in input order."""
    if len(paths) == 1:
        res = [analyze_file(paths[0], config, progress, raise_errors=raise_errors)]
        if on_file_done:
            on_file_done(res[0])
        return res
    results: dict[int, FileResult] = {}
    n = workers or min(len(paths), os.cpu_count() or 1)
    # fork: workers inherit the loaded modules (no re-import, no re-run of a ``__main__``); callers
    # must not have threads running when this forks (the CLI's multi-file progress bar has none)
    ctx = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
        futs = {pool.submit(analyze_file, p, config, raise_errors=raise_errors): i for i, p in enumerate(paths)}
        for fut in as_completed(futs):
            results[futs[fut]] = fut.result()
            if on_file_done:
                on_file_done(results[futs[fut]])
    return [results[i] for i in range(len(paths))]


_RANK = re.compile(r"rank[_-]?(\d+)|_(\d+)(?:\.[A-Za-z0-9]+)+$")  # snap_rank3.pickle, P_base_3.pickle.gz


def combine(results: Sequence[FileResult]) -> dict[str, Any]:
    """Min / median / max of each figure over the files that reported, naming the worst file (rank)."""
    ok = [r for r in results if r.report is not None]
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
            "worst_rank": int(m.group(1) or m.group(2)) if m else None,
        }
    return {"files": len(results), "reported": len(ok), "failed": len(results) - len(ok), "figures": figures}
