"""`bufreuse what-if`: the allocator model's rules, and predictions against the H200 ring recordings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from snapshot_synth import block, entry, frame, segment, write
from typer.testing import CliRunner

from bufreuse.analysis.snapshot import report_file
from bufreuse.analysis.snapshot.allocator_model import AllocatorModel, allocation_size, round_size
from bufreuse.analysis.snapshot.whatif import what_if
from bufreuse.cli import app

MiB = 1 << 20
SWEEP = Path(__file__).resolve().parent.parent / "examples" / "sweep-h200"
CONTROL = SWEEP / "slots0" / "snapshot.pickle.gz"
runner = CliRunner()


def _metrics(slots: int) -> dict:
    return json.loads((SWEEP / f"slots{slots}" / "metrics.json").read_text())


def _what_if_json(*args: str) -> dict:
    res = runner.invoke(app, ["what-if", str(CONTROL), "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


# -- the allocator model, rule by rule (c10/cuda/CUDACachingAllocator.cpp) ---------------------------


def test_round_size_and_segment_sizes_follow_the_allocator_constants() -> None:
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert allocation_size(round_size(4096)) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(3 * MiB) == 20 * MiB  # 1-10 MiB: a 20 MiB segment to split
    assert allocation_size(11 * MiB) == 12 * MiB  # large: rounded up to 2 MiB


def test_model_packs_small_blocks_into_one_2mib_segment() -> None:
    m = AllocatorModel()
    addrs = [m.malloc(round_size(100_000), 7) for _ in range(20)]
    assert m.stats.reserved == 2 * MiB
    assert addrs == sorted(addrs) and addrs[1] - addrs[0] == round_size(100_000)


def test_model_large_split_only_when_rest_exceeds_1mib() -> None:
    m = AllocatorModel()
    a = m.malloc(3 * MiB, 0)  # 20 MiB segment, 17 MiB rest: split
    assert m.stats.allocated == 3 * MiB and m.stats.reserved == 20 * MiB
    b = m.malloc(16 * MiB + 512 * 1024, 0)  # rest 512 KiB <= 1 MiB: the whole 17 MiB block is handed out
    assert m.stats.allocated == 20 * MiB and m.stats.reserved == 20 * MiB
    assert b == a + 3 * MiB


def test_model_best_fit_takes_smallest_fitting_block_of_the_same_stream() -> None:
    m = AllocatorModel()
    big, small = m.malloc(64 * MiB, 0), m.malloc(32 * MiB, 0)
    other = m.malloc(30 * MiB, 1)
    for addr in (big, small, other):
        m.free(addr)
    assert m.malloc(30 * MiB, 0) == small  # the 32 MiB block on stream 0, not stream 1's exact fit
    assert m.stats.reserved == 64 * MiB + 32 * MiB + 30 * MiB


def test_model_other_stream_never_reuses_a_free_block() -> None:
    m = AllocatorModel()
    m.free(m.malloc(256 * MiB, 0))
    m.malloc(256 * MiB, 1)
    assert m.stats.reserved == 512 * MiB and m.stats.segments_allocated == 2


def test_model_pending_block_is_not_reused_until_freed() -> None:
    m = AllocatorModel()
    a = m.malloc(256 * MiB, 0)
    m.pend(a)
    b = m.malloc(256 * MiB, 0)
    assert b != a and m.stats.reserved == 512 * MiB and m.stats.pending == 256 * MiB
    m.free(a, pending=True)
    assert m.malloc(256 * MiB, 0) == a and m.stats.reserved == 512 * MiB
    assert m.stats.max_active == 512 * MiB and m.stats.max_allocated == 512 * MiB


def test_model_merges_free_neighbours_into_one_block() -> None:
    m = AllocatorModel()
    a, b, c = (m.malloc(4 * MiB, 0) for _ in range(3))  # all in one 20 MiB segment
    assert m.stats.reserved == 20 * MiB
    for addr in (a, c, b):
        m.free(addr)
    assert m.malloc(20 * MiB, 0) == a  # the whole segment again, no new cudaMalloc
    assert m.stats.reserved == 20 * MiB


def test_model_max_split_size_refuses_oversize_blocks_for_small_requests() -> None:
    m = AllocatorModel(max_split_size=200 * MiB)
    m.free(m.malloc(256 * MiB, 0))
    m.malloc(32 * MiB, 0)  # below max_split_size: the 256 MiB cached block is not used
    assert m.stats.reserved == 288 * MiB
    m.malloc(240 * MiB, 0)  # at/above it: an oversize block within 20 MiB is taken whole
    assert m.stats.reserved == 288 * MiB


def test_model_release_cached_returns_only_unsplit_free_segments() -> None:
    m = AllocatorModel()
    m.free(m.malloc(64 * MiB, 0))
    keep = m.malloc(3 * MiB, 0)  # splits the cached 64 MiB segment: it stays
    m.free(m.malloc(32 * MiB, 1))
    m.release_cached()
    assert m.stats.reserved == 64 * MiB and m.stats.segments_released == 1
    m.free(keep)
    m.release_cached()
    assert m.stats.reserved == 0


# -- predictions against the H200 recordings (examples/sweep-h200) ---------------------------------


def test_control_replay_reproduces_the_snapshot_max_reserved_h200() -> None:
    out = _what_if_json("--slots", "4")
    control = next(p for p in out["predictions"] if p["slots"] == 0)
    truth = report_file(CONTROL)["max_reserved_bytes"]  # the trace's own segment events
    assert out["measured_max_reserved_bytes"] == truth
    assert control["max_reserved_bytes"] == truth
    assert out["model_calibration_error"] == 0


@pytest.mark.parametrize("slots", [2, 4, 10])
def test_ring_prediction_equals_the_measured_ring_run_h200(slots: int) -> None:
    """The README's "predicts ring-2/4/10's max reserved exactly": equality, byte for byte."""
    ring_dir = SWEEP / f"slots{slots}"
    out = _what_if_json("--slots", "2,4,10", "--measured", f"{slots}={ring_dir / 'snapshot.pickle.gz'}")
    pred = next(p for p in out["predictions"] if p["slots"] == slots)
    snap = report_file(ring_dir / "snapshot.pickle.gz")["max_reserved_bytes"]
    metrics = _metrics(slots)
    assert pred["measured_max_reserved_bytes"] == snap == metrics["max_reserved_bytes"]
    assert pred["max_reserved_bytes"] == snap
    assert pred["error"] == 0
    assert pred["max_allocated_bytes"] == metrics["max_allocated_bytes"]
    assert pred["ring_bytes"] == slots * sum(metrics["ring_slot_bytes"].values())


