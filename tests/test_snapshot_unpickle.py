"""The restricted loader: plain data only, gzip by content, bad input as one SnapshotFormatError."""

from __future__ import annotations

import gzip
import os
import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snapshot_synth import Sim, write

from bufreuse.analysis.snapshot.load import load_snapshot
from bufreuse.analysis.snapshot.unpickle import load_pickle_file
from bufreuse.errors import SnapshotFormatError

DATA = Path(__file__).parent / "data" / "snapshots"


class _RunsCommand:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # what a hostile pickle does: call os.system on load
        return (os.system, (f"touch {self.marker}",))


def test_reduce_pickle_refused_naming_the_global_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = write(tmp_path / "evil.pickle", {"segments": [], "device_traces": [[_RunsCommand(str(marker))]]})
    with pytest.raises(SnapshotFormatError, match=r"evil\.pickle: refused to load global (posix|os)\.system"):
        load_pickle_file(path)
    assert not marker.exists()


def test_gzip_detected_by_content_not_name(tmp_path: Path) -> None:
    obj = {"segments": [], "device_traces": [[]]}
    plain_named_gz = write(tmp_path / "a.pickle.gz", obj)
    gz_named_plain = write(tmp_path / "b.pickle", obj, gz=True)
    assert load_pickle_file(plain_named_gz) == obj
    assert load_pickle_file(gz_named_plain) == obj


def test_progress_reports_whole_file(tmp_path: Path) -> None:
    sim = Sim()
    for i in range(2000):
        sim.op(i % 3, 1000 + i, 0)
    path = write(tmp_path / "s.pickle", {"segments": sim.segments(), "device_traces": [sim.trace]}, gz=True)
    seen: list[tuple[int, int]] = []
    load_pickle_file(path, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (path.stat().st_size, path.stat().st_size)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "empty file"),
        (b"\xff" + os.urandom(64) + b"\x00", "not a pickle"),  # 0xff is no pickle opcode (urandom alone sometimes was)
        (gzip.compress(pickle.dumps({"segments": [1] * 1000}))[:-30], "truncated or corrupt gzip"),
        (pickle.dumps({"segments": []})[:-3], "truncated pickle|not a pickle"),
        (b"\x1f\x8bnot really gzip", "gzip"),
    ],
    ids=["empty", "random", "truncated-gzip", "truncated-pickle", "bad-gzip-header"],
)
def test_bad_files_raise_one_line_naming_the_file(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotFormatError, match=problem) as info:
        load_snapshot(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_file_is_input_error(tmp_path: Path) -> None:
    with pytest.raises(SnapshotFormatError, match="cannot read"):
        load_snapshot(tmp_path / "nope.pickle")


@pytest.mark.parametrize(
    ("obj", "problem"),
    [
        ({"device_traces": []}, "no 'segments' key"),
        ({"segments": {}, "device_traces": []}, "'segments' is a dict of 0 items, expected a list"),
        ({"segments": [], "device_traces": [{"a": 1}]}, r"device_traces\[0\] is a dict of 1 items, expected a list"),
        ({"segments": [{"total_size": -5, "blocks": []}]}, r"segments\[0\]\.total_size is -5, expected an int"),
        ({"segments": [{"total_size": 5, "blocks": [{"size": 1, "state": "weird"}]}]}, r"blocks\[0\]\.state"),
        ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": -3}]]}, r"\[0\]\[0\]\.size is -3"),
        ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "stream": 0}]]}, r"\[0\] has no 'size'"),
        ({"segments": [], "device_traces": [[{"action": "alloc", "addr": "x", "size": 1}]]}, r"addr is 'x'"),
        ({"segments": [], "device_traces": [[["alloc"]]]}, r"\[0\]\[0\] is a list of 1 items"),
        ("a string", "top level is 'a string'"),
    ],
)
def test_wrong_structure_names_the_field(tmp_path: Path, obj: object, problem: str) -> None:
    with pytest.raises(SnapshotFormatError, match=problem):
        load_snapshot(write(tmp_path / "s.pickle", obj))


_VALID = pickle.dumps(
    {
        "segments": [{"address": 1, "total_size": 4096, "stream": 0, "blocks": [{"size": 512, "state": "inactive"}]}],
        "device_traces": [[{"action": "alloc", "addr": 1, "size": 512, "stream": 0, "frames": []}]],
    }
)


_mutated = st.builds(
    lambda i, b: _VALID[:i] + b + _VALID[i + len(b) :], st.integers(0, len(_VALID)), st.binary(min_size=1, max_size=4)
)
_cut = st.builds(lambda i: _VALID[:i], st.integers(0, len(_VALID)))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300) | _mutated | _cut)
def test_loader_fuzz_only_raises_snapshot_format_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.pickle"
    path.write_bytes(data)
    try:
        load_snapshot(path)
    except SnapshotFormatError as e:
        assert "fuzz.pickle" in str(e)
