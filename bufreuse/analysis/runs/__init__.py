"""Runs: Megatron log parsing, run resolution, statistics, verdicts and comparisons, as data.

Nothing here prints or draws (tables and plots are :mod:`bufreuse.analysis.render`).
"""

from __future__ import annotations

from bufreuse.analysis.runs.comparability import config_caveats, run_config, scope_conflict
from bufreuse.analysis.runs.compare import ComparisonResult, RunComparison, compare_runs, compare_specs
from bufreuse.analysis.runs.grammars import FIELDS, GRAMMARS, FieldGrammar, LineGrammar
from bufreuse.analysis.runs.hostlist import MAX_EXPANDED_HOSTS, HostSet, parse_hostlist
from bufreuse.analysis.runs.megatron_log import (
    IterationRecord,
    IterationTable,
    MegatronLog,
    MemoryRecord,
    expand_hostlist,
    parse_log,
    parse_log_text,
    steady_iterations,
    steady_rows,
)
from bufreuse.analysis.runs.record import BUFFER_ALIASES, MIB, RunRecord, normalise_buffer, parse_slot_sizes
from bufreuse.analysis.runs.resolve import resolve_runs
from bufreuse.analysis.runs.stats import bootstrap_diff, bootstrap_median_diff, metric_values, run_stats, summarise
from bufreuse.analysis.runs.sweep_rows import SweepRow, checksum_mismatches, load_sweep_rows, rows_from_metrics
from bufreuse.analysis.runs.verdicts import (
    MIN_SAMPLES,
    THROUGHPUT_METRICS,
    VERDICTS,
    Bands,
    MetricDelta,
    explain_allocated,
    judge,
    node_sets,
)

__all__ = [
    "BUFFER_ALIASES",
    "FIELDS",
    "GRAMMARS",
    "MAX_EXPANDED_HOSTS",
    "MIB",
    "MIN_SAMPLES",
    "THROUGHPUT_METRICS",
    "VERDICTS",
    "Bands",
    "ComparisonResult",
    "FieldGrammar",
    "HostSet",
    "IterationRecord",
    "IterationTable",
    "LineGrammar",
    "MegatronLog",
    "MemoryRecord",
    "MetricDelta",
    "RunComparison",
    "RunRecord",
    "SweepRow",
    "bootstrap_diff",
    "bootstrap_median_diff",
    "checksum_mismatches",
    "compare_runs",
    "compare_specs",
    "config_caveats",
    "expand_hostlist",
    "explain_allocated",
    "judge",
    "load_sweep_rows",
    "metric_values",
    "node_sets",
    "normalise_buffer",
    "parse_hostlist",
    "parse_log",
    "parse_log_text",
    "parse_slot_sizes",
    "resolve_runs",
    "rows_from_metrics",
    "run_config",
    "run_stats",
    "scope_conflict",
    "steady_iterations",
    "steady_rows",
    "summarise",
]
