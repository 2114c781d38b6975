"""Pending-free bytes over time by allocation site: the report's series and the timeline's bands."""

from __future__ import annotations

import json
import random
from pathlib import Path

from snapshot_synth import Sim, frame
from typer.testing import CliRunner

from bufreuse.analysis.snapshot import ReportConfig, analyze, normalise
from bufreuse.analysis.snapshot.unpickle import load_pickle_file
from bufreuse.cli import app

MiB = 1 << 20
CONTROL = Path(__file__).resolve().parent.parent / "examples" / "sweep-h200" / "slots0" / "snapshot.pickle.gz"
runner = CliRunner()


def _brute_force_pending(trace: list[dict]) -> list[int]:
    """Pending-free bytes after each entry: queued at a free request unless completed right after."""
    pending: dict[int, int] = {}
    out = []
    for i, e in enumerate(trace):
        nxt = trace[i + 1] if i + 1 < len(trace) else None
        if e["action"] == "free_requested":
            plain = nxt is not None and nxt["action"] == "free_completed" and nxt["addr"] == e["addr"]
            if not plain:
                pending[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            pending.pop(e["addr"], None)
        out.append(sum(pending.values()))
    return out


def test_json_series_bands_sum_to_pending_free_and_name_the_moe_sites_h200() -> None:
    res = runner.invoke(app, ["snapshot-report", str(CONTROL), "--json"])
    assert res.exit_code == 0, res.output
    series = json.loads(res.stdout)["pending_free_series"]
    truth = _brute_force_pending(load_pickle_file(CONTROL)["device_traces"][0])
    idx = series["event_index"]
    assert 0 < len(idx) <= 2000 and len(series["x"]) == len(idx)
    assert set(series["sites"]) == {"bench/schedule.py:89:dispatch", "bench/schedule.py:102:expert_fc2_output"}
    for j, i in enumerate(idx):
        assert sum(v[j] for v in series["sites"].values()) == truth[i]
    peak = max(range(len(idx)), key=lambda j: truth[idx[j]])
    assert series["sites"]["bench/schedule.py:89:dispatch"][peak] > 0


def test_series_is_downsampled_to_2000_points_and_still_sums_exactly() -> None:
    rng = random.Random(3)
    sim = Sim()
    sites = [[frame(f"/work/model/layer{k}.py", "forward", 10 + k)] for k in range(9)]
    for _ in range(6000):
        kind = rng.choice((0, 0, 1, 2, 3))
        sim.op(kind, rng.randrange(1, 64) * MiB if kind == 0 else rng.randrange(1 << 20), 0)
        if sim.trace and sim.trace[-1]["action"] == "alloc":
            sim.trace[-1]["frames"] = rng.choice(sites)
    data = normalise({"segments": sim.segments(), "device_traces": [sim.trace]})
    report, timeline = analyze(data, ReportConfig(timeline_points=500))
    series = report["pending_free_series"]
    assert len(series["event_index"]) <= 2000 < len(sim.trace)
    assert len(series["sites"]) == 7  # six biggest sites, then "other sites"
    assert "other sites" in series["sites"]
    truth = [p for _, _, p in sim.series]
    for j, i in enumerate(series["event_index"]):
        assert sum(v[j] for v in series["sites"].values()) == truth[i]
    assert timeline is not None and timeline.pending_by_site is not None
    bands = sum(timeline.pending_by_site.values())
    assert ((timeline.active - timeline.allocated) == bands).all()


def test_plot_stacks_pending_free_by_site(tmp_path: Path) -> None:
    png = tmp_path / "t.png"
    res = runner.invoke(app, ["snapshot-report", str(CONTROL), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
