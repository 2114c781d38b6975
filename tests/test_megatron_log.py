"""Megatron log parsing on hand-written fixtures in the real formats (tests/data/logs)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bufreuse.analysis.runs.megatron_log import expand_hostlist, parse_log, parse_log_text, steady_iterations
from bufreuse.errors import LogFormatError

LOGS = Path(__file__).parent / "data" / "logs"


def test_parse_seed_control_reads_iterations_memory_nodes_and_args() -> None:
    log = parse_log(LOGS / "slurm-2796012.out")
    assert [r.iteration for r in log.iterations] == list(range(1, 31))
    assert log.iterations[0].total == 30
    assert log.peak("max_allocated_mib") == 152545.0
    assert log.peak("max_reserved_mib") == 175294.0
    assert log.peak("device_used_mib") == 187430.0
    assert {m.rank for m in log.memory} == {0, 64, 128, 192}
    assert log.node_list is not None and len(log.node_list) == 32
    assert log.node_list[0] == "pool0-0001" and log.node_list[-1] == "pool0-0032"
    assert log.job_id == "2796012"
    assert log.args["hidden_size"] == "7168"
    assert log.args["moe_hybridep_num_expert_output_buffers"] == "0"
    assert log.capture_iteration == 2
    assert not log.partial_last_line and log.warnings == []


def test_steady_iterations_seed_pair_match_the_seed_figures() -> None:
    for name, mean, median in (("slurm-2796012.out", 1124.86, 1128.10), ("slurm-2796654.out", 1112.34, 1115.00)):
        steady, dropped = steady_iterations(parse_log(LOGS / name), warmup=3)
        values = sorted(r.tflops for r in steady)
        assert dropped == {"warmup": 3, "before_capture": 0, "skipped_or_nan": 0}
        assert len(values) == 27
        assert round(sum(values) / len(values), 2) == mean
        assert values[13] == pytest.approx(median)


def test_parse_interleaved_ranks_merges_duplicates_and_keeps_only_complete_reports() -> None:
    log = parse_log(LOGS / "interleaved-partial.log")
    assert [r.iteration for r in log.iterations] == list(range(1, 13))  # 13 is cut mid-number
    assert log.partial_last_line
    # rank 0's report was cut by rank 4's on the same line: rank 4 and rank 2 remain, with their own values
    assert [(m.rank, m.max_reserved_mib) for m in log.memory] == [(4, 230.0), (2, 225.0)]
    assert log.peak("max_allocated_mib") == 130.0
    assert log.peak("device_used_mib") is None


def test_parse_nan_inf_and_skipped_iterations_are_kept_but_not_steady() -> None:
    log = parse_log(LOGS / "interleaved-partial.log")
    by_it = {r.iteration: r for r in log.iterations}
    assert math.isnan(by_it[6].loss) and by_it[6].nan == 1
    assert by_it[7].skipped == 1 and by_it[7].loss is None
    assert by_it[8].loss == math.inf
    steady, dropped = steady_iterations(log, warmup=3)
    assert [r.iteration for r in steady] == [4, 5, 9, 10, 11, 12]
    assert dropped == {"warmup": 3, "before_capture": 0, "skipped_or_nan": 3}


def test_steady_iterations_skip_through_cuda_graph_capture() -> None:
    log = parse_log(LOGS / "cuda-graph-capture.log")
    assert log.capture_iteration == 5
    steady, dropped = steady_iterations(log, warmup=3)
    assert [r.iteration for r in steady] == [6, 7, 8, 9, 10]
    assert dropped["before_capture"] == 2
    assert all(r.tflops is None for r in steady)  # logged without --log-throughput
    assert steady[0].elapsed_ms == 401.2


def test_steady_iterations_warmup_zero_keeps_everything_clean() -> None:
    log = parse_log(LOGS / "interleaved-partial.log")
    steady, _ = steady_iterations(log, warmup=0)
    assert len(steady) == 9


def test_steady_iterations_negative_warmup_raises() -> None:
    with pytest.raises(LogFormatError, match="--warmup"):
        steady_iterations(parse_log(LOGS / "cuda-graph-capture.log"), warmup=-1)


@pytest.mark.parametrize("name", ["empty.log", "no-iterations.log"])
def test_parse_log_without_iterations_raises(name: str) -> None:
    with pytest.raises(LogFormatError, match=name):
        parse_log(LOGS / name)


def test_parse_log_missing_file_raises() -> None:
    with pytest.raises(LogFormatError, match="no such log file"):
        parse_log(LOGS / "does-not-exist.log")


def test_parse_memory_report_on_partial_last_line_is_ignored() -> None:
    text = (
        " iteration        1/      10 | elapsed time per iteration (ms): 10.0 |\n"
        "[Rank 0] (after 1 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00 | "
        "reserved: 3.00 | max reserved: 4"
    )
    log = parse_log_text(text, source="t")
    assert log.memory == []
    assert any("unterminated" in w for w in log.warnings)


def test_parse_old_cached_memory_format_reads_reserved() -> None:
    text = (
        " iteration        1/      10 | elapsed time per iteration (ms): 10.0 |\n"
        "[Rank 3] after 1 iterations memory (MB) | allocated: 1.5 | max allocated: 2.5 | "
        "cached: 3.5 | max cached: 4.5\n"
    )
    (mem,) = parse_log_text(text).memory
    assert (mem.rank, mem.after_iterations, mem.max_reserved_mib) == (3, 1, 4.5)


def test_parse_conflicting_duplicate_iterations_warns_and_keeps_last() -> None:
    text = (
        " iteration        1/      10 | elapsed time per iteration (ms): 10.0 |\n"
        " iteration        1/      10 | elapsed time per iteration (ms): 12.0 |\n"
    )
    log = parse_log_text(text)
    assert [r.elapsed_ms for r in log.iterations] == [12.0]
    assert any("more than once" in w for w in log.warnings)


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("r[1-2]-n[08-09]", ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]),
        ("pool0-[0009-0011]", ["pool0-0009", "pool0-0010", "pool0-0011"]),
    ],
)
def test_expand_hostlist_cases(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr", ["node[01-03", "node]1[", "node[5-2]", "node[a-b]"])
def test_expand_hostlist_malformed_raises(expr: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(expr)


_FULL = (LOGS / "slurm-2796654.out").read_text()
_FULL_LOG = parse_log_text(_FULL)
_FULL_VALUES = {(r.iteration, r.elapsed_ms, r.tflops) for r in _FULL_LOG.iterations}
_FULL_MEMORY = {(m.rank, m.after_iterations, m.max_reserved_mib) for m in _FULL_LOG.memory}


@given(cut=st.integers(min_value=0, max_value=len(_FULL)))
def test_parse_truncated_log_never_reads_a_cut_number(cut: int) -> None:
    try:
        log = parse_log_text(_FULL[:cut])
    except LogFormatError:
        return
    for r in log.iterations:
        full = next(v for v in _FULL_VALUES if v[0] == r.iteration)
        assert r.elapsed_ms in (None, full[1]) and r.tflops in (None, full[2])
    assert {(m.rank, m.after_iterations, m.max_reserved_mib) for m in log.memory} <= _FULL_MEMORY


def test_real_h200_megatron_lm_logs_parse_with_identical_losses() -> None:
    """The real pretrain_gpt.py runs (docs/recordings/megatron-h200): rings train exactly like the control."""
    from pathlib import Path

    from bufreuse.analysis.runs.megatron_log import parse_log

    folder = Path(__file__).resolve().parent.parent / "docs" / "recordings" / "megatron-h200" / "h200-2026-12-02"
    control, rings = (parse_log(folder / f"{n}.log") for n in ("control", "rings"))
    assert [it.iteration for it in control.iterations] == [it.iteration for it in rings.iterations]
    assert len(control.iterations) == 9  # iteration 1, then every 2nd (--log-interval 2)
    assert [it.loss for it in control.iterations] == [it.loss for it in rings.iterations]


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=st.sampled_from(list(" \t:ab1.\u00a0\x0b\x1c\u2028/-e")), max_size=14))
def test_a_field_reads_as_the_field_regex_reads_it(piece: str) -> None:
    """The hot loop's str-method split of ``label: value`` equals the regex it replaced (non-blank labels)."""
    import re

    from bufreuse.analysis.runs.megatron_log import _field

    m = re.match(r"^\s*([^:|]+?)\s*:\s*(.+?)\s*$", piece)
    want = (m.group(1), m.group(2)) if m and m.group(1).strip() else None
    assert _field(piece) == want


