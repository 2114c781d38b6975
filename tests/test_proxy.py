"""The MoE proxy and the one-configuration runner, on CPU at tiny sizes (no streams, real pool)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from bufreuse.bench.measure import step_stats, time_steps
from bufreuse.bench.proxy import ProxyConfig, build_pool
from bufreuse.bench.schedule import MoEProxy, ProxyStreams
from bufreuse.errors import InputError
from bufreuse.launch.sweep import DEFAULT_PARAMS
from bufreuse.pool import EarlyReuseError, Policy

TINY = {"hidden": 32, "ffn": 16, "tokens": 64, "local_experts": 4, "topk": 2, "microbatches": 5, "comm_ms": 0.0,
        "device": "cpu", "steps": 2, "warmup_steps": 1, "record_steps": 0}  # fmt: skip


def _proxy(**over: object) -> MoEProxy:
    cfg = ProxyConfig.from_config({**TINY, **over})
    return MoEProxy(cfg, build_pool(cfg, torch.device("cpu")), torch.device("cpu"))


def test_config_defaults_match_design_and_sweep() -> None:
    cfg = ProxyConfig()
    assert (cfg.hidden, cfg.ffn, cfg.tokens, cfg.local_experts, cfg.dtype, cfg.microbatches) == (
        4096, 2048, 32768, 8, "bf16", 12
    )  # fmt: skip
    assert cfg.steps >= 20
    for key, value in DEFAULT_PARAMS.items():
        if key != "workload":
            assert getattr(cfg, key) == value, key


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"mode": "ring", "slots": 0}, "config.slots"),
        ({"mode": "control", "slots": 4}, "config.slots"),
        ({"mode": "bogus"}, "config.mode"),
        ({"buffers": ["attention"]}, "config.buffers"),
        ({"tokens": 60}, "config.tokens"),
        ({"comm_ms": 1.0}, "config.device"),
        ({"dtype": "int8"}, "config.dtype"),
        ({"warmup_s": -1.0}, "config.warmup_s"),
    ],
)
def test_config_invalid_names_field(over: dict[str, object], field: str) -> None:
    with pytest.raises(InputError, match=field.replace(".", r"\.")):
        ProxyConfig.from_config({**TINY, **over})


def test_build_pool_policies_per_buffer() -> None:
    cfg = ProxyConfig.from_config({**TINY, "mode": "ring", "slots": 3, "buffers": ["expert"]})
    pool = build_pool(cfg, torch.device("cpu"))
    stats = pool.stats()
    assert stats["dispatch_output"].persistent_bytes == 0
    assert stats["expert_fc2_output"].persistent_bytes == 3 * 64 * 32 * 2
    assert Policy("ring") is Policy.RING


def _reference(p: MoEProxy) -> torch.Tensor:
    """The step output computed plainly (no pool, no schedule), in the proxy's operation order."""
    acc = torch.zeros_like(p.acc)
    rows = p.rows_per_expert
    for mb in range(p.microbatches):
        disp = p.x[p.perms[mb]]
        out = torch.empty_like(disp)
        for e in range(p.num_experts):
            sl = slice(e * rows, (e + 1) * rows)
            out[sl] = torch.nn.functional.silu(disp[sl] @ p.w1[e]) @ p.w2[e]
        for k in range(p.topk):
            acc.add_(out[p.inv_perms[mb][k]])
    return acc


@torch.no_grad()
def test_modes_identical_and_match_reference_cpu() -> None:
    sums = {}
    for name, over in {
        "control": {"mode": "control"},
        "stream-ordered": {"mode": "stream-ordered"},
        "ring2": {"mode": "ring", "slots": 2},
        "ring4-dispatch": {"mode": "ring", "slots": 4, "buffers": ["dispatch"]},
        "ring1-expert": {"mode": "ring", "slots": 1, "buffers": ["expert"]},
    }.items():
        p = _proxy(**over)
        p.step()
        p.step()
        sums[name] = p.checksum()
        if name == "control":
            assert torch.equal(p.acc, _reference(p))
    assert len(set(sums.values())) == 1, sums


@torch.no_grad()
def test_ring_one_dispatch_slot_raises_early_reuse() -> None:
    # The schedule issues dispatch i+1 before the experts of i release theirs: two are held at once.
    p = _proxy(mode="ring", slots=1, buffers=["dispatch"])
    with pytest.raises(EarlyReuseError):
        p.step()


def test_time_steps_min_total_ms_runs_past_the_step_count() -> None:
    values = time_steps(lambda: time.sleep(0.002), 2, stream=None, min_total_ms=15.0)
    assert len(values) > 2 and sum(values) >= 15.0 and sum(values[:-1]) < 15.0
    assert len(time_steps(lambda: None, 2, stream=None, min_total_ms=1e9, max_steps=5)) == 5
    assert len(time_steps(lambda: None, 3, stream=None)) == 3


