"""Allocator snapshots: restricted unpickling, the schema, numpy columns, replay, sites and the report.

Data only: nothing here prints or draws (tables and plots are :mod:`bufreuse.analysis.render`).
"""

from __future__ import annotations

from bufreuse.analysis.snapshot.batch import (
    COMBINED_FIGURES,
    FileResult,
    analyze_file,
    combine,
    report_file,
    report_files,
)
from bufreuse.analysis.snapshot.load import EventTable, FinalState, SnapshotData, load_snapshot, normalise
from bufreuse.analysis.snapshot.replay import PendingBlock, Replay, pending_blocks_at, replay
from bufreuse.analysis.snapshot.report import ReportConfig, Timeline, analyze
from bufreuse.analysis.snapshot.schema import (
    ACTIONS,
    ANNOTATION_ACTIONS,
    BLOCK_STATES,
    Block,
    Frame,
    Segment,
    Snapshot,
    TraceEntry,
)
from bufreuse.analysis.snapshot.sites import (
    BEFORE_TRACE_SITE,
    BUILTIN_CATEGORIES,
    DEFAULT_SITE_SKIP,
    NO_FRAMES_SITE,
    UNKNOWN_SITE,
    SiteRules,
    parse_category_options,
)
from bufreuse.analysis.snapshot.unpickle import (
    GZIP_MAGIC,
    ProgressFn,
    RefusedGlobalError,
    SafeUnpickler,
    load_pickle_file,
    loads_restricted,
)

__all__ = [
    "ACTIONS",
    "ANNOTATION_ACTIONS",
    "BEFORE_TRACE_SITE",
    "BLOCK_STATES",
    "BUILTIN_CATEGORIES",
    "COMBINED_FIGURES",
    "DEFAULT_SITE_SKIP",
    "GZIP_MAGIC",
    "NO_FRAMES_SITE",
    "UNKNOWN_SITE",
    "Block",
    "EventTable",
    "FileResult",
    "FinalState",
    "Frame",
    "PendingBlock",
    "ProgressFn",
    "RefusedGlobalError",
    "Replay",
    "ReportConfig",
    "SafeUnpickler",
    "Segment",
    "SiteRules",
    "Snapshot",
    "SnapshotData",
    "Timeline",
    "TraceEntry",
    "analyze",
    "analyze_file",
    "combine",
    "load_pickle_file",
    "load_snapshot",
    "loads_restricted",
    "normalise",
    "parse_category_options",
    "pending_blocks_at",
    "replay",
    "report_file",
    "report_files",
]
