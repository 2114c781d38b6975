"""Workloads a configuration can name in ``config.json["workload"]``.

Values are ``"module:function"`` import strings so that naming a workload imports nothing heavy;
each function has the signature ``run_configuration(config: dict, paths: ConfigPaths) -> dict``
and returns the workload's metrics (the runner adds status, environment and timestamps).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

from bufreuse.errors import InputError
from bufreuse.sweepdir import ConfigPaths

__all__ = ["EXTRA_WORKLOADS_ENV", "WORKLOADS", "extra_workloads", "resolve_workload"]

EXTRA_WORKLOADS_ENV = "BUFREUSE_WORKLOADS"
"""``name=module:function,...``: workloads added without editing the package (tests, experiments)."""

WorkloadFn = Callable[[dict[str, Any], ConfigPaths], dict[str, Any]]

WORKLOADS: dict[str, str] = {
    "proxy": "bufreuse.bench.proxy:run_configuration",
    "cpu-smoke": "bufreuse.bench.cpu_smoke:run_configuration",
}


def extra_workloads(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The workloads named in ``$BUFREUSE_WORKLOADS`` of ``environ`` (default: this process's)."""
    extra: dict[str, str] = {}
    value = (os.environ if environ is None else environ).get(EXTRA_WORKLOADS_ENV, "")
    for item in filter(None, value.split(",")):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise InputError(f"${EXTRA_WORKLOADS_ENV}: {item!r} is not name=module:function")
        extra[name.strip()] = target.strip()
    return extra


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
