"""On a CUDA GPU: record fresh snapshots and check the report against torch's counters live.

Runs ``scripts/record_snapshots.py`` (each scenario in its own process) into a temporary folder,
then compares every sidecar with the report of its snapshot, as ``test_snapshot_real.py`` does for
the committed recordings. Run with ``bash scripts/gpu-tests.sh tests/test_snapshot_gpu.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bufreuse.analysis.snapshot.batch import report_file

SCRIPT = Path(__file__).parent.parent / "scripts" / "record_snapshots.py"


@pytest.mark.gpu
def test_live_recordings_match_torch_counters(tmp_path: Path) -> None:
    scenarios = ["record_stream", "expandable", "cuda_graph", "oom"]
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--only", *scenarios], check=True)
    for name in scenarios:
        side = json.loads((tmp_path / f"{name}.json").read_text())
        rep = report_file(tmp_path / side["snapshot"])
        assert rep["max_reserved_bytes"] == side["max_memory_reserved"], name
        assert rep["final_reserved_bytes"] == side["memory_reserved"], name
        assert rep["max_active_bytes"] == side["memory_stats"]["requested_bytes.all.peak"], name
    rep = report_file(tmp_path / "record_stream.pickle.gz")
    assert rep["pending_free_by_category_at_max_active"]["dispatch_output"] > 0
