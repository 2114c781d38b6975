"""Real recordings from an H200 (torch 2.11, scripts/record_snapshots.py) against torch's own counters.

Each ``tests/data/snapshots/<name>.pickle[.gz]`` has a sidecar ``<name>.json`` with
``torch.cuda.max_memory_reserved()`` and ``memory_stats()`` taken at dump time, after
``reset_peak_memory_stats()`` ran just before recording started and 48 MiB were allocated first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bufreuse.analysis.snapshot.batch import report_file

DATA = Path(__file__).parent / "data" / "snapshots"
SIDECARS = sorted(DATA.glob("*.json"))
MiB = 1 << 20


def _load(name: str) -> tuple[dict, dict]:
    side = json.loads((DATA / f"{name}.json").read_text())
    return report_file(DATA / side["snapshot"]), side


def test_all_scenarios_present() -> None:
    names = {p.stem for p in SIDECARS}
    assert {"record_stream", "oom", "empty_cache", "expandable", "mempool", "cuda_graph"} <= names


@pytest.mark.parametrize("sidecar", SIDECARS, ids=lambda p: p.stem)
def test_max_reserved_equals_torch_max_memory_reserved(sidecar: Path) -> None:
    rep, side = _load(sidecar.stem)
    assert rep["max_reserved_bytes"] == side["max_memory_reserved"]
    assert rep["final_reserved_bytes"] == side["memory_reserved"]


@pytest.mark.parametrize("sidecar", [p for p in SIDECARS if p.stem != "truncated"], ids=lambda p: p.stem)
def test_max_active_equals_torch_requested_bytes_peak(sidecar: Path) -> None:
    # requested_bytes counts a block from malloc until its free completes: allocated + pending free
    rep, side = _load(sidecar.stem)
    assert rep["max_active_bytes"] == side["memory_stats"]["requested_bytes.all.peak"]


def test_record_stream_pending_free_names_the_dispatcher() -> None:
    rep, _ = _load("record_stream")
    assert rep["reserved_at_trace_start_bytes"] == 48 * MiB
    assert rep["pending_free_at_max_active_bytes"] == 72 * MiB
    (group,) = rep["pending_free_groups_at_max_active"]
    assert group["site"].endswith(":_dispatch_tokens")
    assert (group["count"], group["size_bytes"], group["category"]) == (3, 24 * MiB, "dispatch_output")
    assert group["stream"] != 0  # allocated on the side (communication) stream
    assert len(rep["streams"]) == 2
    assert rep["final_state_bytes"]["active_pending_free"] == 96 * MiB


def test_oom_reports_bytes_asked_and_free() -> None:
    rep, side = _load("oom")
    (oom,) = rep["oom_events"]
    assert oom["size_bytes"] > oom["device_free_bytes"] > 0
    assert side["memory_stats"]["num_ooms"] == 1


def test_empty_cache_segment_frees_lower_final_reserved() -> None:
    rep, side = _load("empty_cache")
    assert rep["final_reserved_bytes"] < rep["max_reserved_bytes"]
    assert side["memory_stats"]["num_device_free"] >= 1


def test_expandable_segments_replay_map_and_unmap() -> None:
    rep, side = _load("expandable")
    assert rep["expandable_segments"] >= 1
    assert rep["max_reserved_bytes"] == side["max_memory_reserved"]


@pytest.mark.parametrize("name", ["mempool", "cuda_graph"])
def test_private_pools_are_reported(name: str) -> None:
    rep, _ = _load(name)
    assert len(rep["pools"]) >= 2 and "0,0" in rep["pools"]
    assert sum(p["reserved_bytes"] for p in rep["pools"].values()) == rep["final_reserved_bytes"]


def test_truncated_recording_counts_frees_without_alloc() -> None:
    rep, _ = _load("truncated")
    assert rep["num_trace_events"] == 60
    assert rep["frees_without_alloc"] > 0
    assert any("ring buffer" in w for w in rep["warnings"])


def test_recording_off_says_so() -> None:
    rep, side = _load("no_history")
    assert rep["recording"] is False and rep["num_trace_events"] == 0
    assert any("recording was off" in w for w in rep["warnings"])
    assert rep["final_reserved_bytes"] == side["memory_reserved"]
