"""Every log grammar on a real-shaped line of its format (hand-written), round-tripped to the numbers."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest

from bufreuse.analysis.runs.grammars import FIELDS, GRAMMARS, clean_text
from bufreuse.analysis.runs.hostlist import MAX_EXPANDED_HOSTS, expand_hostlist, parse_hostlist
from bufreuse.analysis.runs.megatron_log import describe_dropped, parse_log, parse_log_text, steady_iterations
from bufreuse.errors import LogFormatError

DATA = Path(__file__).parent / "data" / "logs"


def lm_line(it: int, ms: float, tflops: float | None = 200.0, *, total: int = 100, skipped: int = 0) -> str:
    """A Megatron-LM (2023-) iteration line."""
    tput = f" throughput per GPU (TFLOP/s/GPU): {tflops} |" if tflops is not None else ""
    return (
        f" [2026-01-05 14:03:51.123456] iteration {it:8d}/{total:8d} | consumed samples: {it * 64:12d} |"
        f" elapsed time per iteration (ms): {ms} |{tput} learning rate: 1.000000E-04 | global batch size:    64 |"
        f" lm loss: 6.500000E+00 | loss scale: 1.0 | grad norm: 0.412 | number of skipped iterations: {skipped:3d} |"
        " number of nan iterations:   0 |"
    )


def test_every_grammar_example_matches_its_pattern() -> None:
    for g in GRAMMARS:
        assert g.pattern.search(g.example), g.name
    assert len({g.name for g in GRAMMARS}) == len(GRAMMARS)


def test_megatron_lm_ms_iteration_line_round_trips() -> None:
    (rec,) = parse_log_text(lm_line(12, 6123.4, 1124.9) + "\n").iterations
    assert (rec.iteration, rec.total, rec.elapsed_ms, rec.tflops, rec.loss) == (12, 100, 6123.4, 1124.9, 6.5)


def test_megatron_lm_2020_seconds_line_and_rankless_memory_line_round_trip() -> None:
    text = (
        " iteration       10/    1000 | elapsed time per iteration (s): 1.25 | learning rate: 1.5E-04 |"
        " lm loss: 7.1E+00 | loss scale: 65536.0 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 |\n"
        "after 10 iterations memory (MB) | allocated: 8123.5 | max allocated: 12001.25 | reserved: 15000.0 |"
        " max reserved: 16384.0\n"
    )
    log = parse_log_text(text)
    (rec,) = log.iterations
    assert rec.elapsed_ms == 1250.0 and rec.tflops is None
    (mem,) = log.memory
    assert (mem.rank, mem.after_iterations, mem.allocated_mib, mem.max_reserved_mib) == (None, 10, 8123.5, 16384.0)
    assert log.peak("max_allocated_mib") == 12001.25 and log.warnings == []


def test_megatron_deepspeed_line_reads_seconds_samples_and_tflops() -> None:
    line = (
        " iteration      100/  292968 | consumed samples:        51200 | consumed tokens:    104857600 |"
        " elapsed time per iteration (s): 98.12 | learning rate: 5.999E-05 | global batch size:   512 |"
        " lm loss: 6.123456E+00 | loss scale: 4096.0 | grad norm: 1.234 | num zeros: 0.0 |"
        " number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 20.871 |"
        " TFLOPs: 135.40 |\n"
    )
    (rec,) = parse_log_text(line).iterations
    assert (rec.elapsed_ms, rec.samples_per_s, rec.tflops) == (pytest.approx(98120.0), 20.871, 135.40)


def test_current_average_pairs_take_the_current_value_and_say_so() -> None:
    line = (
        " iteration      200/    5000 | consumed samples:       409600 | elapsed time per iteration (ms): "
        "13090.4/13102.9 | throughput per GPU (TFLOP/s/GPU): 571.3/570.8 | learning rate: 2.0E-04 |"
        " lm loss: 3.2E+00 | number of skipped iterations:   0 | number of nan iterations:   0 |\n"
    )
    log = parse_log_text(line)
    (rec,) = log.iterations
    assert (rec.elapsed_ms, rec.tflops) == (13090.4, 571.3)
    assert any("current/average" in w and "current value" in w for w in log.warnings)


@pytest.mark.parametrize(
    "prefix",
    [
        "[20260105 14:03:51][rank-3/8][INFO ] [--------trainer.py:2471] : ",
        "[default3]:",
        "node017: ",
        "2026-12-01T10:00:00.812Z [default7]: ",
        "0: ",
    ],
)
def test_any_line_prefix_is_passed_through(prefix: str) -> None:
    text = "\n".join(prefix + line for line in (lm_line(1, 410.5), "  seq_length ...................... 4096")) + "\n"
    text += prefix + "[Rank 3] (after 1 iterations) memory (MB) | allocated: 1.0 | max allocated: 2.0 |"
    text += " reserved: 3.0 | max reserved: 4.0\n"
    log = parse_log_text(text)
    assert [r.elapsed_ms for r in log.iterations] == [410.5]
    assert log.args["seq_length"] == "4096"
    assert [(m.rank, m.max_reserved_mib) for m in log.memory] == [(3, 4.0)]


def test_ansi_colour_codes_and_crlf_are_cleaned() -> None:
    coloured = "\x1b[32m" + lm_line(1, 400.0).replace("elapsed", "\x1b[1melapsed\x1b[0m") + "\x1b[0m"
    text = coloured + "\r\n" + lm_line(2, 401.0) + "\r\n"
    log = parse_log_text(text)
    assert [r.elapsed_ms for r in log.iterations] == [400.0, 401.0] and not log.partial_last_line
    assert clean_text("a\x1b[0;31mb\r\n") == "ab\n"


def test_gzip_log_is_sniffed_by_content_not_name(tmp_path: Path) -> None:
    text = "".join(lm_line(i, 400.0 + i) + "\n" for i in range(1, 6))
    for name in ("run.log.gz", "run.log"):
        path = tmp_path / name
        path.write_bytes(gzip.compress(text.encode()))
        log = parse_log(path)
        assert [r.elapsed_ms for r in log.iterations] == [401.0, 402.0, 403.0, 404.0, 405.0]


def test_cut_gzip_log_keeps_what_it_holds_and_warns(tmp_path: Path) -> None:
    text = "".join(lm_line(i, 400.0 + i) + "\n" for i in range(1, 400))
    data = gzip.compress(text.encode())
    path = tmp_path / "cut.log.gz"
    path.write_bytes(data[: len(data) // 2])
    log = parse_log(path)
    assert 0 < len(log.iterations) < 399 and "gzip stream ends early" in log.warnings[0]
    assert all(r.elapsed_ms == 400.0 + r.iteration for r in log.iterations)


def test_cut_last_line_is_never_read_as_a_value() -> None:
    text = lm_line(1, 400.0) + "\n" + lm_line(2, 401.5)[:-60]
    log = parse_log_text(text)
    assert log.partial_last_line
    assert [(r.iteration, r.elapsed_ms) for r in log.iterations] == [(1, 400.0), (2, 401.5)]


@pytest.mark.parametrize("order", ["fragment_first", "complete_first"])
def test_complete_duplicate_line_wins_over_a_fragment_cut_by_another_rank(order: str) -> None:
    full = lm_line(5, 409.7, 200.3)
    fragment = full[: full.index("throughput") + 40] + "[default6]:" + lm_line(5, 409.7, 200.3)
    lines = [fragment, full] if order == "fragment_first" else [full, fragment]
    log = parse_log_text("\n".join(lines) + "\n")
    (rec,) = log.iterations
    assert (rec.elapsed_ms, rec.tflops, rec.loss) == (409.7, 200.3, 6.5)
    assert not any("more than once" in w for w in log.warnings)


def test_lone_fragment_keeps_only_its_terminated_fields() -> None:
    full = lm_line(5, 409.7, 200.3)
    cut = full[: full.index("throughput") + 36] + "[default6]: some other rank's text\n"
    (rec,) = parse_log_text(lm_line(4, 400.0) + "\n" + cut).iterations[1:]
    assert (rec.elapsed_ms, rec.tflops) == (409.7, None)


def test_unknown_format_names_what_was_looked_for_and_what_is_there() -> None:
    with pytest.raises(LogFormatError) as e:
        parse_log_text("epoch 1 step 10 loss=2.3 lr=1e-4\nepoch 1 step 20 loss=2.2\n", source="x.log")
    msg = str(e.value)
    assert "looked for" in msg and "elapsed time per iteration (ms)" in msg and "TFLOPs" in msg
    assert "2 other non-empty line(s)" in msg and "'epoch 1 step 10 loss=2.3 lr=1e-4'" in msg
    with pytest.raises(LogFormatError, match=r"without one, with fields 'consumed samples', 'lm loss'"):
        parse_log_text(" iteration 1/ 10 | consumed samples: 8 | lm loss: 2.0 |\n")


def test_all_skipped_windows_at_warmup_zero_say_why_without_warmup_hint_or_dict() -> None:
    log = parse_log_text("".join(lm_line(i, 400.0, skipped=1) + "\n" for i in range(1, 9)))
    steady, dropped = steady_iterations(log, warmup=0)
    assert steady == []
    msg = describe_dropped(dropped, warmup=0)
    assert "8 had skipped or NaN iterations (fp16 loss-scale skips?)" in msg
    assert "--warmup" not in msg and "{" not in msg
    assert "(lower --warmup?)" in describe_dropped({"warmup": 3, "skipped_or_nan": 5}, warmup=3)


def test_warmup_counts_iterations_and_windows_carry_their_length() -> None:
    text = "  log_interval .................. 10\n" + "".join(lm_line(i, 400.0) + "\n" for i in (10, 20, 30, 40))
    log = parse_log_text(text)
    assert [r.window for r in log.iterations] == [10, 10, 10, 10]
    for warmup, kept in ((0, [10, 20, 30, 40]), (10, [20, 30, 40]), (11, [30, 40]), (25, [40])):
        steady, dropped = steady_iterations(log, warmup=warmup)
        assert [r.iteration for r in steady] == kept and dropped["warmup"] == 4 - len(kept)


def test_resumed_log_counts_warmup_from_its_first_window() -> None:
    log = parse_log_text("".join(lm_line(i, 400.0) + "\n" for i in (1002, 1004, 1006, 1008)))
    assert [r.window for r in log.iterations] == [2, 2, 2, 2]
    steady, _ = steady_iterations(log, warmup=2)
    assert [r.iteration for r in steady] == [1004, 1006, 1008]


def test_world_size_line_and_arguments_block_fill_the_args() -> None:
    text = (
        "using world size: 64, data-parallel size: 8, context-parallel size: 1, hierarchical context-parallel "
        "sizes: Nonetensor-model-parallel size: 4, encoder-tensor-model-parallel size: 0, "
        "pipeline-model-parallel size: 2, encoder-pipeline-model-parallel size: 0\n"
        "------------------------ arguments ------------------------\n"
        "  micro_batch_size ................................ 1\n"
        "  recompute_granularity ........................... selective\n" + lm_line(1, 400.0) + "\n"
    )
    args = parse_log_text(text).args
    assert (args["world_size"], args["data_parallel_size"], args["context_parallel_size"]) == ("64", "8", "1")
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == ("4", "2")
    assert (args["micro_batch_size"], args["recompute_granularity"]) == ("1", "selective")


def test_nan_skips_and_fields_table_cover_the_counters() -> None:
    assert {f.attr for f in FIELDS.values()} >= {"elapsed_ms", "tflops", "loss", "skipped", "nan", "samples_per_s"}
    line = lm_line(3, 400.0).replace("lm loss: 6.500000E+00", "lm loss: NAN")
    (rec,) = parse_log_text(line + "\n").iterations
    assert math.isnan(rec.loss) and not rec.clean


def test_huge_host_list_stays_compressed_and_is_described() -> None:
    hs = parse_hostlist("n[0-999999999]")
    assert hs.hosts is None and hs.count == 10**9
    assert hs.describe() == "n[0-999999999] (10^9 hosts)"
    assert parse_hostlist("n[000000000-999999999]").same_as(
        parse_hostlist("n[000000000-499999999,500000000-999999999]")
    )
    assert not hs.same_as(parse_hostlist("n[0-999999998]"))
    with pytest.raises(ValueError, match=r"10\^9 hosts"):
        expand_hostlist("n[0-999999999]")


def test_host_list_within_budget_expands_and_merges_ranges() -> None:
    hs = parse_hostlist("gpu[1-3,2-5],gpu7")
    assert hs.hosts == ("gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "gpu7") and hs.count == 6
    assert len(expand_hostlist(f"n[1-{MAX_EXPANDED_HOSTS}]")) == MAX_EXPANDED_HOSTS
    assert parse_hostlist(f"n[1-{MAX_EXPANDED_HOSTS + 1}]").hosts is None


def test_host_list_budget_is_the_max_hosts_limit() -> None:
    from bufreuse.limits import Limits, override

    assert MAX_EXPANDED_HOSTS == Limits().max_hosts == 4096  # the old constant: the default's alias
    with override(max_hosts=3):
        assert parse_hostlist("n[1-4]").hosts is None and parse_hostlist("n[1-3]").count == 3
        with pytest.raises(ValueError, match=r"larger than 3 names.*--limit max-hosts=N"):
            expand_hostlist("n[1-4]")
    assert parse_hostlist("n[1-4]", limits=Limits(max_hosts=10)).hosts == ("n1", "n2", "n3", "n4")


def test_huge_nodelist_line_in_a_log_is_read_compressed_and_fast() -> None:
    import time

    start = time.perf_counter()
    log = parse_log_text("SLURM_JOB_NODELIST=n[0-999999999]\n" + lm_line(1, 400.0) + "\n")
    assert time.perf_counter() - start < 1.0
    assert log.nodes is not None and log.nodes.count == 10**9 and log.node_list is None


@pytest.mark.parametrize(
    ("label", "value"),
    [
        ("number of nan iterations", "inf"),
        ("number of nan iterations", "nan"),
        ("number of skipped iterations", "1e400"),
        ("number of skipped iterations", "-1"),
        ("number of skipped iterations", "2.5"),
        ("number of skipped iterations", "0[/]"),
        ("number of nan iterations", "0\ufffd"),
        ("number of nan iterations", "[bold red]x[/]"),
    ],
)
def test_count_field_that_is_no_count_is_ignored_and_named(label: str, value: str) -> None:
    line = lm_line(3, 400.0).replace(f"{label}:   0 |", f"{label}: {value} |")
    assert value in line
    log = parse_log_text(line + "\n")
    (rec,) = log.iterations
    assert (rec.skipped, rec.nan, rec.elapsed_ms) == (0, 0, 400.0)
    (warning,) = [w for w in log.warnings if "no usable value" in w]
    assert f"line 1: {label!r} is {value!r}" in warning


@pytest.mark.parametrize("glued", ["[/]", "\ufffd", "[bold red]x[/]", "$\\frac{1}{$"])
def test_timing_field_with_markup_glued_is_ignored_with_a_reason(glued: str) -> None:
    bad = lm_line(2, 410.0).replace("(ms): 410.0 |", f"(ms): 410.0{glued} |")
    log = parse_log_text(lm_line(1, 400.0) + "\n" + bad + "\n")
    assert [(r.iteration, r.elapsed_ms, r.tflops) for r in log.iterations] == [(1, 400.0, 200.0), (2, None, 200.0)]
    (warning,) = [w for w in log.warnings if "no usable value" in w]
    assert f"line 2: 'elapsed time per iteration (ms)' is {'410.0' + glued!r}" in warning


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("hidden_size", "7168[bold red]x[/]", "hidden_size is a str"),
        ("moe_router_topk", "8[/]", "moe_router_topk is a str"),
        ("moe_expert_rank_capacity_factor", "1.2$\\frac{1}{$", "moe_expert_rank_capacity_factor is a str"),
        ("seq_length", "4096\ufffd", "seq_length is a str"),
        ("hidden_size", "inf", "hidden_size is a float"),
        ("moe_router_topk", "nan", "moe_router_topk is a float"),
    ],
)
def test_printed_argument_that_is_no_number_leaves_ring_bytes_underived_with_a_reason(
    tmp_path: Path, name: str, value: str, why: str
) -> None:
    """The exact hostile values of the 10k fuzz run: compare reports the run and says why no bound."""
    from typer.testing import CliRunner

    from bufreuse.analysis.runs import resolve_runs
    from bufreuse.cli import app

    seed = DATA / "slurm-2796654.out"
    lines = seed.read_text().splitlines(keepends=True)
    (i,) = [k for k, ln in enumerate(lines) if f" {name} ..." in ln]
    lines[i] = lines[i].rsplit(" ", 1)[0] + f" {value}\n"
    log = tmp_path / "slurm-1.out"
    log.write_text("".join(lines))
    (run,) = resolve_runs([str(log)])
    assert run.ring_slots and not run.ring_slot_bytes
    assert any(why in w and "ring slot bytes not derived" in w for w in run.warnings), run.warnings
    (good,) = resolve_runs([str(seed)])
    assert good.ring_slot_bytes  # the unmodified log derives them
    res = CliRunner().invoke(app, ["compare", str(DATA / "slurm-2796012.out"), str(log)])
    assert res.exit_code in (0, 1) and "internal error" not in res.output, res.output
