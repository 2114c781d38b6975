"""``bufreuse advise`` end to end: the bundled H200 proxy recordings and a Megatron-shaped synthetic trace."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path
from typing import Any

from snapshot_synth import write
from test_snapshot_sites import CNN, MEGATRON, NATIVE, SITE_PKG, f
from typer.testing import CliRunner

from bufreuse.cli.app import app

MiB = 1 << 20
BLOCK = 32 * MiB  # above 10 MiB: the allocator gives each request its own segment, rounded to 2 MiB
runner = CliRunner()
SWEEP = Path(__file__).parents[1] / "examples" / "sweep-h200"
CONTROL = SWEEP / "slots0" / "snapshot.pickle.gz"
EXPERT = [f(f"{SITE_PKG}/transformer_engine/pytorch/module/grouped_linear.py", "forward", 120),
          f("/w/Megatron-LM/megatron/core/transformer/moe/experts.py", "forward", 900)]  # fmt: skip


def _json(*argv: str) -> dict[str, Any]:
    res = runner.invoke(app, ["advise", *argv, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _most_alive(name: str) -> int:
    """Brute force over the raw trace: most blocks allocated under a frame named ``name`` alive at once."""
    trace = pickle.loads(gzip.decompress(CONTROL.read_bytes()))["device_traces"][0]
    live: set[int] = set()
    most = 0
    for e in trace:
        if e["action"] == "alloc" and any(fr["name"] == name for fr in e.get("frames", [])):
            live.add(e["addr"])
            most = max(most, len(live))
        elif e["action"] == "free_requested":
            live.discard(e["addr"])
    return most


def test_advise_on_the_h200_proxy_control_names_moe_sites_depth_and_prediction() -> None:
    out = _json(str(CONTROL))
    # the proxy's dispatch and expert sites (bench/schedule.py), each 256 MiB blocks
    cats = {s["category"]: s for s in out["moe_sites"]}
    assert set(cats) == {"dispatch_output", "expert_output"}
    assert all(s["size_bytes"] == 256 * MiB for s in out["moe_sites"])
    assert out["moe_pending_free_at_max_active_bytes"] == sum(s["total_bytes"] for s in out["moe_sites"]) > 0
    depth = {"dispatch": _most_alive("dispatch"), "expert": _most_alive("expert_fc2_output")}
    assert out["depth"] == {"source": "trace", "slots": depth, "notes": out["depth"]["notes"]}
    n = max(depth.values())
    preds = {p["slots"]: p for p in out["what_if"]["predictions"]}
    assert sorted(preds) == [n, n + 2]
    # independent check: the measured H200 ring runs at those slot counts (metrics.json of the sweep)
    for k in (n, n + 2):
        measured = json.loads((SWEEP / f"slots{k}" / "metrics.json").read_text())["max_reserved_bytes"]
        assert abs(preds[k]["max_reserved_bytes"] - measured) <= 0.05 * measured
    assert out["gain"] is True and out["verdict"].startswith("turn it on")
    assert out["flags"] == [
        "--moe-hybridep-reuse-dispatch-output-buffers",
        f"--moe-hybridep-num-dispatch-output-buffers {depth['dispatch']}",
        f"--moe-hybridep-num-expert-output-buffers {depth['expert']}",
    ]
    assert out["check_config"] is None


def _megatron_trace(tmp_path: Path, dispatch: list[dict], expert: list[dict], *, micro: int = 6) -> Path:
    """Per microbatch: dispatch and expert output allocated (one BLOCK segment each), freed with
    record_stream; the previous microbatch's completions land only after this one's allocations, so
    the max-active point (4 blocks) is each microbatch's second allocation with the previous two pending."""
    trace: list[dict] = []
    addr = 1 << 32
    prev: list[int] = []
    for _ in range(micro):
        cur = []
        for frames, stream in ((dispatch, 5), (expert, 7)):
            trace.append({"action": "segment_alloc", "addr": addr, "size": BLOCK, "stream": stream, "frames": frames})
            trace.append({"action": "alloc", "addr": addr, "size": BLOCK, "stream": stream, "frames": frames})
            cur.append((addr, stream, frames))
            addr += BLOCK
        for a, s, fr in prev:
            trace.append({"action": "free_completed", "addr": a, "size": BLOCK, "stream": s, "frames": fr})
        for a, s, fr in cur:
            trace.append({"action": "free_requested", "addr": a, "size": BLOCK, "stream": s, "frames": fr})
        prev = cur
    for a, s, fr in prev:
        trace.append({"action": "free_completed", "addr": a, "size": BLOCK, "stream": s, "frames": fr})
    segs = [
        {"device": 0, "address": (1 << 32) + k * BLOCK, "total_size": BLOCK, "stream": 5 if k % 2 == 0 else 7,
         "segment_type": "large", "blocks": [{"address": (1 << 32) + k * BLOCK, "size": BLOCK, "state": "inactive"}]}
        for k in range(2 * micro)
    ]  # fmt: skip
    return write(tmp_path / "megatron.pickle", {"segments": segs, "device_traces": [trace]})


