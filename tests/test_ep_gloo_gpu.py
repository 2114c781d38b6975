"""Expert parallelism on the one H200: 2 and 4 processes share the GPU over gloo on CUDA tensors.

The CPU suite's harness (``tests/ep_harness.py``) with ``device="cuda"``: every rank calls ``torch.cuda.set_device(0)``
and gloo runs ``all_to_all_single`` (uneven splits), all-gather and all-reduce on CUDA tensors. Megatron's local spec
and (``te``) ``get_gpt_layer_with_transformer_engine_spec(moe_grouped_gemm=True)``, bf16 and FP8 (``hybrid``,
delayed scaling), dropless (megatron's own token-count sync on its dtoh side stream; no CPU shim) and
pad-to-capacity. Each case counts synchronizing CUDA calls (``torch.cuda.set_sync_debug_mode('warn')``) in each
arm's steady state (a layer's second run) and fails where the rings arm makes more than the control. Local-spec
results must be bit-equal; TE results within the control-against-control spread, which goes to
``$OUT/ep-gloo-gpu.json`` (else ``./out``) and ``$OUT/megatron-gpu-summary.json`` under ``ep_gloo``.

``overlap_moe_expert_parallel_comm`` is set in the config where megatron allows it (EP > 1, bf16): ``install`` then
decides by its stream rule (``config.pending_free_at_ep``). The comm-stream overlap itself cannot be driven from a
layer: megatron-core 0.19.2 launches the all-to-alls on the comm stream only inside the combined-1F1B schedule
(``models/gpt/fine_grained_callables.py:build_transformer_layer_callables`` gives the dispatch and combine to
``ScheduleNode``s that ``models/common/model_chunk_schedule_plan.py:TransformerLayerSchedulePlan`` builds on
``get_comm_stream()``, for a whole ``TransformerLayer`` with attention, run by
``pipeline_parallel/combined_1f1b.py``); ``MoELayer.dispatch`` / ``combine`` run on the current stream.

The ``ep2-streams`` world (``test_ep_gpu_producer_waits_across_microbatch_streams``) runs each microbatch on its own
CUDA stream (``Case.streams``), which no other microbatch's stream joins, with a delay before every slow reader of the
dispatch slot: the next microbatch's dispatch (gloo's copy into the slot) is ordered after the last reader of the slot
(FC1's weight gradient in the backward, on another stream) only by the ring's GPU wait. Skipping that wait
(``scripts/mutations.toml``: ``ring-skips-producer-wait``, ``ring-producer-wait-not-enqueued``) makes FC1's weight
gradient read the next microbatch's tokens: not bit-equal to the control, which runs on the same streams.

Run with ``scripts/gpu-tests.sh`` (``pytest -m gpu``), or just this file: ``pytest -m gpu tests/test_ep_gloo_gpu.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from ep_harness import RINGS, ROUTINGS, Case, WorldResult, _topk, run_world  # noqa: E402
from schedule_harness import ORDERS, write_summary  # noqa: E402

pytestmark = pytest.mark.gpu
SIZES = {"hidden": 256, "ffn": 512, "seq": 128, "mbs": 2}


def gpu_cases(ep: int) -> list[Case]:
    """Local spec, bf16: every routing dropless at one and two local experts, pad-to-capacity, stream-ordered, the
    config's EP overlap, delayed-wgrad order; every case counts syncs."""
    orders = list(ORDERS)
    out = []
    for i, r in enumerate(ROUTINGS):
        for local in (1, 2):
            e = ep * local
            order = orders[(i + local) % len(orders)]
            out.append(Case(name=f"l{local}-dropless-{r}", experts=e, topk=_topk(e, ep), dtype="bfloat16",
                            dropless=True, routing=r, order=order, sync_check=True))  # fmt: skip
    out += [
        Case(name="l1-pad-1f1b", experts=ep, topk=_topk(ep, ep), dtype="bfloat16", sync_check=True),
        Case(name="l2-stream-ordered-dropless-skewed", experts=2 * ep, topk=2, dtype="bfloat16", dropless=True,
             routing="skewed", policy="stream-ordered", order="vpp", sync_check=True),
        Case(name="l1-overlap-dropless", experts=ep, topk=_topk(ep, ep), dtype="bfloat16", dropless=True,
             overlap=True, sync_check=True),
        Case(name="l2-overlap-dropless-empty", experts=2 * ep, topk=2, dtype="bfloat16", dropless=True,
             routing="empty", overlap=True, sync_check=True),
        Case(name="l1-dropless-1f1b_dw", experts=ep, topk=_topk(ep, ep), dtype="bfloat16", dropless=True,
             order="1f1b_dw", sync_check=True),
    ]  # fmt: skip
    return out