def test_default_rings_are_the_dispatch_and_expert_sites_h200() -> None:
    out = _what_if_json("--slots", "2")
    rings = {r["name"]: r for r in out["rings"]}
    assert set(rings) == {"dispatch_output", "expert_output"}
    slot_bytes = _metrics(2)["ring_slot_bytes"]
    assert rings["dispatch_output"]["slot_bytes"] == slot_bytes["dispatch_output"]
    assert rings["expert_output"]["slot_bytes"] == slot_bytes["expert_fc2_output"]
    assert any("dispatch" in s for s in rings["dispatch_output"]["sites"])
    assert any("expert_fc2_output" in s for s in rings["expert_output"]["sites"])
    assert rings["dispatch_output"]["min_slots"] == 2  # two dispatch outputs alive at once in the control


def test_fewer_slots_than_blocks_alive_at_once_is_infeasible_h200() -> None:
    out = _what_if_json("--slots", "1,2")
    one = next(p for p in out["predictions"] if p["slots"] == 1)
    assert one["feasible"] is False and one["max_reserved_bytes"] is None
    assert "dispatch_output has 2 blocks alive at once" in one["note"]
    assert next(p for p in out["predictions"] if p["slots"] == 2)["feasible"] is True


def test_site_pattern_makes_one_ring_per_pattern_h200() -> None:
    out = _what_if_json("--slots", "2", "--site", r"schedule\.py:89:dispatch")
    assert [r["name"] for r in out["rings"]] == [r"schedule\.py:89:dispatch"]
    two = next(p for p in out["predictions"] if p["slots"] == 2)
    both = next(p for p in _what_if_json("--slots", "2")["predictions"] if p["slots"] == 2)
    assert two["ring_bytes"] == 2 * 256 * MiB
    assert two["max_reserved_bytes"] > both["max_reserved_bytes"]  # expert output still on record_stream


