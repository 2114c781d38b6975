"""Knobs, file loading, static bounds, and the requirement matrix against a real TransformerConfig.

megatron-core refuses some fields at construction without Transformer Engine (``fp8`` raises
"Only transformer-engine>=1.7.0 supports MoE FP8 training"; ``moe_permute_fusion`` needs TE's
fused permute). Those are set on a real, constructed config afterwards (``_set``), which is how a
TE build would hold them; every other field goes through ``TransformerConfig.__init__``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bufreuse.config import (
    BufReuseConfig,
    add_arguments,
    dispatch_path,
    load_megatron_file,
    persistent_bytes,
    static_bounds,
)
from bufreuse.errors import ConfigError, InputError
from bufreuse.integrations.features import Features
from bufreuse.integrations.requirements import REQUIREMENTS, check, validate

FEATURES_ON = Features(deepep_output_token=True, deepep_detail="fake", te_grouped_output=True, te_detail="fake")
FEATURES_OFF = Features(deepep_output_token=False, deepep_detail="absent", te_grouped_output=False, te_detail="absent")
EXERCISED = {"moe_bufreuse_ring_identity_dispatch": True, "moe_bufreuse_ring_single_rank_expert": True}
"""The validation knobs: the all-to-all configs here are EP = 1, where production uses no ring (and so
requires nothing of one); these tests are about the requirements of rings that are used."""
BOTH_ON = BufReuseConfig(
    moe_hybridep_reuse_dispatch_output_buffers=True, moe_hybridep_num_expert_output_buffers=4, **EXERCISED
)


def _mc():
    return pytest.importorskip("megatron.core.transformer.transformer_config")


def _set(cfg, **fields):
    for k, v in fields.items():
        setattr(cfg, k, v)  # fields megatron refuses at construction without TE
    return cfg


def _hybridep_cfg():
    """A real 0.19 config meeting every HybridEP row (fp8 set after construction, see module doc)."""
    cfg = _mc().TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        bf16=True,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="hybridep",
        expert_model_parallel_size=2,
        overlap_moe_expert_parallel_comm=True,
        use_transformer_engine_op_fuser=True,
        moe_grouped_gemm=True,
        moe_expert_rank_capacity_factor=1.5,
    )
    return _set(cfg, fp8="e4m3")


def _alltoall_cfg():
    return _mc().TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        bf16=True,
        moe_token_dispatcher_type="alltoall",
    )


# rule -> (config factory, fields that break it). Each rule has a passing (factory as is) and a failing config.
BREAKERS = {
    "dispatcher": (_alltoall_cfg, {"moe_token_dispatcher_type": "allgather"}),
    "static_bound": (_hybridep_cfg, {"moe_expert_rank_capacity_factor": None}),
    "ep_overlap": (_hybridep_cfg, {"overlap_moe_expert_parallel_comm": False}),
    "quantized_experts": (_hybridep_cfg, {"fp8": None}),
    "grouped_gemm": (_hybridep_cfg, {"moe_grouped_gemm": False}),
    "no_fused_group_mlp_offload": (
        _hybridep_cfg,
        {"fine_grained_activation_offloading": True, "offload_modules": ["fused_group_mlp"]},
    ),
    "no_expert_input_offload": (
        _alltoall_cfg,
        {"fine_grained_activation_offloading": True, "offload_modules": ["expert_fc1"]},
    ),
    "no_graphed_delayed_wgrad": (
        _alltoall_cfg,  # pad-to-capacity at EP = 1: the experts read the slot (bf16), so FC1's wgrad store holds it
        {
            "delay_wgrad_compute": True,
            "cuda_graph_impl": "full_iteration",
            "moe_pad_expert_input_to_capacity": True,
            "moe_expert_capacity_factor": 1.0,
        },
    ),
    "unfused_permute": (_alltoall_cfg, {"moe_permute_fusion": True}),
    "no_shared_expert_overlap": (_alltoall_cfg, {"moe_shared_expert_overlap": True}),
    "no_cuda_graphs": (_alltoall_cfg, {"cuda_graph_impl": "full_iteration"}),
    "no_hybridep_probs_on_input": (_hybridep_cfg, {"moe_apply_probs_on_input": True}),
    "no_per_layer_cuda_graphs": (_hybridep_cfg, {"cuda_graph_impl": "transformer_engine"}),
    "no_paged_stash": (_alltoall_cfg, {"moe_paged_stash": True}),
    "no_te_cpu_offload": (_alltoall_cfg, {"cpu_offloading": True}),
}


def test_every_rule_has_a_breaker_or_a_dedicated_test() -> None:
    dedicated = {"deepep_output_token", "te_grouped_output", "expert_output_writer", "tokens_known", "dispatch_slots"}
    assert {r.key for r in REQUIREMENTS} == set(BREAKERS) | dedicated


@pytest.mark.parametrize("factory", [_hybridep_cfg, _alltoall_cfg])
def test_validate_passes_complete_config(factory) -> None:
    report = validate(factory(), BOTH_ON, seq_length=128, micro_batch_size=2, features=FEATURES_ON)
    assert report.ok and report.items and set(report.bounds) == {"dispatch", "expert"}


@pytest.mark.parametrize("rule", sorted(BREAKERS))
def test_validate_names_each_broken_rule(rule: str) -> None:
    factory, fields = BREAKERS[rule]
    cfg = _set(factory(), **fields)
    with pytest.raises(ConfigError) as e:
        validate(cfg, BOTH_ON, seq_length=128, micro_batch_size=2, features=FEATURES_ON)
    report = check(cfg, BOTH_ON, seq_length=128, micro_batch_size=2, features=FEATURES_ON)
    assert {i.key for i in report.unmet} == {rule}
    fix = next(r.fix for r in REQUIREMENTS if r.key == rule)
    assert rule in str(e.value) and fix in str(e.value)


@pytest.mark.parametrize(
    "rule", sorted(r for r, (f, _) in BREAKERS.items() if f is _alltoall_cfg and r != "dispatcher")
)
def test_validate_asks_nothing_of_rings_unused_at_ep_1(rule: str) -> None:
    # production knobs at EP x ETP = 1: install() registers neither ring, so none of their rules applies
    # (the positive control is test_validate_names_each_broken_rule, the same config with the rings exercised)
    factory, fields = BREAKERS[rule]
    cfg = _set(factory(), **fields)
    production = BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True, moe_hybridep_num_expert_output_buffers=4
    )
    report = validate(cfg, production, seq_length=128, micro_batch_size=2, features=FEATURES_ON)
    assert report.ok and {i.key for i in report.items} == {"dispatcher"}
    assert {b.slots for b in report.bounds.values()} == {0}


def test_validate_detected_features_gate_hybridep() -> None:
    report = check(_hybridep_cfg(), BOTH_ON, seq_length=128, micro_batch_size=2, features=FEATURES_OFF)
    assert {(i.key, i.buffer) for i in report.unmet} == {
        ("deepep_output_token", "dispatch"),
        ("te_grouped_output", "expert"),
    }


def test_validate_lists_every_unmet_requirement_in_one_error() -> None:
    cfg = _set(_hybridep_cfg(), fp8=None, overlap_moe_expert_parallel_comm=False, moe_grouped_gemm=False)
    with pytest.raises(ConfigError) as e:
        validate(cfg, BOTH_ON, features=FEATURES_OFF)  # no seq_length either
    msg = str(e.value)
    for key in ("quantized_experts", "ep_overlap", "grouped_gemm", "deepep_output_token", "tokens_known"):
        assert key in msg
    assert "unmet requirement" in msg


def test_validate_stream_ordered_needs_no_overlap_or_fp8_but_a_hybridep_bound() -> None:
    knobs = BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_bufreuse_dispatch_policy="stream-ordered",
        moe_hybridep_num_dispatch_output_buffers=0,
    )
    cfg = _set(_hybridep_cfg(), fp8=None, overlap_moe_expert_parallel_comm=False)
    assert validate(cfg, knobs, features=FEATURES_ON).ok
    assert not check(cfg, knobs, features=FEATURES_OFF).ok  # still needs the DeepEP output_token API
    # HybridEP writes into the caller's buffer, which must exist before the kernel runs: the bound is
    # needed by stream-ordered too (install() refuses without it, and validate() now says so first).
    unbounded = _set(cfg, moe_expert_rank_capacity_factor=None)
    assert [i.key for i in check(unbounded, knobs, features=FEATURES_ON).unmet] == ["static_bound"]


def test_validate_ring_needs_a_slot() -> None:
    knobs = BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True, moe_hybridep_num_dispatch_output_buffers=0, **EXERCISED
    )
    report = check(_alltoall_cfg(), knobs, seq_length=128, micro_batch_size=1, features=FEATURES_ON)
    assert [i.key for i in report.unmet] == ["dispatch_slots"]


def test_static_bound_hybridep_rank_capacity_aligned() -> None:
    bounds = static_bounds(_hybridep_cfg(), BOTH_ON, path="hybridep", tokens=1000)
    # int(1000 x 2 x 1.5) = 3000, rounded up to the op fuser's 256 -> 3072 rows
    assert bounds["dispatch"].rows == 3072 and bounds["dispatch"].slot_bytes == 3072 * 64 * 2
    assert bounds["expert"].persistent_bytes == 4 * 3072 * 64 * 2


def test_static_bound_pad_to_capacity_and_dropless_worst_case() -> None:
    cfg = _set(_alltoall_cfg(), moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True)
    assert static_bounds(cfg, BOTH_ON, path="alltoall", tokens=1000)["dispatch"].rows == 8 * 313
    production = BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True, moe_hybridep_num_expert_output_buffers=4
    )
    dropless = static_bounds(_alltoall_cfg(), production, path="alltoall", tokens=1000)["dispatch"]
    # EP = 1: the all-to-all returns its input, so no dispatch ring is registered (its bound is still reported)
    assert dropless.rows == 1 * 1000 * 2 and dropless.persistent_bytes == 0 and "EP = 1" in dropless.source
    # EP = 2 under EP overlap: the dispatch output crosses to the compute stream and waits pending-free there
    overlap = _set(_alltoall_cfg(), expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True)
    ep2 = static_bounds(overlap, BOTH_ON, path="alltoall", tokens=1000)
    assert ep2["dispatch"].persistent_bytes == 4 * ep2["dispatch"].rows * 64 * 2 > 0
    # without it the all-to-all runs on the compute stream (torch >= 2.8): no ring, the bound still reported
    plain = static_bounds(_set(_alltoall_cfg(), expert_model_parallel_size=2), BOTH_ON, path="alltoall", tokens=1000)
    assert plain["dispatch"].persistent_bytes == 0 and plain["dispatch"].rows == ep2["dispatch"].rows


def test_persistent_bytes_is_the_sum_of_the_ring_bounds() -> None:
    bounds = static_bounds(_hybridep_cfg(), BOTH_ON, path="hybridep", tokens=1000)
    total = persistent_bytes(_hybridep_cfg(), BOTH_ON, path="hybridep", tokens=1000)
    assert total == sum(b.persistent_bytes for b in bounds.values()) == 2 * 4 * 3072 * 64 * 2
    assert persistent_bytes(_hybridep_cfg(), BOTH_ON, path="hybridep", tokens=None) == 0


def test_dispatch_path_from_config_fields() -> None:
    assert dispatch_path({"moe_token_dispatcher_type": "alltoall"}) == "alltoall"
    assert dispatch_path({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep"}) == "hybridep"
    assert dispatch_path({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep"}) is None
    assert dispatch_path({}) is None


def test_config_module_imports_only_the_standard_library_and_errors() -> None:
    code = (
        "import sys, bufreuse.config; "
        "bad = sorted(m for m in sys.modules if m.startswith(('torch', 'megatron', 'bufreuse.integrations'))); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_knobs_reject_bad_policy_and_counts() -> None:
    with pytest.raises(ConfigError) as e:
        BufReuseConfig(moe_bufreuse_expert_policy="lifo", moe_hybridep_num_expert_output_buffers=-1)
    assert "moe_bufreuse_expert_policy" in str(e.value) and "moe_hybridep_num_expert_output_buffers" in str(e.value)


def test_add_arguments_is_an_extra_args_provider() -> None:
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--moe-hybridep-reuse-dispatch-output-buffers", "--moe-hybridep-num-expert-output-buffers", "3",
         "--moe-bufreuse-expert-policy", "stream-ordered"]
    )  # fmt: skip
    knobs = BufReuseConfig.from_args(args)
    assert knobs.enabled() == {"dispatch": "ring", "expert": "stream-ordered"}
    assert knobs.slots("dispatch") == 4 and knobs.slots("expert") == 0


def test_load_megatron_yaml_flattens_sections(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  hidden_size: 128\nmoe-hybridep-num-expert-output-buffers: 2\n")
    data = load_megatron_file(p)
    assert data == {"hidden_size": 128, "moe_hybridep_num_expert_output_buffers": 2}
    assert BufReuseConfig.from_mapping(data).expert_enabled


def test_load_megatron_args_file(tmp_path: Path) -> None:
    p = tmp_path / "args.txt"
    p.write_text("# comment\n--bf16 --hidden-size 128 \\\n--offload-modules fused_group_mlp expert_fc1 --lr=1e-4\n")
    assert load_megatron_file(p) == {
        "bf16": True,
        "hidden_size": 128,
        "offload_modules": ["fused_group_mlp", "expert_fc1"],
        "lr": 1e-4,
    }


@pytest.mark.parametrize("text", ["a: [unclosed", "- just\n- a list\n"])
def test_load_megatron_file_bad_input(tmp_path: Path, text: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(InputError):
        load_megatron_file(p)
    with pytest.raises(InputError, match="cannot read"):
        load_megatron_file(tmp_path / "missing.yaml")


MC016 = Path(os.environ.get("BUFREUSE_MEGATRON_016", Path(__file__).parents[1] / ".venv-megatron016"))


@pytest.mark.skipif(not (MC016 / "megatron" / "core").is_dir(), reason="megatron-core 0.16.x target folder absent")
def test_validate_on_megatron_core_016_field_set() -> None:
    """0.16.x lacks moe_expert_rank_capacity_factor and use_transformer_engine_op_fuser (CI installs it)."""
    code = textwrap.dedent(
        """
        import json, warnings
        warnings.filterwarnings("ignore")
        import megatron.core
        from megatron.core.transformer.transformer_config import TransformerConfig
        from bufreuse.config import BufReuseConfig
        from bufreuse.integrations.features import Features
        from bufreuse.integrations.requirements import check
        cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
            moe_router_topk=2, bf16=True, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
            moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True, moe_grouped_gemm=True,
            expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True)
        cfg.fp8 = "e4m3"  # refused at construction without Transformer Engine
        feats = Features(deepep_output_token=True, deepep_detail="", te_grouped_output=True, te_detail="")
        knobs = BufReuseConfig(moe_hybridep_reuse_dispatch_output_buffers=True,
            moe_hybridep_num_expert_output_buffers=2)
        r = check(cfg, knobs, seq_length=128, micro_batch_size=2, features=feats)
        print(json.dumps({"file": megatron.core.__file__,
            "missing": [f for f in ("moe_expert_rank_capacity_factor", "use_transformer_engine_op_fuser")
                        if not hasattr(cfg, f)],
            "unmet": [[i.key, i.buffer, i.note] for i in r.unmet], "rows": r.bounds["dispatch"].rows}))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(MC016), str(Path(__file__).parents[1])])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["file"].startswith(str(MC016))
    assert res["missing"] == ["moe_expert_rank_capacity_factor", "use_transformer_engine_op_fuser"]
    # pad-to-capacity gives the static bound on 0.16, and the expert ring takes the module route (GroupedLinear
    # out=) there, as on Hopper: nothing is unmet although the op-fuser field does not exist
    assert res["unmet"] == []
    assert res["rows"] == 64 * 2 * 4  # capacity ceil(256 x 2 / 8 x 1.0) = 64, x EP 2 x 4 local experts


