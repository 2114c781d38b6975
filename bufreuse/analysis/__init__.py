"""bufreuse.analysis: allocator snapshots, Megatron runs and their comparison, and rendering (no torch).

- :mod:`.snapshot`: restricted unpickling, the snapshot schema, numpy columns, replay, sites, reports;
- :mod:`.runs`: Megatron log parsing, run resolution, sweep rows, statistics, verdicts, comparisons;
- :mod:`.render`: every rich table and matplotlib figure, from the data the other two return.

Names are exported lazily (PEP 562): ``from bufreuse.analysis import report_file`` imports only the
subpackage that defines it, so a snapshot report never pays for rich or matplotlib. To export a
name, add one ``"name": "subpackage"`` entry to ``_EXPORTS``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS: dict[str, str] = {
    # allocator snapshots
    "SafeUnpickler": "snapshot",
    "load_pickle_file": "snapshot",
    "SnapshotData": "snapshot",
    "load_snapshot": "snapshot",
    "normalise": "snapshot",
    "Replay": "snapshot",
    "replay": "snapshot",
    "pending_blocks_at": "snapshot",
    "SiteRules": "snapshot",
    "BUILTIN_CATEGORIES": "snapshot",
    "ReportConfig": "snapshot",
    "FileResult": "snapshot",
    "report_file": "snapshot",
    "report_files": "snapshot",
    "combine": "snapshot",
    # runs and comparisons
    "Bands": "runs",
    "ComparisonResult": "runs",
    "compare_runs": "runs",
    "compare_specs": "runs",
    "parse_log": "runs",
    "resolve_runs": "runs",
    # rendering
    "timeline_figure": "render",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
