"""The EP >= 2 stream rule (``config.pending_free_at_ep``, through ``unused_rings``) and the plan's storage line.

Expected rows are written out by hand from docs/megatron.md's table "Which buffers cross streams at EP >= 2":
which buffer a second stream is recorded on, per configuration, not recomputed from the rule's own code.
"""

from __future__ import annotations

import pytest

from bufreuse import config
from bufreuse.config import BufReuseConfig, nccl_records_streams, static_bounds, unused_rings
from bufreuse.plan import plan_config

BOTH = BufReuseConfig(moe_hybridep_reuse_dispatch_output_buffers=True, moe_hybridep_num_expert_output_buffers=2)
BASE = {"moe_token_dispatcher_type": "alltoall", "num_moe_experts": 8, "moe_router_topk": 2, "bf16": True}

# (fields over BASE, records_streams, the rings used): "used" = a second stream is recorded on the buffer and
# the buffer is what the ring holds.
ROWS = [
    # torch >= 2.8 NCCL, no overlap: both collectives run in order on the compute stream
    ({"expert_model_parallel_size": 2}, False, set()),
    ({"expert_model_parallel_size": 8}, False, set()),  # one local expert: still one stream
    ({"expert_model_parallel_size": 2, "distributed_backend": "gloo"}, True, set()),  # gloo never counts
    # torch < 2.8 NCCL: the dispatch output is recorded on NCCL's stream; the FC2 output only when the combine's
    # all-to-all reads it itself (one local expert), not the local-expert sort's copy
    ({"expert_model_parallel_size": 2}, True, {"dispatch"}),
    ({"expert_model_parallel_size": 8}, True, {"dispatch", "expert"}),
    # EP overlap: the mlp node frees the dispatch output by record_stream + resize_(0) with > 1 local expert or FP8
    ({"expert_model_parallel_size": 2, "overlap_moe_expert_parallel_comm": True}, False, {"dispatch"}),
    ({"expert_model_parallel_size": 4, "overlap_moe_expert_parallel_comm": True}, False, {"dispatch"}),  # 2 local
    ({"expert_model_parallel_size": 8, "overlap_moe_expert_parallel_comm": True}, False, {"expert"}),
    ({"expert_model_parallel_size": 8, "overlap_moe_expert_parallel_comm": True, "fp8": "hybrid"}, False,
     {"dispatch", "expert"}),
    # ... the combine node's input is the FC2 output only at expert TP 1 (else the reduce-scatter's result)
    ({"expert_model_parallel_size": 8, "expert_tensor_parallel_size": 2, "overlap_moe_expert_parallel_comm": True},
     False, set()),
    # overlap_dispatch_backward_with_experts_wgrad: FC1's delayed wgrad reads the saved dispatch output on
    # _delayed_wgrad_stream; TE's backward_dw drops it without record_stream in the sources read, not measured:
    # the dispatch ring stays in use where FC1 reads the dispatch output itself (one bf16 local expert)
    ({"expert_model_parallel_size": 8, "overlap_dispatch_backward_with_experts_wgrad": True}, False, {"dispatch"}),
    ({"expert_model_parallel_size": 2, "overlap_dispatch_backward_with_experts_wgrad": True}, False, set()),  # sort
    ({"expert_model_parallel_size": 8, "overlap_dispatch_backward_with_experts_wgrad": True, "fp8": "hybrid"}, False,
     set()),  # FC1 saves its quantized copy
]  # fmt: skip


@pytest.mark.parametrize(("extra", "records", "used"), ROWS)
def test_rings_used_where_a_second_stream_is_recorded_on_their_buffer(extra, records, used) -> None:
    cfg = {**BASE, **extra}
    unused = unused_rings(cfg, BOTH, "alltoall", records_streams=records)
    assert {"dispatch", "expert"} - set(unused) == used, unused
    for why in unused.values():
        assert "nothing waits pending-free" in why
    # the keep knob (a validation aid) puts every one of them back
    keep = BufReuseConfig(**{**_fields(BOTH), "moe_bufreuse_keep_unused_rings": True})
    assert unused_rings(cfg, keep, "alltoall", records_streams=records) == {}


def test_the_delayed_wgrad_overlap_field_is_megatrons() -> None:
    """The field the rule reads is a megatron-core 0.19.2 ``TransformerConfig`` field (a rename would leave the rule
    reading nothing)."""
    import dataclasses

    core = pytest.importorskip("megatron.core.transformer.transformer_config")
    names = {f.name for f in dataclasses.fields(core.TransformerConfig)}
    assert {"overlap_dispatch_backward_with_experts_wgrad", "overlap_moe_expert_parallel_comm"} <= names


def test_the_keep_knob_leaves_the_ep1_reasons_alone() -> None:
    keep = BufReuseConfig(**{**_fields(BOTH), "moe_bufreuse_keep_unused_rings": True})
    assert set(unused_rings({**BASE, "expert_model_parallel_size": 1}, keep, "alltoall")) == {"dispatch", "expert"}


def test_hybridep_is_not_judged_by_the_all_to_all_rule() -> None:
    cfg = {**BASE, "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "flex",
           "moe_flex_dispatcher_backend": "hybridep"}  # fmt: skip
    assert unused_rings(cfg, BOTH, "hybridep") == {}


@pytest.mark.parametrize(
    ("version", "env", "records"),
    [("2.7.1+cu126", {}, True), ("2.7.1", {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}, False),
     ("2.8.0", {}, False), ("2.13.0+cpu", {}, False), ("2.4.0", {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}, True),
     ("2.10.0a0+git", {}, False),
     # a pre-release of 2.8 (a nightly, an NGC build from before the change) counts as 2.7: it records
     ("2.8.0a0+gitabc123", {}, True), ("2.8.0.dev20250415+cu128", {}, True), ("2.8.0rc1", {}, True),
     ("2.8.0a0", {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}, False),
     ("2.9.0a0+git", {}, False), ("2.8.0", {}, False), ("2.8.1+cu129", {}, False), ("2.8.0.post1", {}, False)],
)  # fmt: skip
def test_nccl_records_streams_before_torch_2_8(version, env, records) -> None:
    assert nccl_records_streams(version, env) is records