def test_table_and_plot_show_the_predictions(tmp_path: Path) -> None:
    png = tmp_path / "whatif.png"
    res = runner.invoke(app, ["what-if", str(CONTROL), "--slots", "2,4", "--plot", str(png)], env={"COLUMNS": "150"})
    assert res.exit_code == 0, res.output
    assert "dispatch_output" in res.stdout and "2,136 MiB" in res.stdout and "model calibration" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _pending_trace(tmp_path: Path, disp: list | None = None) -> Path:
    """Two 64 MiB outputs per step on stream 1, freed with record_stream (completion two steps later)."""
    disp = disp or [frame("/work/megatron/core/transformer/moe/token_dispatcher.py", "dispatch", 5)]
    trace, addr = [], 1 << 40
    for step in range(6):
        a = addr + step * 64 * MiB
        trace += [entry("segment_alloc", a, 64 * MiB, 1, disp), entry("alloc", a, 64 * MiB, 1, disp)]
        trace.append(entry("free_requested", a, 64 * MiB, 1, disp))
        if step >= 2:
            trace.append(entry("free_completed", a - 2 * 64 * MiB, 64 * MiB, 1, disp))
    final = [segment(addr + s * 64 * MiB, 64 * MiB, [block(addr + s * 64 * MiB, 64 * MiB, "inactive")], stream=1)
             for s in range(4)]  # fmt: skip
    final += [
        segment(addr + s * 64 * MiB, 64 * MiB, [block(addr + s * 64 * MiB, 64 * MiB, "active_pending_free", 64 * MiB)],
                stream=1)
        for s in (4, 5)
    ]  # fmt: skip
    return write(tmp_path / "pending.pickle", {"segments": final, "device_traces": [trace]})


def test_pending_blocks_are_never_reused_and_a_ring_removes_them(tmp_path: Path) -> None:
    path = _pending_trace(tmp_path)
    r = what_if(path, [1])
    control, ring = r.predictions
    # the model reuses a completed block instead of the trace's fresh cudaMalloc: 3 segments live
    assert control.max_reserved == 3 * 64 * MiB and control.segments_allocated == 3
    assert ring.max_reserved == 64 * MiB and ring.ring_bytes == 64 * MiB
    assert r.measured_max_reserved == 6 * 64 * MiB


@pytest.mark.parametrize(
    "frames",
    [
        [frame("/site/deep_ep/hybrid_ep_buffer.py", "combine_with_unpermute"), frame("/site/fused_a2a.py", "forward")],
        [frame("/site/deep_ep/hybrid_ep_buffer.py", "dispatch_with_permute"), frame("/site/fused_a2a.py", "backward")],
        [frame("/site/transformer_engine/pytorch/module/grouped_linear.py", "backward")],
    ],
    ids=["combine-output", "backward-dispatch", "grouped-linear-dgrad"],
)
def test_moe_memory_no_ring_replaces_is_never_a_ring(tmp_path: Path, frames: list) -> None:
    """The same pending queue as above, allocated where no ring takes it (moe_other): what-if models no ring
    for it and says so, instead of predicting a saving the rings cannot deliver."""
    path = _pending_trace(tmp_path, frames)
    assert report_file(path)["pending_free_by_category_at_max_active"]["moe_other"] > 0
    res = runner.invoke(app, ["what-if", str(path), "--slots", "1"])
    assert res.exit_code == 2 and "no allocation in the trace matches" in res.output, res.output
    assert "dispatch_output, expert_output" in res.output
    # positive control: the dispatch frames of the test above do make a ring (what-if runs)
    (tmp_path / "d").mkdir()
    ok = runner.invoke(app, ["what-if", str(_pending_trace(tmp_path / "d")), "--slots", "1"])
    assert ok.exit_code == 0, ok.output