ARGS = (
    "--num-layers 2 --hidden-size 1024 --ffn-hidden-size 2048 --num-attention-heads 8\n"
    "--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall\n"
    "--expert-model-parallel-size {ep} --seq-length 1024 --micro-batch-size 1 --bf16\n"
)


def test_advise_on_a_megatron_shaped_snapshot_with_args(tmp_path: Path) -> None:
    snap = _megatron_trace(tmp_path, [*NATIVE, *MEGATRON], [*NATIVE, *EXPERT])
    args = tmp_path / "run.args"
    args.write_text(ARGS.format(ep=2))
    out = _json(str(snap), "--args", str(args), "--num-microbatches", "6")
    # at max active (microbatch 1's allocations) microbatch 0's two blocks wait: one block per buffer
    assert {(s["category"], s["count"], s["total_bytes"]) for s in out["moe_sites"]} == {
        ("dispatch_output", 1, BLOCK),
        ("expert_output", 1, BLOCK),
    }
    assert {s["site"] for s in out["moe_sites"]} == {"tensor_parallel/mappings.py:488:forward",
                                                     "module/grouped_linear.py:120:forward"}  # fmt: skip
    # PP = 1, no overlap: one microbatch in flight, so each ring needs one slot
    assert out["depth"]["source"] == "planner" and out["depth"]["slots"] == {"dispatch": 1, "expert": 1}
    p1 = out["what_if"]["predictions"][0]
    # by hand: with rings, only the two one-block ring slots are ever reserved
    assert p1["slots"] == 1 and p1["max_reserved_bytes"] == 2 * BLOCK and p1["ring_bytes"] == 2 * BLOCK
    # the control in the model: two live + two pending blocks, each its own segment
    assert p1["control_model_max_reserved_bytes"] == 4 * BLOCK and p1["change"] == -0.5
    assert out["gain"] is True
    assert out["check_config"]["ok"] is True
    # EP 2 without EP overlap: the stream rule expects nothing pending-free (torch >= 2.8 NCCL), the trace says
    # otherwise; the measurement wins, with a warning per buffer and the knob that keeps the rings in use
    assert out["flags"] == [
        "--moe-hybridep-reuse-dispatch-output-buffers",
        "--moe-hybridep-num-dispatch-output-buffers 1",
        "--moe-hybridep-num-expert-output-buffers 1",
        "--moe-bufreuse-keep-unused-rings",
    ]
    assert sum("install() would leave its ring unused" in w for w in out["warnings"]) == 2
    screen = runner.invoke(app, ["advise", str(snap), "--args", str(args), "--num-microbatches", "6"],
                           env={"COLUMNS": "160"})  # fmt: skip
    assert screen.exit_code == 0, screen.output
    for text in ("turn it on", "module/grouped_linear.py:120:forward", "check-config: every requirement met",
                 "--moe-hybridep-num-expert-output-buffers 1"):  # fmt: skip
        assert text in screen.stdout