_LABELS = ["elapsed time per iteration (ms)", "elapsed time per iteration (s)", "TFLOPs", "TFLOPS_per_GPU",
           "lm loss", "number of skipped iterations", "number of nan iterations", "samples per second",
           "consumed samples", "learning rate", "memory(GiB)", "peak_mem", " lm loss", "lm loss ", "lm", ""]
_VALUES = ["6123.4", " 2.0 ", "nan", "inf", "-1", "2.5", "13090.4/13102.9", "", "  ", "x:y", "5,", "1e3", "\u00a0"]


@settings(max_examples=3000, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(_LABELS), st.sampled_from([":", ": ", " :", ""]), st.sampled_from(_VALUES)),
             max_size=8),
    st.sampled_from(["", " ", "|", " | junk"]),
    st.booleans(),
)  # fmt: skip
def test_the_fast_field_pass_reads_a_line_as_the_piece_by_piece_pass(pieces, tail, nemo) -> None:
    from bufreuse.analysis.runs.megatron_log import _iterations, _Tally

    head = "Training epoch 0, iteration 3/9 |" if nemo else " iteration        3/       9 |"
    line = head + "|".join(f"{lab}{sep}{val}" for lab, sep, val in pieces) + ("|" if pieces else "") + tail
    got = []
    for fast in (True, False):
        pairs, odd, unknown = [0], _Tally(), {}
        recs = _iterations(line, 7, pairs, odd, unknown_memory=unknown, fast=fast)
        got.append((recs, pairs, odd.count, odd.first, unknown))
    assert repr(got[0]) == repr(got[1])  # repr: NaN values compare equal