def _records(monkeypatch, value: bool) -> None:
    """What NCCL does with streams, fixed (not the installed torch's): ``value`` True as before torch 2.8."""
    monkeypatch.setattr(config, "nccl_records_streams", lambda *args, **kwargs: value)


def test_the_unused_bound_still_reports_rows_and_keeps_no_slot(monkeypatch) -> None:
    cfg = {**BASE, "expert_model_parallel_size": 2, "hidden_size": 64}
    _records(monkeypatch, False)
    bound = static_bounds(cfg, BOTH, path="alltoall", tokens=100)["dispatch"]
    assert bound.rows == 2 * 100 * 2 and bound.slots == 0 and bound.persistent_bytes == 0  # EP x tokens x topk
    assert "dropless worst case" in bound.source and "not used" in bound.source
    _records(monkeypatch, True)  # positive control: where NCCL records streams the same bound keeps its slots
    assert static_bounds(cfg, BOTH, path="alltoall", tokens=100)["dispatch"].slots == BOTH.slots("dispatch") > 0


def test_plan_names_ring_storage_per_rank_and_the_dropless_worst_case(monkeypatch) -> None:
    # FP8, one local expert, EP overlap: both rings used (the table's rows)
    fields = {**BASE, "expert_model_parallel_size": 8, "overlap_moe_expert_parallel_comm": True, "num_layers": 2,
              "fp8": "hybrid",
              "hidden_size": 1024, "seq_length": 2048, "micro_batch_size": 1, "num_microbatches": 4,
              "moe_hybridep_reuse_dispatch_output_buffers": True, "moe_hybridep_num_expert_output_buffers": 4,
              "moe_hybridep_num_dispatch_output_buffers": 4}  # fmt: skip
    _records(monkeypatch, False)  # torch >= 2.8 NCCL, whatever torch is installed here
    report = plan_config(fields)
    # one slot: EP 8 x 2048 tokens x min(topk 2, 1 local expert) rows x 1024 x 2 bytes = 32 MiB
    slot = 8 * 2048 * 1 * 1024 * 2
    by = {b.buffer: b for b in report.buffers}
    assert by["dispatch"].slot_bytes == by["expert"].slot_bytes == slot
    total = (by["dispatch"].minimum + by["expert"].minimum) * slot
    line = report.storage_line()
    assert line.startswith(f"ring storage per rank: {total / 2**20:.1f} MiB (")
    assert line.count("dropless worst case: EP 8 x 2048 tokens x min(topk 2, 1 local experts)") == 2
    assert report.to_dict()["ring_storage_bytes"] == total
    # capacity-bounded: the line names the capacity, not the worst case
    padded = plan_config({**fields, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True})
    assert "pad to capacity" in padded.storage_line() and "dropless" not in padded.storage_line()
    # nothing used: 0 MiB, and why
    plain = plan_config({k: v for k, v in fields.items() if k != "overlap_moe_expert_parallel_comm"})
    assert plain.storage_line().startswith("ring storage per rank: 0 MiB (no ring is used: ")
    _records(monkeypatch, True)  # positive control: NCCL before 2.8 records streams, both rings used again
    again = plan_config({k: v for k, v in fields.items() if k != "overlap_moe_expert_parallel_comm"})
    assert again.to_dict()["ring_storage_bytes"] == total


def _fields(knobs: BufReuseConfig) -> dict:
    import dataclasses

    return {f.name: getattr(knobs, f.name) for f in dataclasses.fields(knobs)}


OVERRIDE = (
    "override: keep rings the stream rule leaves unused (use when a trace shows MoE pending-free the rule does not "
    "predict)"
)


def test_the_keep_knob_is_named_an_override_in_help_docs_and_advise(tmp_path) -> None:
    """``--moe-bufreuse-keep-unused-rings`` is what advise recommends when a trace contradicts the stream rule, so its
    help, docs/megatron.md and advise's warning call it the same thing: an override (not a validation aid)."""
    import argparse
    import json
    from pathlib import Path

    from test_advise import ARGS, EXPERT, _megatron_trace
    from test_snapshot_sites import MEGATRON, NATIVE
    from typer.testing import CliRunner

    from bufreuse.cli.app import app

    parser = config.add_arguments(argparse.ArgumentParser())
    (action,) = [a for a in parser._actions if "--moe-bufreuse-keep-unused-rings" in a.option_strings]
    assert action.help.lower().startswith(OVERRIDE.lower()), action.help
    docs = (Path(__file__).parents[1] / "docs" / "megatron.md").read_text()
    assert f"`--moe-bufreuse-keep-unused-rings` ({OVERRIDE})" in " ".join(docs.split())
    snap = _megatron_trace(tmp_path, [*NATIVE, *MEGATRON], [*NATIVE, *EXPERT])
    args = tmp_path / "run.args"
    args.write_text(ARGS.format(ep=2))
    res = CliRunner().invoke(app, ["advise", str(snap), "--args", str(args), "--num-microbatches", "6",
                                   "--torch-version", "2.9.0", "--json"])  # fmt: skip
    warned = [w for w in json.loads(res.stdout)["warnings"] if "install() would leave its ring unused" in w]
    assert warned and all(f"--moe-bufreuse-keep-unused-rings ({OVERRIDE})" in w for w in warned), warned
