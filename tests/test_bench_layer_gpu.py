"""`bufreuse bench layer` on one GPU: local spec, and real TE (``TEGroupedMLP``) in bf16 and FP8 (hybrid, delayed).

A small shape and few rounds: this proves the command's CUDA paths (module call, FP8 context, CUDA
events, every policy installed) and records its JSON; the figures for ``docs/benchmarks.md`` come from
the presets run by hand (see there). Run with scripts/gpu-tests.sh; the JSON goes to
``$OUT/megatron-gpu-summary.json`` under ``bench_layer_<spec>_<precision>``.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from schedule_harness import write_summary

from bufreuse.cli import app

pytestmark = pytest.mark.gpu
MB, STEPS, ROUNDS = 4, 2, 2
SHAPE = ["--hidden", "256", "--ffn", "512", "--experts", "8", "--topk", "2", "--tokens", "512"]
CASES = [
    pytest.param("local", "bf16", id="local-bf16"),
    pytest.param("te", "bf16", id="te-bf16", marks=pytest.mark.te),
    pytest.param("te", "fp8", id="te-fp8", marks=pytest.mark.te),
]


@pytest.mark.parametrize(("spec", "precision"), CASES)
def test_bench_layer_runs_every_policy_on_the_gpu(spec: str, precision: str) -> None:
    args = ["bench", "layer", "--device", "cuda", *SHAPE, "--spec", spec, "--precision", precision,
            "--microbatches", str(MB), "--steps", str(STEPS), "--rounds", str(ROUNDS), "--warmup", "1",
            "--policies", "ring,stream-ordered,record-stream", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    write_summary(f"bench_layer_{spec}_{precision}", data)
    arms = ["control", "ring", "stream-ordered", "record-stream"]
    assert data["order"] == arms + (arms + arms[::-1]) * (ROUNDS // 2)
    assert data["gpu_figures"] is True and data["headline"] == "wall_ms"
    per_round = (STEPS + 1) * MB
    for r in data["rounds"]:
        assert r["gpu_ms"] > 0 and r["fwd_host_us"] > 0 and r["bwd_host_us"] > 0, r
        # EP = 1: the dispatch is an identity upstream, no dispatch ring (the round says why)
        want = {} if r["arm"] == "control" else {"expert_fc2_output": per_round}
        assert r["acquisitions"] == want, r
    for arm in arms[1:]:
        assert data["summary"][arm]["gpu_ms"]["vs_control"]["ratio"] > 0


@pytest.mark.te
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_te_hooks_enter_the_fc2_shim_once_per_layer_call_and_nothing_else_per_gemm(precision: str) -> None:
    """The TE module route's hook entries, counted by the hook-time round: the FC2 shim once per layer call
    (FC1, the other GroupedLinear of the layer, never enters it) and one combine-stage wrapper; the experts'
    forward is not wrapped at EP = 1 (no dispatch ring can reach it)."""
    args = ["bench", "layer", "--device", "cuda", *SHAPE, "--spec", "te", "--precision", precision, "--pad",
            "--microbatches", str(MB), "--steps", str(STEPS), "--rounds", "2", "--warmup", "0",
            "--added-pairs", "8", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    write_summary(
        f"bench_layer_hook_time_te_{precision}", {"hook_time": data["hook_time"], "added": data["added_time"]}
    )
    ring = data["hook_time"]["arms"]["ring"]
    check_te_pad_hook_entries(ring)
    # --added-time spans the same entries in the control and the arm: the FC2 module's forward (the shim is in its
    # class's MRO) and the one hooked combine stage; both run in the control too
    added = data["added_time"]["arms"]["ring"]
    fc2, stage = "TERowParallelGroupedLinear.forward", "MoEAlltoAllTokenDispatcher.combine_postprocess"
    assert set(added["entry_points"]) == {fc2, stage}
    points = {row["point"]: row for row in added["points"]}
    for name in added["entry_points"]:
        assert points[name]["control_us"] > 0 and points[name]["arm_us"] > 0, points
    assert added["pairs"] == 8 and added["ci_low_us"] is not None and len(added["halves_added_us"]) == 2
    median = {row["point"]: row for row in added["per_call_median"]["points"]}  # the per-call medians, same points
    assert set(median) == set(points) and all(median[n]["control_us"] > 0 for n in added["entry_points"]), median


SHIM = ("integrations.te.out_route._routing_forward", "native._hotpath.IntoRing")
"""The TE route's FC2 shim: the Python one (debug mode, ``BUFREUSE_NATIVE=0``, no compiler) or the C one."""
STAGE = (
    "integrations.alltoall.hooks.hook_fc2_release.<locals>._after.<locals>.combine_stage",
    "native._hotpath.AfterStage",
)
"""The combine stage that releases the FC2 slot, in Python or in C."""
TE_PAD_HOOKS = (
    *SHIM,
    *STAGE,
    "pool.tracking._pack_unpack.<locals>.pack",
    "native._hotpath.Pack",
    "pool.tracking._pack_unpack.<locals>.unpack",
    "native._hotpath.unpack",
    "pool.tracking._SavedRef.__del__",
    "native._hotpath.SavedRef.__del__",
)
"""Every hook the TE module route may enter at EP = 1 in pad mode. An experts' wrapper (``tracked``'s
``when_read`` / ``always``), an FC2 forward override or a class-level route would add a name outside it."""


def check_te_pad_hook_entries(ring: dict) -> None:
    """The hook-time round's entries of the TE pad route (also checked on the recorded H200 run, on CPU)."""
    entries = {row["hook"].split(" (wraps ")[0]: row["entries"] for row in ring["by_hook"]}
    assert set(entries) <= set(TE_PAD_HOOKS), entries
    assert sum(entries.get(n, 0) for n in SHIM) == pytest.approx(1.0), entries  # the shim: once per layer call (FC2)
    assert sum(entries.get(n, 0) for n in STAGE) == pytest.approx(1.0), entries  # one combine stage (the rest pass)
    assert ring["entries_per_layer_call"] == pytest.approx(sum(entries.values())), ring
    assert ring["us"] > 0 and ring["originals_per_layer_call"] >= 2
