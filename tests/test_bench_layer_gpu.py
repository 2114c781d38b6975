"""`bufreuse bench layer` on one GPU: local spec, and real TE (``TEGroupedMLP``) in bf16 and FP8 (hybrid, delayed).

A small shape and few rounds: this proves the command's CUDA paths (module call, FP8 context, CUDA events, every
policy installed) and the TE module route's one ``out=`` per layer call, and records its JSON; the figures for
``docs/benchmarks.md`` come from the presets run by hand (see there). Run with scripts/gpu-tests.sh; the JSON goes
to ``$OUT/megatron-gpu-summary.json`` under ``bench_layer_<spec>_<precision>``.
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
            "--num-microbatches", str(MB), "--steps", str(STEPS), "--rounds", str(ROUNDS), "--warmup-rounds", "1",
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
def test_te_fc2_writes_into_the_ring_once_per_layer_call_and_fc1_never(monkeypatch, precision: str) -> None:
    """The TE module route in pad mode: TE's ``GroupedLinear.forward`` gets ``out=`` (a ring slot) once per layer call
    of the ring arm, always from one module (FC2), never from the layer's other GroupedLinear (FC1), and never in the
    control (positive control: both modules run TE's forward in every round of both arms)."""
    import functools

    import transformer_engine.pytorch as te

    calls: list[tuple[int, bool]] = []  # (module, out= given), in call order
    real = te.GroupedLinear.forward

    @functools.wraps(real)  # keeps the signature: the route still finds TE's forward(out=) here
    def counting(self, *args, **kwargs):
        calls.append((id(self), kwargs.get("out") is not None))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(te.GroupedLinear, "forward", counting)
    args = ["bench", "layer", "--device", "cuda", *SHAPE, "--spec", "te", "--precision", precision, "--pad",
            "--num-microbatches", str(MB), "--steps", str(STEPS), "--rounds", "2", "--warmup-rounds", "0",
            "--policies", "ring", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    per_round = (STEPS + 1) * MB  # layer calls per round: one untimed schedule + the timed ones
    assert data["order"] == ["control", "ring", "ring", "control"]
    ring_rounds = [r for r in data["rounds"] if r["arm"] == "ring"]
    assert all(r["acquisitions"] == {"expert_fc2_output": per_round} for r in ring_rounds), ring_rounds
    modules = sorted({m for m, _ in calls})
    into_ring = [m for m, out in calls if out]
    write_summary(f"bench_layer_te_pad_{precision}", {"te_forward_calls": len(calls), "with_out": len(into_ring)})
    assert len(modules) == 2 and len(calls) == 2 * 4 * per_round, (modules, len(calls))  # FC1 + FC2, 4 rounds
    assert len(into_ring) == 2 * per_round and len(set(into_ring)) == 1, (len(into_ring), set(into_ring))