@settings(max_examples=2000, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("iteration 12/|_aé\u00a0x")), max_size=40))
def test_iteration_matches_by_find_equal_the_grammar_regex(line: str) -> None:
    from bufreuse.analysis.runs.grammars import grammar
    from bufreuse.analysis.runs.megatron_log import _iteration_matches

    want = [(m.start(), m.end(), m.groups()) for m in grammar("iteration").pattern.finditer(line)]
    assert [(m.start(), m.end(), m.groups()) for m in _iteration_matches(line)] == want


_PIECE = st.tuples(st.sampled_from([*_LABELS, "iteration 4/ 9", "grad norm", "learning rate"]),
                   st.sampled_from([":", ": ", " :", ""]), st.sampled_from([*_VALUES, "iteration 5/ 9 "]))  # fmt: skip
_PREFIX = st.sampled_from(["", " ", "[2026-12-03 12:00:00] ", "x", "_", "[default3]:", "iteration 2/ 9 | lm loss: 1 |"])


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.tuples(_PREFIX, st.lists(_PIECE, max_size=6), st.sampled_from(["", " ", " junk"])), max_size=6),
       st.integers(0, 5))  # fmt: skip
def test_learned_line_shapes_read_a_log_as_the_general_path(lines, base) -> None:
    """Logs of lines that share a shape with variations (values, labels, prefixes): read with shapes learned and
    with learning off, the tables, warnings and figures are equal."""
    import bufreuse.analysis.runs.megatron_log as ml

    template = " iteration {i:8d}/     100 | elapsed time per iteration (ms): {t} | lm loss: 7.1E+00 |"
    text = "".join(template.format(i=i, t=100 + i) + "\n" for i in range(1, base + 2))
    # lines of the learned shape that hide a second record in a value, or glue a word before "iteration"
    text += template.format(i=50, t=150).replace("7.1E+00", "iteration 60/ 100 ") + "\n"
    text += "x" + template.format(i=51, t=151).lstrip() + "\n"
    for n, (prefix, pieces, tail) in enumerate(lines, start=base + 2):
        body = "|".join(f"{lab}{sep}{val}" for lab, sep, val in pieces)
        text += f"{prefix}iteration {n:8d}/     100 |{body}{'|' if pieces else ''}{tail}\n"
        text += template.format(i=n + 100, t=200 + n) + "\n"
    read = []
    for learn in (ml._MAX_SHAPES_LEARNED, 0):
        old, ml._MAX_SHAPES_LEARNED = ml._MAX_SHAPES_LEARNED, learn
        try:
            log = ml.parse_log_text(text)
        finally:
            ml._MAX_SHAPES_LEARNED = old
        read.append(repr((list(log.iterations), log.warnings, log.memory)))
    assert read[0] == read[1]
