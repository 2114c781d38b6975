"""Workloads a configuration can name in ``config.json["workload"]``.

Values are ``"module:function"`` import strings so that naming a workload imports nothing heavy;
each function has the signature ``run_configuration(config: dict, paths: ConfigPaths) -> dict``
and returns the workload's metrics (the runner adds status, environment and timestamps).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from bufreuse.errors import InputError
from bufreuse.sweepdir import ConfigPaths

__all__ = ["WORKLOADS", "resolve_workload"]

WorkloadFn = Callable[[dict[str, Any], ConfigPaths], dict[str, Any]]

WORKLOADS: dict[str, str] = {
    "proxy": "bufreuse.bench.proxy:run_configuration",
    "cpu-smoke": "bufreuse.bench.cpu_smoke:run_configuration",
}


def resolve_workload(name: str, extra: dict[str, str] | None = None) -> WorkloadFn:
    """Import and return the workload function registered as ``name`` (in ``extra`` or :data:`WORKLOADS`).

    ``extra`` adds ``name -> "module:function"`` entries for this call only (the runner's
    ``$BUFREUSE_WORKLOADS``); :data:`WORKLOADS` itself is never changed.
    """
    table = {**WORKLOADS, **(extra or {})}
    try:
        target = table[name]
    except KeyError:
        raise InputError(f"unknown workload {name!r}; choose from {', '.join(sorted(table))}") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
