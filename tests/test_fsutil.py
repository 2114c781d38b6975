"""Atomic writes (``bufreuse.fsutil``) and the failure-metrics record written through them."""

from __future__ import annotations

import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest

from bufreuse.analysis.snapshot.unpickle import load_pickle_file
from bufreuse.errors import InputError, OutputError, exit_code_for
from bufreuse.fsutil import atomic_write_json, atomic_write_text, atomic_writer, current_umask, read_json
from bufreuse.launch.base import write_failure_metrics
from bufreuse.launch.megatron_collect import compress_rank0_snapshot
from bufreuse.sweepdir import METRIC_FIGURES, STATUSES, ConfigPaths, blank_metrics


def test_atomic_writer_error_keeps_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "metrics.json"
    atomic_write_json(target, {"status": "ok"})
    with pytest.raises(RuntimeError), atomic_writer(target) as f:
        f.write(b'{"status": "fai')
        raise RuntimeError("killed midway")
    assert read_json(target) == {"status": "ok"}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_atomic_write_into_a_file_raises_output_error(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(OutputError, match=r"taken/x\.json: cannot write here") as info:
        atomic_write_json(tmp_path / "taken" / "x.json", {})
    assert isinstance(info.value, InputError) and isinstance(info.value, OSError)
    assert exit_code_for(info.value) == 2


def test_atomic_write_onto_a_folder_raises_output_error(tmp_path: Path) -> None:
    (tmp_path / "plots").mkdir()
    with pytest.raises(OutputError, match="is a folder"):
        atomic_write_json(tmp_path / "plots", {})
    assert [p.name for p in tmp_path.iterdir()] == ["plots"]


def test_blank_metrics_has_every_key_and_fresh_maps() -> None:
    a = blank_metrics(status="failed", error="boom", config={"slots": 4}, env={}, started_at=None)
    assert set(METRIC_FIGURES) | {"status", "error", "config", "env", "started_at", "finished_at"} == set(a)
    a["ring_bytes"]["dispatch_output"] = 1
    b = blank_metrics(status="ok", error=None, config={}, env={}, started_at=None)
    assert b["ring_bytes"] == {} and METRIC_FIGURES["ring_bytes"] == {}
    with pytest.raises(ValueError, match="status"):
        blank_metrics(status="exploded", error=None, config={}, env={}, started_at=None)
    assert "ok" in STATUSES


def test_write_failure_metrics_uses_the_shared_schema(tmp_path: Path) -> None:
    paths = ConfigPaths(tmp_path / "slots4")
    paths.folder.mkdir()
    atomic_write_json(paths.config, {"slots": 4})
    m = write_failure_metrics(paths, status="timeout", error="killed")
    assert read_json(paths.metrics) == m
    assert m["config"] == {"slots": 4} and m["max_reserved_bytes"] is None and m["ring_bytes"] == {}


def test_compress_rank0_snapshot_interrupted_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = ConfigPaths(tmp_path / "megatron")
    paths.folder.mkdir()
    (paths.folder / "snapshot_0.pickle").write_bytes(pickle.dumps({"segments": []}))

    def fail_midway(src, dst, length=0):  # type: ignore[no-untyped-def]
        dst.write(src.read(4))
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "copyfileobj", fail_midway)
    with pytest.raises(KeyboardInterrupt):
        compress_rank0_snapshot(paths)
    assert not paths.snapshot.exists()  # a retry must not take a truncated file as done
    monkeypatch.undo()
    assert compress_rank0_snapshot(paths) == str(paths.snapshot)
    assert load_pickle_file(paths.snapshot) == {"segments": []}


def test_atomic_write_new_file_is_0644_under_umask_022(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        target = atomic_write_json(tmp_path / "metrics.json", {"status": "ok"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_atomic_write_respects_a_stricter_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        assert current_umask() == 0o077
        target = atomic_write_text(tmp_path / "private.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_atomic_write_keeps_an_existing_files_mode(tmp_path: Path) -> None:
    target = tmp_path / "shared.json"
    target.write_text("{}")
    target.chmod(0o664)
    atomic_write_json(target, {"a": 1})
    assert stat.S_IMODE(target.stat().st_mode) == 0o664 and read_json(target) == {"a": 1}
