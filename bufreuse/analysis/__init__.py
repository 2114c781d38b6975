"""bufreuse.analysis: allocator snapshots, Megatron logs, comparisons and plots (never imports torch).

Names are exported lazily (PEP 562): ``from bufreuse.analysis import report_file`` imports only the
module that defines it, so a snapshot report never pays for pandas or matplotlib. To export a
name, add one ``"name": "module"`` entry to ``_EXPORTS``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS: dict[str, str] = {
    # allocator snapshots
    "SafeUnpickler": "unpickle",
    "load_pickle_file": "unpickle",
    "SnapshotData": "snapshot",
    "load_snapshot": "snapshot",
    "normalise": "snapshot",
    "Replay": "replay",
    "replay": "replay",
    "pending_blocks_at": "replay",
    "SiteRules": "snapshot_sites",
    "BUILTIN_CATEGORIES": "snapshot_sites",
    "ReportConfig": "snapshot_report",
    "FileResult": "snapshot_report",
    "report_file": "snapshot_report",
    "report_files": "snapshot_report",
    "combine": "snapshot_report",
    "timeline_figure": "snapshot_plot",
    "write_timeline_png": "snapshot_plot",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
