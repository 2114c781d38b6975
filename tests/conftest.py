"""Shared test set-up: ``gpu`` skips without CUDA, ``te`` without Transformer Engine; more hypothesis cases in CI.

``BUFREUSE_REQUIRE_TE=1`` (set by scripts/gpu-tests.sh once it installed real TE on the H200) turns a
missing Transformer Engine into a failure, so TE tests run there instead of skipping.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") == "true" else "dev")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


MEGATRON_SKIP_REASON = "needs megatron-core (pip install -e '.[megatron]', or bash scripts/ci/install-megatron.sh)"


TE_SKIP_REASON = "needs Transformer Engine (CUDA build; on the H200: scripts/device-te.sh, then scripts/gpu-tests.sh)"
_MISSING_MODULE = re.compile(r"No module named '([A-Za-z_][\w]*)")
_FIXES = {"megatron": MEGATRON_SKIP_REASON, "transformer_engine": TE_SKIP_REASON}
"""What a skip for a missing module says to do, by top-level module: a bare ``importorskip("megatron.core")``
says only "No module named 'megatron'"; the hooks below add the fix to every such skip reason."""


def _name_the_fix(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    path, line, reason = report.longrepr
    found = _MISSING_MODULE.search(reason)
    fix = _FIXES.get(found.group(1)) if found else None
    if fix is not None and fix not in reason:
        report.longrepr = (path, line, f"{reason}: {fix}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _name_the_fix(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, None]:
    outcome = yield
    _name_the_fix(outcome.get_result())


@pytest.fixture(scope="module")
def parallel():
    """A world of one process with megatron's model-parallel state set up (CPU, gloo) for the module; modules that
    need another world (the GPU ones, HybridEP's) define their own ``parallel``.

    Skips (with the reason) when megatron-core does not import: a fixture runs before the test body, so a test's
    own ``importorskip`` would come too late."""
    pytest.importorskip("megatron.core", reason=MEGATRON_SKIP_REASON)
    from megatron_cpu import cpu_moe_parallel

    with cpu_moe_parallel():
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("te") for item in items) and not _te_available():
        if os.environ.get("BUFREUSE_REQUIRE_TE", "") not in ("", "0"):
            raise pytest.UsageError("BUFREUSE_REQUIRE_TE is set but transformer_engine.pytorch does not import")
        skip_te = pytest.mark.skip(reason=TE_SKIP_REASON)
        for item in items:
            if item.get_closest_marker("te"):
                item.add_marker(skip_te)
    if any(item.get_closest_marker("gpu") for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu-tests.sh on a GPU machine)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


# -- test outcomes for scripts/ci/skipped-everywhere.py -------------------------------------------------
# With BUFREUSE_TEST_OUTCOMES=FILE, a run writes one JSON object: every test's outcome (passed / failed /
# skipped, with the skip reason) and its markers, plus modules skipped while collecting. .ci/run sets it
# for the CPU run; the GPU run can set it too (BUFREUSE_TEST_OUTCOMES=$OUT/gpu.json bash scripts/gpu-tests.sh).

_OUTCOMES: dict[str, dict] = {}
_MARKERS: dict[str, list[str]] = {}
_BUILTIN_MARKS = {"skip", "skipif", "xfail", "parametrize", "usefixtures", "filterwarnings"}


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        _MARKERS[item.nodeid] = sorted({m.name for m in item.iter_markers()} - _BUILTIN_MARKS)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and os.environ.get("BUFREUSE_TEST_OUTCOMES"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _OUTCOMES[report.nodeid] = {"outcome": "skipped", "reason": reason, "markers": [], "collection": True}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not os.environ.get("BUFREUSE_TEST_OUTCOMES"):
        return
    if report.when == "call" or report.outcome != "passed":  # setup skips/errors, call results
        entry = _OUTCOMES.get(report.nodeid)
        if entry is not None and entry["outcome"] != "passed":
            return  # keep the first non-pass (a teardown error after a skip stays a skip)
        reason = report.longrepr[-1] if report.skipped and isinstance(report.longrepr, tuple) else None
        _OUTCOMES[report.nodeid] = {
            "outcome": "xfailed" if hasattr(report, "wasxfail") else report.outcome,
            "reason": reason,
            "markers": _MARKERS.get(report.nodeid, []),
        }


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("BUFREUSE_TEST_OUTCOMES")
    if not path or hasattr(session.config, "workerinput"):
        return
    import json
    import sys

    doc = {
        "argv": sys.argv[1:],
        "cuda": _cuda_available(),
        "markexpr": session.config.getoption("markexpr", ""),
        "tests": _OUTCOMES,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
