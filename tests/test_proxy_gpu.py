"""The proxy on a real GPU: a small sweep end to end, identical results, no pending-free ring buffers."""

from __future__ import annotations

from pathlib import Path

import pytest

from bufreuse.analysis.render.plots import sweep_figures
from bufreuse.analysis.runs.sweep_rows import checksum_mismatches, load_sweep_rows
from bufreuse.cli._common import write_figures
from bufreuse.launch.sweep import SweepSpec, run_sweep
from bufreuse.sweepdir import SweepDir

pytestmark = pytest.mark.gpu

SMALL = {"hidden": 1024, "ffn": 512, "tokens": 4096, "local_experts": 4, "microbatches": 6, "steps": 5,
         "warmup_steps": 2, "record_steps": 2, "comm_ms": 0.3}  # fmt: skip


@pytest.fixture(scope="module")
def eager_sweep(tmp_path_factory: pytest.TempPathFactory) -> SweepDir:
    root = tmp_path_factory.mktemp("sweeps")
    spec = SweepSpec(slots=[0, 2, 4], modes=["stream-ordered"], params=SMALL, root=str(root), name="e", timeout_s=300)
    res = run_sweep(spec)
    assert res.statuses == dict.fromkeys(res.config_ids, "ok"), res.statuses
    return SweepDir(res.folder)


def test_small_sweep_end_to_end_writes_every_file(eager_sweep: SweepDir) -> None:
    for cid in eager_sweep.config_ids():
        p = eager_sweep.paths(cid)
        m = p.read_metrics()
        assert m is not None and m["status"] == "ok"
        assert p.snapshot.stat().st_size > 0 and p.log.stat().st_size > 0
        assert m["max_reserved_bytes"] >= m["max_allocated_bytes"] > 0 and m["step_ms"]["median"] > 0
        assert m["env"]["gpu"] and m["env"]["cuda"] and m["tflops"] > 0
    rows = load_sweep_rows(eager_sweep.folder)
    assert all(p.stat().st_size > 0 for p in write_figures(eager_sweep.folder, sweep_figures(rows)))


def test_modes_give_identical_results(eager_sweep: SweepDir) -> None:
    rows = load_sweep_rows(eager_sweep.folder)
    assert not checksum_mismatches(rows)
    assert len({r.checksum for r in rows}) == 1


def test_ring_has_no_pending_free_for_its_buffers(eager_sweep: SweepDir) -> None:
    control = eager_sweep.paths("slots0").read_metrics()
    by_cat = control["pending_free_by_category_at_max_active"]
    # Which of the two buffers sits in the control's queue at its max-active point depends on when the
    # allocator saw events complete (the H200 once showed 0 dispatch and 8 MiB expert bytes): require
    # the hooked buffers as a whole to be queued, so the ring assertions below compare against a real queue.
    assert by_cat.get("dispatch_output", 0) + by_cat.get("expert_output", 0) > 0, by_cat
    for cid in ("slots2", "slots4"):
        m = eager_sweep.paths(cid).read_metrics()
        cats = m["pending_free_by_category_at_max_active"]
        assert cats.get("dispatch_output", 0) == 0 and cats.get("expert_output", 0) == 0, (cid, cats)
        assert m["ring_bytes"]["dispatch_output"] == int(cid[5:]) * 4096 * 1024 * 2


def test_cuda_graph_replay_matches_eager(eager_sweep: SweepDir, tmp_path: Path) -> None:
    spec = SweepSpec(slots=[0, 2], modes=["stream-ordered"], cuda_graph=True, params=SMALL, root=str(tmp_path),
                     name="g", timeout_s=300)  # fmt: skip
    res = run_sweep(spec)
    assert res.statuses == {"slots0-graph": "ok", "slots2-graph": "ok", "stream-ordered-graph": "ok"}, res.statuses
    graph_sums = {r.checksum for r in load_sweep_rows(res.folder)}
    eager_sums = {r.checksum for r in load_sweep_rows(eager_sweep.folder)}
    assert graph_sums == eager_sums


def test_in_process_modes_identical_on_gpu() -> None:
    import torch

    from bufreuse.bench.proxy import ProxyConfig, build_pool
    from bufreuse.bench.schedule import MoEProxy

    sums = set()
    with torch.no_grad():
        for over in ({"mode": "control"}, {"mode": "ring", "slots": 2, "buffers": ["dispatch"]},
                     {"mode": "ring", "slots": 1, "buffers": ["expert"]}, {"mode": "stream-ordered"}):  # fmt: skip
            cfg = ProxyConfig.from_config({**SMALL, **over})
            dev = torch.device("cuda")
            p = MoEProxy(cfg, build_pool(cfg, dev), dev)
            for _ in range(3):
                p.step()
            sums.add(p.checksum())
    assert len(sums) == 1