def test_forked_replays_equal_inline_ones_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    import bufreuse.analysis.snapshot.whatif as whatif_module

    inline = what_if(CONTROL, [2, 4, 10]).to_json()
    monkeypatch.setattr(whatif_module, "PARALLEL_MIN_OPS", 0)  # every slot count in a forked worker
    forked = what_if(CONTROL, [2, 4, 10]).to_json()
    assert forked == inline


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slots", "x"], "--slots must be comma-separated integers"),
        (["--slots", "0"], "--slots must list slot counts >= 1"),
        (["--site", "("], "bad --site/--category"),
        (["--site", "no_such_site"], "no allocation in the trace matches"),
        (["--measured", "4"], "--measured must be SLOTS=PATH"),
    ],
)
def test_bad_options_exit_2_with_one_error_line(args: list[str], message: str) -> None:
    res = runner.invoke(app, ["what-if", str(CONTROL), *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


def test_snapshot_without_trace_exits_2(tmp_path: Path) -> None:
    legacy = write(tmp_path / "legacy.pickle", [segment(1 << 30, 2 * MiB, [block(1 << 30, 2 * MiB, "inactive")])])
    res = runner.invoke(app, ["what-if", str(legacy)])
    assert res.exit_code == 2
    assert re.match(r"error: .*no trace entries", res.stderr)
    missing = runner.invoke(app, ["what-if", str(tmp_path / "nope.pickle")])
    assert missing.exit_code == 2 and missing.stderr.startswith("error:")


@pytest.mark.gpu
def test_model_control_replay_matches_the_real_allocator_gpu(tmp_path: Path) -> None:
    """Random tensors on two streams, some freed with record_stream: the model's N=0 max reserved
    must equal the real allocator's (same trace, same rules)."""
    import random

    import torch

    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
    rng = random.Random(0)
    side = torch.cuda.Stream()
    live: list[torch.Tensor] = []
    try:
        for _ in range(3000):
            if live and rng.random() < 0.5:
                t = live.pop(rng.randrange(len(live)))
                if rng.random() < 0.3:
                    t.record_stream(side)
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(1000)
                del t
            else:
                n = int(2 ** rng.uniform(9, 28))
                stream = side if rng.random() < 0.3 else torch.cuda.current_stream()
                with torch.cuda.stream(stream):
                    live.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        path = tmp_path / "gpu.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    r = what_if(path, [1], sites=["test_whatif"])
    assert abs(r.calibration_error) <= 0.02, r.to_json()


def test_a_trace_without_allocations_says_so(tmp_path: Path) -> None:
    """The bundled empty_cache recording cut to its segment frees (a trace begun after every tensor was freed)."""
    import pickle

    src = Path(__file__).parent / "data" / "snapshots" / "empty_cache.pickle"
    raw = pickle.loads(src.read_bytes())
    raw["device_traces"] = [[e for e in t if e["action"] == "segment_free"] for t in raw["device_traces"]]
    assert sum(map(len, raw["device_traces"])) == 2
    snap = write(tmp_path / "no_allocs.pickle", raw)
    res = runner.invoke(app, ["what-if", str(snap), "--slots", "2"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "the trace holds no allocations" in lines[0], lines
    assert "2 segment_free" in lines[0] and "matches the sites" not in lines[0]
    # positive control: the whole recording holds allocations, none at a MoE site
    whole = runner.invoke(app, ["what-if", str(src), "--slots", "2"])
    assert whole.exit_code == 2 and "no allocation in the trace matches the sites" in whole.stderr