def test_advise_says_nothing_to_gain_with_ep_1(tmp_path: Path) -> None:
    snap = _megatron_trace(tmp_path, [*NATIVE, *MEGATRON], [*NATIVE, *EXPERT])
    args = tmp_path / "run.args"
    args.write_text(ARGS.format(ep=1))
    out = _json(str(snap), "--args", str(args), "--num-microbatches", "6")
    assert out["gain"] is False and out["verdict"].startswith("nothing to gain here: install() would use no ring")
    assert "dispatch_output: EP = 1" in out["verdict"] and "expert_fc2_output: EP x ETP = 1" in out["verdict"]
    assert out["flags"] == [] and out["what_if"]["predictions"] == []
    assert out["moe_pending_free_at_max_active_bytes"] == 2 * BLOCK  # the sites are still shown
    # positive control: at EP = 1 with expert TP 2 the FC2 output is reduce-scattered, so its ring is used
    # (install() and plan say the same), and advise goes on to the depth and the prediction
    args.write_text(ARGS.format(ep=1) + "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2\n")
    used = _json(str(snap), "--args", str(args), "--num-microbatches", "6")
    assert used["verdict"].startswith("turn it on") and used["depth"]["slots"] == {"expert": 1}


def test_advise_says_nothing_to_gain_without_moe_pending_free(tmp_path: Path) -> None:
    snap = _megatron_trace(tmp_path, [*NATIVE, *CNN], [*NATIVE, *CNN])  # same shape, non-MoE frames
    out = _json(str(snap))
    assert out["moe_sites"] == [] and out["pending_free_at_max_active_bytes"] == 2 * BLOCK
    assert out["gain"] is False and out["verdict"].startswith("nothing to gain") and out["flags"] == []


def test_advise_refuses_config_and_args_together(tmp_path: Path) -> None:
    args = tmp_path / "run.args"
    args.write_text(ARGS.format(ep=2))
    res = runner.invoke(app, ["advise", str(CONTROL), "--args", str(args), "--config", str(args)])
    assert res.exit_code == 2 and "not both" in res.output


RECORD_STREAM = Path(__file__).parent / "data" / "snapshots" / "record_stream.pickle.gz"


def _strip_frames(obj: Any) -> Any:
    """``obj`` with every ``frames`` list emptied (a snapshot recorded without stacks)."""
    if isinstance(obj, dict):
        return {k: [] if k == "frames" else _strip_frames(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip_frames(v) for v in obj]
    return obj


def test_advise_cannot_tell_when_the_pending_free_blocks_have_no_frames(tmp_path: Path) -> None:
    for frames in ([], None):  # an empty stack, and entries with no "frames" key at all
        snap = _megatron_trace(tmp_path, [], [])
        if frames is None:
            raw = pickle.loads(snap.read_bytes())
            for e in raw["device_traces"][0]:
                del e["frames"]
            write(snap, raw)
        out = _json(str(snap))
        assert out["moe_sites"] == [] and out["pending_free_at_max_active_bytes"] == 2 * BLOCK
        assert out["gain"] is False and out["verdict"].startswith("cannot tell"), out["verdict"]
        assert "2 pending-free block(s)" in out["verdict"]
        assert out["frameless_pending_free_at_max_active_bytes"] == 2 * BLOCK
    # positive control: the same trace with frames that are not MoE buffers (C++ only, or a CNN) has nothing to gain
    for frames in (NATIVE, [*NATIVE, *CNN]):
        out = _json(str(_megatron_trace(tmp_path, frames, frames)))
        assert out["verdict"].startswith("nothing to gain"), out["verdict"]
        assert out["frameless_pending_free_at_max_active_bytes"] == 0


def test_advise_cannot_tell_on_the_recorded_snapshot_stripped_of_its_frames(tmp_path: Path) -> None:
    """The bundled record_stream recording (3 dispatch blocks pending free) with its stacks removed."""
    whole = _json(str(RECORD_STREAM))
    assert whole["moe_pending_free_at_max_active_bytes"] > 0  # positive control: with frames, MoE buffers show
    raw = pickle.loads(gzip.decompress(RECORD_STREAM.read_bytes()))
    snap = write(tmp_path / "frameless.pickle", _strip_frames(raw))
    out = _json(str(snap))
    assert out["verdict"].startswith("cannot tell") and out["gain"] is False and out["flags"] == []
    assert out["frameless_pending_free_at_max_active_bytes"] == whole["pending_free_at_max_active_bytes"]


def test_advise_warns_that_frameless_blocks_may_hide_moe_buffers(tmp_path: Path) -> None:
    snap = _megatron_trace(tmp_path, [*NATIVE, *MEGATRON], [])
    out = _json(str(snap))
    assert {s["category"] for s in out["moe_sites"]} == {"dispatch_output"}
    assert any("no frames" in w and "1 pending-free block(s)" in w for w in out["warnings"]), out["warnings"]
