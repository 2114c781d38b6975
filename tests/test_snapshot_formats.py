"""Snapshot formats we cannot record on the H200 (torch 2.11), built from the schema torch wrote then.

Each builder cites the torch version whose ``memory_snapshot()`` / ``_snapshot()`` output it
follows (read from torch's ``cuda/memory.py`` docstrings and ``csrc/cuda`` snapshot code of that
release); the 2.11 format itself is covered by the real recordings in ``test_snapshot_real.py``.
"""

from __future__ import annotations

from pathlib import Path

from snapshot_synth import TORCH, USER, block, entry, frame, segment, write

from bufreuse.analysis.snapshot.batch import report_file

MiB = 1 << 20
DISPATCH = [TORCH, frame("/w/megatron/core/transformer/moe/token_dispatcher.py", "dispatch"), USER]


def _legacy_block(size: int, state: str) -> dict:
    # torch 1.13 / 2.0: no address, no requested_size; frames live in "history" when recording
    return {"size": size, "state": state, "history": [{"addr": 0, "real_size": size, "frames": [USER]}]}


def _legacy_segment(addr: int, total: int, blocks: list[dict]) -> dict:
    return {
        "device": 0,
        "address": addr,
        "total_size": total,
        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
        "stream": 0,
        "segment_type": "large",
        "blocks": blocks,
    }


def test_torch_1_13_segments_list_reports_final_state(tmp_path: Path) -> None:
    # torch 1.13 torch.cuda.memory_snapshot(): a bare list of segments, no trace
    snap = [
        _legacy_segment(
            1 << 30, 20 * MiB, [_legacy_block(8 * MiB, "active_allocated"), _legacy_block(12 * MiB, "inactive")]
        ),
        _legacy_segment(2 << 30, 2 * MiB, [_legacy_block(2 * MiB, "active_pending_free")]),
    ]
    rep = report_file(write(tmp_path / "s.pickle", snap))
    assert rep["format"] == "segments-list" and rep["recording"] is False
    assert rep["final_state_bytes"] == {
        "active_allocated": 8 * MiB,
        "active_pending_free": 2 * MiB,
        "inactive": 12 * MiB,
    }
    assert rep["max_reserved_bytes"] == 22 * MiB
    assert any("recording was off" in w for w in rep["warnings"])


def test_torch_2_0_trace_without_time_us(tmp_path: Path) -> None:
    # torch 2.0 torch.cuda.memory._snapshot(): device_traces entries {action, addr, size, stream, frames}
    tr = [
        {"action": "segment_alloc", "addr": 1 << 30, "size": 20 * MiB, "stream": 0, "frames": DISPATCH},
        {"action": "alloc", "addr": 1 << 30, "size": 8 * MiB, "stream": 0, "frames": DISPATCH},
        {"action": "free_requested", "addr": 1 << 30, "size": 8 * MiB, "stream": 0, "frames": [USER]},
        {"action": "oom", "addr": 0, "size": 80 << 30, "stream": 0, "device_free": 3 << 30, "frames": [USER]},
    ]
    segs = [
        _legacy_segment(
            1 << 30, 20 * MiB, [_legacy_block(8 * MiB, "active_pending_free"), _legacy_block(12 * MiB, "inactive")]
        )
    ]
    rep = report_file(write(tmp_path / "s.pickle", {"segments": segs, "device_traces": [tr]}, gz=True))
    assert rep["max_active_time_us"] is None
    assert rep["pending_free_at_max_active_bytes"] == 8 * MiB
    assert rep["pending_free_groups_at_max_active"][0]["category"] == "dispatch_output"
    assert rep["oom_events"][0]["device_free_bytes"] == 3 << 30
    assert rep["max_reserved_bytes"] == 20 * MiB