def te_cases(ep: int) -> list[Case]:
    """Real TE grouped MLP: bf16 and FP8 (hybrid, delayed scaling), dropless, one and two local experts."""
    out = []
    for fp8 in (None, "hybrid"):
        tag = "fp8" if fp8 else "bf16"
        out += [
            Case(name=f"te-{tag}-l1-dropless-random", experts=ep, topk=_topk(ep, ep), spec="te", dtype="bfloat16",
                 fp8=fp8, dropless=True, sync_check=True),
            Case(name=f"te-{tag}-l2-dropless-empty", experts=2 * ep, topk=2, spec="te", dtype="bfloat16", fp8=fp8,
                 dropless=True, routing="empty", order="vpp", sync_check=True),
            Case(name=f"te-{tag}-l2-overlap-dropless-skewed", experts=2 * ep, topk=2, spec="te", dtype="bfloat16",
                 fp8=fp8, dropless=True, routing="skewed", overlap=True, sync_check=True),
        ]  # fmt: skip
    out.append(Case(name="te-bf16-l1-delay_wgrad-dropless", experts=ep, topk=_topk(ep, ep), spec="te",
                    dtype="bfloat16", dropless=True, delay_wgrad=True, order="1f1b_dw", sync_check=True))  # fmt: skip
    return out


def stream_cases(ep: int) -> list[Case]:
    """One local expert (FC1 saves the dispatch slot itself), bf16, pad-to-capacity (no token-count sync), each
    microbatch on its own stream: one slot reused every microbatch (``fwd_bwd``) and two slots (``1f1b``)."""
    return [Case(name=f"l1-streams-{order}", experts=ep, topk=_topk(ep, ep), dtype="bfloat16", order=order,
                 streams=True) for order in ("fwd_bwd", "1f1b")]  # fmt: skip


WORLDS = {"ep2": (2, gpu_cases(2)), "ep4": (4, gpu_cases(4)), "ep2-te": (2, te_cases(2)), "ep4-te": (4, te_cases(4))}
STREAM_WORLDS = {"ep2-streams": (2, stream_cases(2))}
_RESULTS: dict[str, WorldResult] = {}


def _summary() -> dict:
    out = {}
    for key, res in _RESULTS.items():
        out[key] = {"wall_s": round(res.wall_s, 1), "cases": {}}
        for name, reps in res.by_case.items():
            out[key]["cases"][name] = [
                None if r is None else {
                    "problems": r["problems"],
                    "control_spread": r["info"].get("control_spread"),
                    "control_syncs": len(r["info"].get("control_syncs", [])),
                    "arms": {arm: {mode: {k: v for k, v in rep.items() if k not in ("sites",)}
                                   for mode, rep in modes.items()}
                             for arm, modes in r["info"].get("arms", {}).items()},
                    "dispatch_rows": r["info"].get("dispatch_rows"),
                }
                for r in reps
            ]  # fmt: skip
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    def get(key: str) -> WorldResult:
        if key not in _RESULTS:
            ep, cases = {**WORLDS, **STREAM_WORLDS}[key]
            workdir = Path(tmp_path_factory.mktemp(key))
            _RESULTS[key] = run_world(ep, 1, cases, device="cuda", workdir=workdir, timeout_s=590, sizes=SIZES)
        return _RESULTS[key]

    yield get
    data = _summary()
    write_summary("ep_gloo", data)
    out = Path(os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "ep-gloo-gpu.json").write_text(json.dumps(data, indent=1, default=str))


def _params(key: str, cases: list[Case]) -> list:
    marks = [pytest.mark.te] if key.endswith("-te") else []
    return [pytest.param(key, c, id=f"{key}-{c.name}", marks=marks) for c in cases]


@pytest.mark.parametrize(("key", "case"), [p for key, (_, cases) in WORLDS.items() for p in _params(key, cases)])
def test_ep_gpu_case_matches_control_without_extra_syncs(worlds, key: str, case: Case) -> None:
    result = worlds(key)
    failure = result.failure(case.name)
    assert failure is None, failure
    for rep in result.by_case[case.name]:
        arms = rep["info"]["arms"]
        assert any(all(r["rings"] == sorted(RINGS) for r in modes.values()) for modes in arms.values()), arms
        assert "control_syncs" in rep["info"]  # the sync count ran
        for arm, modes in arms.items():
            for mode, r in modes.items():
                assert "syncs" in r, (arm, mode)
                if case.spec != "te":
                    assert r["bit_equal"], (arm, mode, r["spread_vs_control"])


@pytest.mark.parametrize(
    ("key", "case"), [pytest.param(k, c, id=f"{k}-{c.name}") for k, (_, cases) in STREAM_WORLDS.items() for c in cases]
)
def test_ep_gpu_producer_waits_across_microbatch_streams(worlds, key: str, case: Case) -> None:
    """The kept arm (both rings hooked; production's rule stands them down over gloo) on one stream per microbatch:
    outputs and every gradient bit-equal to the control on the same streams, in production and debug mode, and the
    dispatch ring's producers waited on the GPU (``gpu_waits``) for every slot reused across streams."""
    result = worlds(key)
    failure = result.failure(case.name)
    assert failure is None, failure
    for rep in result.by_case[case.name]:
        modes = rep["info"]["arms"]["kept"]
        assert set(modes) == {"production", "debug"}
        for mode, r in modes.items():
            assert r["rings"] == sorted(RINGS) and r["bit_equal"], (mode, r.get("spread_vs_control"))
            dispatch = r["stats"]["dispatch_output"]
            assert dispatch["deferred_releases"] == 4 and dispatch["gpu_waits"] >= 4 - case.depth, dispatch
