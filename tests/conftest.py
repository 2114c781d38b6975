"""Shared test set-up: ``gpu`` skips without CUDA, ``te`` without Transformer Engine; more hypothesis cases in CI.

``BUFREUSE_REQUIRE_TE=1`` (set by scripts/gpu-tests.sh once it installed real TE on the H200) turns a
missing Transformer Engine into a failure, so TE tests run there instead of skipping.
"""

from __future__ import annotations

import os

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("te") for item in items) and not _te_available():
        if os.environ.get("BUFREUSE_REQUIRE_TE", "") not in ("", "0"):
            raise pytest.UsageError("BUFREUSE_REQUIRE_TE is set but transformer_engine.pytorch does not import")
        skip_te = pytest.mark.skip(
            reason="needs Transformer Engine (CUDA build; on the H200: scripts/device-te.sh, then scripts/gpu-tests.sh)"
        )
        for item in items:
            if item.get_closest_marker("te"):
                item.add_marker(skip_te)
    if any(item.get_closest_marker("gpu") for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu-tests.sh on a GPU machine)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