def test_torch_2_1_expandable_segments_map_unmap_and_time_us(tmp_path: Path) -> None:
    # torch 2.1 added expandable segments (segment_map / segment_unmap), time_us and requested_size
    base = 1 << 40
    tr = [
        entry("segment_map", base, 20 * MiB, time_us=10),
        entry("alloc", base, 19 * MiB, time_us=11),
        entry("segment_map", base + 20 * MiB, 40 * MiB, time_us=12),
        entry("alloc", base + 20 * MiB, 40 * MiB, time_us=13),
        entry("free_requested", base + 20 * MiB, 40 * MiB, time_us=14),
        entry("free_completed", base + 20 * MiB, 40 * MiB, time_us=15),
        entry("segment_unmap", base + 20 * MiB, 40 * MiB, time_us=16),
    ]
    segs = [segment(base, 20 * MiB, [block(base, 20 * MiB, "active_allocated", 19 * MiB)], is_expandable=True)]
    rep = report_file(write(tmp_path / "s.pickle", {"segments": segs, "device_traces": [tr]}))
    assert rep["max_reserved_bytes"] == 60 * MiB and rep["max_reserved_time_us"] == 12
    assert rep["reserved_at_trace_start_bytes"] == 0
    assert rep["max_active_bytes"] == 59 * MiB
    assert rep["expandable_segments"] == 1
    assert rep["fragmentation"]["rounding_waste_bytes"] == 1 * MiB


def test_newer_optional_keys_and_unknown_actions_are_tolerated(tmp_path: Path) -> None:
    # torch 2.5+ entries carry compile_context / user_metadata; 2.7+ top-level allocator_settings and
    # external_annotations; pool_id tuples on entries; "user_defined" marker entries are skipped
    tr = [
        entry("alloc", 64, 512, compile_context="N/A", user_metadata="", pool_id=(0, 0), time_us=1),
        {"action": "user_defined", "size": 0, "stream": 0, "addr": 0, "frames": [], "time_us": 2},
        entry("free_requested", 64, 512, time_us=3),
    ]
    snap = {
        "segments": [segment(64, 2 * MiB, [block(64, 512, "active_pending_free", 512)], segment_pool_id=(0, 0))],
        "device_traces": [tr],
        "allocator_settings": {"expandable_segments": False},
        "external_annotations": [{"stage": "START", "name": "fwd", "device": 0, "time_us": 1}],
    }
    rep = report_file(write(tmp_path / "s.pickle", snap))
    assert rep["pending_free_at_max_active_bytes"] == 512
    assert rep["skipped_entries"] == {"user_defined": 1} and rep["warnings"] == []


def test_unknown_actions_are_skipped_with_a_warning(tmp_path: Path) -> None:
    tr = [entry("alloc", 64, 512), {"action": "teleport", "size": 0, "stream": 0, "addr": 0}]
    rep = report_file(write(tmp_path / "s.pickle", {"segments": [], "device_traces": [tr]}))
    assert any("'teleport' skipped" in w for w in rep["warnings"])


def test_active_awaiting_free_is_pending_free(tmp_path: Path) -> None:
    # the state name in torch's _snapshot docstring ("active_awaiting_free") next to the C++ one
    segs = [segment(64, 2 * MiB, [block(64, MiB, "active_awaiting_free", MiB), block(64 + MiB, MiB, "inactive")])]
    rep = report_file(write(tmp_path / "s.pickle", {"segments": segs, "device_traces": []}))
    assert rep["final_state_bytes"]["active_pending_free"] == MiB


def test_several_devices_report_the_one_with_the_highest_peak(tmp_path: Path) -> None:
    segs = [
        segment(64, 2 * MiB, [block(64, 2 * MiB, "active_allocated", 100)], device=0),
        segment(128, 40 * MiB, [block(128, 40 * MiB, "active_allocated", 30 * MiB)], device=1),
    ]
    t0 = [entry("segment_alloc", 64, 2 * MiB), entry("alloc", 64, 100)]
    t1 = [entry("segment_alloc", 128, 40 * MiB), entry("alloc", 128, 30 * MiB)]
    rep = report_file(write(tmp_path / "s.pickle", {"segments": segs, "device_traces": [t0, t1]}))
    assert rep["device"] == 1 and rep["max_reserved_bytes"] == 40 * MiB
    assert rep["devices"]["0"]["max_reserved_bytes"] == 2 * MiB


def test_empty_trace_lists_mean_recording_was_off(tmp_path: Path) -> None:
    segs = [segment(64, 2 * MiB, [block(64, 2 * MiB, "inactive")])]
    rep = report_file(write(tmp_path / "s.pickle", {"segments": segs, "device_traces": [[]]}))
    assert rep["recording"] is False
    assert rep["pending_free_groups_at_max_active"] == []