def test_proxy_runs_on_the_streams_it_is_given() -> None:
    shared = MoEProxy.new_streams(torch.device("cpu"))
    assert shared == ProxyStreams(comm=None, compute=None)
    cfg = ProxyConfig.from_config(TINY)
    a = MoEProxy(cfg, build_pool(cfg, torch.device("cpu")), torch.device("cpu"), streams=shared)
    b = MoEProxy(cfg, build_pool(cfg, torch.device("cpu")), torch.device("cpu"), streams=shared)
    assert a.streams is shared and b.streams is shared


def test_step_stats_percentiles() -> None:
    s = step_stats([float(v) for v in range(1, 12)])
    assert (s["median"], s["min"], s["max"], s["p10"], s["p90"]) == (6.0, 1.0, 11.0, 2.0, 10.0)
    assert s["mean"] == 6.0 and len(s["values"]) == 11
    with pytest.raises(ValueError):
        step_stats([])


def _run(folder: Path, config: dict[str, object], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    import os

    return subprocess.run(
        [sys.executable, "-m", "bufreuse.bench.runner", str(folder)],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_runner_proxy_cpu_writes_metrics_and_log(tmp_path: Path) -> None:
    cfg = {"workload": "proxy", **TINY, "mode": "ring", "slots": 2, "timeout_s": 60}
    proc = _run(tmp_path / "slots2", cfg)
    assert proc.returncode == 0, proc.stderr
    m = json.loads((tmp_path / "slots2" / "metrics.json").read_text())
    assert m["status"] == "ok" and m["error"] is None
    assert m["config"]["slots"] == 2 and len(m["step_ms"]["values"]) == 2
    assert m["ring_bytes"] == {"dispatch_output": 2 * 64 * 32 * 2, "expert_fc2_output": 2 * 64 * 32 * 2}
    assert m["ring_slot_bytes"]["dispatch_output"] == 64 * 32 * 2
    assert m["env"]["torch"] == torch.__version__ and m["started_at"] <= m["finished_at"]
    assert len(m["checksum"]) == 16
    assert "step 2/2" in (tmp_path / "slots2" / "log.txt").read_text()
    assert len(m["warmup_step_ms"]) == 1  # CPU: warmup_s does not apply, warmup_steps only
    assert not list((tmp_path / "slots2").glob(".*.tmp"))


def test_runner_bad_config_fails_with_exit_2(tmp_path: Path) -> None:
    proc = _run(tmp_path / "bad", {"workload": "proxy", **TINY, "mode": "ring", "slots": 0})
    assert proc.returncode == 2
    m = json.loads((tmp_path / "bad" / "metrics.json").read_text())
    assert m["status"] == "failed" and "config.slots" in m["error"]


def test_runner_unknown_workload_fails(tmp_path: Path) -> None:
    proc = _run(tmp_path / "x", {"workload": "nope"})
    assert proc.returncode == 2
    assert "unknown workload" in json.loads((tmp_path / "x" / "metrics.json").read_text())["error"]


def test_runner_watchdog_records_hung_with_last_words(tmp_path: Path) -> None:
    (tmp_path / "stuck_workload.py").write_text(
        textwrap.dedent(
            """
            import threading

            def wait_for_event_that_never_comes(config, paths):
                threading.Event().wait()
            """
        )
    )
    env = {"PYTHONPATH": str(tmp_path), "BUFREUSE_WORKLOADS": "stuck=stuck_workload:wait_for_event_that_never_comes"}
    proc = _run(tmp_path / "h", {"workload": "stuck", "timeout_s": 60, "stall_s": 1}, env)
    assert proc.returncode == 3
    m = json.loads((tmp_path / "h" / "metrics.json").read_text())
    assert m["status"] == "hung" and "no progress" in m["error"]
    assert "wait_for_event_that_never_comes" in (tmp_path / "h" / "log.txt").read_text()


def test_snapshot_figures_from_recorded_h200_snapshot() -> None:
    from bufreuse.bench.measure import snapshot_figures

    snap = Path(__file__).parent / "data" / "snapshots" / "record_stream.pickle.gz"
    if not snap.is_file():
        pytest.skip("tests/data/snapshots/record_stream.pickle.gz not recorded")
    figs = snapshot_figures(snap)
    assert figs["pending_free_at_max_active_bytes"] > 0
    assert set(figs["pending_free_by_category_at_max_active"]) >= {"dispatch_output", "expert_output"}