def test_docs_matrix_lists_every_rule() -> None:
    import re

    doc = (Path(__file__).parents[1] / "docs" / "megatron.md").read_text()
    section = doc.split("## Requirement matrix", 1)[1]
    lines = section.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    rows = lines[start + 2 : end]  # the first table, minus header and rule
    keys = [re.search(r"\(`([a-z_]+)`\) \|", row).group(1) for row in rows]
    assert sorted(keys) == sorted(r.key for r in REQUIREMENTS)


@pytest.mark.skipif(not (MC016 / "megatron" / "core").is_dir(), reason="megatron-core 0.16.x target folder absent")
def test_every_rule_on_megatron_core_016_field_set() -> None:
    """The BREAKERS table again, on real 0.16.1 configs (one subprocess; HybridEP bound from pad-to-capacity)."""
    cases = []
    for rule, (factory, fields) in BREAKERS.items():
        path = "hybridep" if factory is _hybridep_cfg else "alltoall"
        if rule == "static_bound":
            fields = {"moe_pad_expert_input_to_capacity": False}
        both = path == "alltoall" or rule == "grouped_gemm"
        cases.append({"rule": rule, "path": path, "fields": fields, "both": both})
    cases += [{"rule": None, "path": p, "fields": {}, "both": p == "alltoall"} for p in ("hybridep", "alltoall")]
    code = textwrap.dedent(
        """
        import json, sys, warnings
        warnings.filterwarnings("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig
        from bufreuse.config import BufReuseConfig
        from bufreuse.integrations.features import Features
        from bufreuse.integrations.requirements import check
        common = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                      bf16=True)
        def base(path):
            if path == "alltoall":
                return TransformerConfig(**common, moe_token_dispatcher_type="alltoall")
            cfg = TransformerConfig(**common, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True, moe_grouped_gemm=True,
                moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
            cfg.fp8 = "e4m3"  # refused at construction without Transformer Engine
            return cfg
        feats = Features(deepep_output_token=True, deepep_detail="", te_grouped_output=True, te_detail="")
        out = []
        for case in json.loads(sys.argv[1]):
            cfg = base(case["path"])
            for k, v in case["fields"].items():
                setattr(cfg, k, v)
            knobs = BufReuseConfig(moe_hybridep_reuse_dispatch_output_buffers=True,
                                   moe_hybridep_num_expert_output_buffers=2 if case["both"] else 0,
                                   moe_bufreuse_ring_identity_dispatch=True,
                                   moe_bufreuse_ring_single_rank_expert=True)
            r = check(cfg, knobs, seq_length=128, micro_batch_size=2, features=feats)
            out.append(sorted({i.key for i in r.unmet}))
        print(json.dumps(out))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(MC016), str(Path(__file__).parents[1])])}
    res = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for case, unmet in zip(cases, got, strict=True):
        expected = {case["rule"]} - {None}
        assert set(unmet) == expected, (case, unmet)


def test_expert_bound_includes_fp8_pad_rows_of_te_grouped_experts() -> None:
    from bufreuse.config import BufReuseConfig, expert_pad_rows, static_bounds

    cfg = {"moe_token_dispatcher_type": "alltoall", "num_moe_experts": 8, "moe_router_topk": 2, "hidden_size": 1024,
           "fp8": "hybrid", "moe_grouped_gemm": True, "bf16": True}  # fmt: skip
    assert expert_pad_rows(cfg, "alltoall") == 8 * 15
    assert expert_pad_rows({**cfg, "moe_router_padding_for_quantization": True}, "alltoall") == 0
    assert expert_pad_rows({**cfg, "fp8": None}, "alltoall") == 0
    assert expert_pad_rows({**cfg, "expert_model_parallel_size": 4}, "alltoall") == 2 * 15
    knobs = BufReuseConfig(moe_hybridep_reuse_dispatch_output_buffers=True, moe_hybridep_num_dispatch_output_buffers=2,
                           moe_hybridep_num_expert_output_buffers=2)  # fmt: skip
    b = static_bounds(cfg, knobs, path="alltoall", tokens=2048)
    assert (b["dispatch"].rows, b["expert"].rows) == (4096, 4096 + 120) and "pad rows" in b["expert"].source
