"""A training log costs a fixed few bytes per iteration line, and compare's numbers are those it gave before.

The parser keeps iteration lines as typed columns (:mod:`bufreuse.analysis.runs.itertable`), caps
everything else it keeps, and refuses a log past ``max_log_iterations``; statistics never repeat a
value per iteration and draw bootstrap resamples in bounded chunks. Expected figures here come from
the files themselves (a regex over the lines, ``np.percentile`` of the repeated per-iteration sample,
the bootstrap drawn all at once), never from the code under test.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from test_bounded_inputs import refused

from bufreuse.analysis.runs import itertable, megatron_log, stats, textfile
from bufreuse.analysis.runs.grammars import clean_text
from bufreuse.analysis.runs.itertable import ROW_BYTES, IterationRecord
from bufreuse.analysis.runs.megatron_log import parse_log, parse_log_text, steady_iterations
from bufreuse.analysis.runs.resolve import resolve_runs
from bufreuse.analysis.runs.stats import bootstrap_diff, run_stats, summarise
from bufreuse.analysis.runs.textfile import LogBudgetError, LogLines
from bufreuse.limits import override

ROOT = Path(__file__).resolve().parents[1]
RECORDED = [
    ROOT / "tests/data/logs/slurm-2796012.out",
    ROOT / "tests/data/logs/slurm-2796654.out",
    *sorted((ROOT / "docs/recordings/megatron-h200").glob("*/*.log")),
]
_COLUMNS = 3 + 4 + 2 + 1  # iteration, train_iters, line; four optional figures; two counts; window


def short_lines(n: int, start: int = 1) -> str:
    """``n`` of the shortest lines the grammars read as iterations."""
    return "".join(f"iteration {i}/1|TFLOPs:{200 + i % 7}|\n" for i in range(start, start + n))


# -- compact storage ------------------------------------------------------------------------------------------


def _retained_and_peak(fn) -> tuple[object, int, int]:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, now - before, peak - before


def test_row_width_is_eight_bytes_a_column_plus_two_flag_bytes() -> None:
    assert ROW_BYTES == 8 * _COLUMNS + 2


def test_parsed_log_keeps_a_few_bytes_per_iteration_line_not_an_object() -> None:
    """40,000 iteration lines: the parsed log keeps under 1.25 x the row width per line and parsing peaks
    under 1.35 x (the windows need a column or two more for a moment; one column of Python ints, 36 bytes a
    line, would pass it); one IterationRecord object each would not fit."""
    n = 40_000
    text = short_lines(n)
    log, kept, peak = _retained_and_peak(lambda: parse_log_text(text))
    assert len(log.iterations) == n
    bound = 1.25 * ROW_BYTES
    assert kept / n < bound, f"{kept / n:.0f} bytes kept per iteration line"
    assert peak / n < 1.35 * ROW_BYTES, f"{peak / n:.0f} bytes per line at the peak"
    # positive control: the per-line objects the parser used to keep (one record each) fail the same bound
    records, objects, _ = _retained_and_peak(lambda: list(log.iterations))
    assert len(records) == n and objects / n > 2 * bound, f"{objects / n:.0f} bytes per record object"


def test_a_log_file_is_parsed_as_it_is_read_not_held_whole(tmp_path: Path) -> None:
    """A 20 MB log (2,000 lines of 10,000 characters) peaks under 8 MiB: a few 1 MiB pieces, never the text."""
    p = tmp_path / "run.log"
    p.write_text(short_lines(10) + ("y" * 9_999 + "\n") * 2_000)
    log, _, peak = _retained_and_peak(lambda: parse_log(p))
    assert len(log.iterations) == 10
    assert peak < 8 << 20, f"{peak:,} bytes at the peak"
    # positive control: holding the text and its lines, as a whole-text parser does, is over 20 MB
    _, held, _ = _retained_and_peak(lambda: (lambda t: (t, t.splitlines()))(p.read_text()))
    assert held > 20 << 20


def test_memory_fields_on_iteration_lines_add_one_column_each() -> None:
    lines = "".join(
        f" iteration {i}/ 9 | memory(GiB): {i % 5} | elapsed time per iteration (ms): 5 |\n" for i in range(1, 9)
    )
    log = parse_log_text(lines)
    assert [r.memory_mib for r in log.iterations][:3] == [{"max_reserved_mib": 1024.0 * k} for k in (1, 2, 3)]
    assert log.peak("max_reserved_mib") == 4 * 1024.0 and log.peak("device_used_mib") is None


# -- the iteration budget -------------------------------------------------------------------------------------


def test_iteration_budget_refuses_the_line_past_it_and_stops_reading(tmp_path: Path) -> None:
    p = tmp_path / "run.log"
    # 2.8 MB of iteration lines, then a line over the line budget: the iteration budget, hit in the first
    # 1 MiB piece, refuses the log before the reader gets there
    p.write_text(short_lines(100_000) + "x" * 2000 + "\n")
    with override(max_log_iterations=30_000, max_log_line_bytes=1000), pytest.raises(LogBudgetError) as e:
        parse_log(p)
    assert e.value.budget == "max_log_iterations" and "--limit max-log-iterations=N" in str(e.value)
    with override(max_log_iterations=100_000, max_log_line_bytes=1000), pytest.raises(LogBudgetError) as e:
        parse_log(p)  # control: within the iteration budget, reading goes on to the long line
    assert e.value.budget == "max_log_line_bytes"
    p.write_text(short_lines(100))  # positive control: exactly the budget is read
    with override(max_log_iterations=100):
        assert len(parse_log(p).iterations) == 100


def test_iteration_budget_counts_every_copy_of_a_line() -> None:
    text = short_lines(6) * 2  # six iterations, each logged twice (two ranks)
    with override(max_log_iterations=11), pytest.raises(LogBudgetError, match="max_log_iterations"):
        parse_log_text(text)
    with override(max_log_iterations=12):
        assert [r.iteration for r in parse_log_text(text).iterations] == list(range(1, 7))


def test_compare_refuses_a_log_over_the_iteration_budget_in_one_line(tmp_path: Path) -> None:
    p = tmp_path / "run.log"
    p.write_text(short_lines(40))
    work = tmp_path / "cwd"
    work.mkdir()
    line = refused(["--limit", "max-log-iterations=39", "compare", str(p), str(p)], work)
    assert "more than 39, over the max_log_iterations budget of 39" in line and "--limit max-log-iterations=N" in line
    # a run folder holding it is refused too, not passed over for "no log file with iteration lines"
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "run.log").write_text(short_lines(40))
    refused(["--limit", "max-log-iterations=39", "compare", str(tmp_path / "folder"), str(p)], work,
            match="max_log_iterations")  # fmt: skip
    from test_bounded_inputs import run_cli

    ok = run_cli(["--limit", "max-log-iterations=40", "compare", str(p), str(p)], work)  # positive control
    assert ok.returncode == 0, ok.stderr


# -- other things a log repeats: capped, said so --------------------------------------------------------------


_MEM = (
    "[Rank {r}] (after 2 iterations) memory (MB) | allocated: 1.0 | max allocated: {a} | reserved: 3.0 |"
    " max reserved: 4.0\n"
)


def test_memory_reports_past_the_cap_raise_the_peak_and_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    text = short_lines(3) + "".join(_MEM.format(r=r, a=10 + r) for r in range(8)) + _MEM.format(r=99, a=500)
    monkeypatch.setattr(megatron_log, "MAX_MEMORY_RECORDS", 4)
    log = parse_log_text(text)
    assert [m.rank for m in log.memory] == [0, 1, 2, 3]
    assert log.peak("max_allocated_mib") == 500.0  # from a report that was not kept
    (w,) = [w for w in log.warnings if "memory reports past" in w]
    assert "(and 4 more such line(s))" in w  # five reports past the cap: the first named, four counted
    monkeypatch.setattr(megatron_log, "MAX_MEMORY_RECORDS", 100)  # positive control: all kept, no warning
    log = parse_log_text(text)
    assert len(log.memory) == 9 and not any("memory reports past" in w for w in log.warnings)


def test_arguments_past_the_cap_are_dropped_with_a_count(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "".join(f"  arg_{i} .......... {i}\n" for i in range(12)) + short_lines(3)
    monkeypatch.setattr(megatron_log, "MAX_ARGS", 10)
    log = parse_log_text(text)
    assert list(log.args) == [f"arg_{i}" for i in range(10)]
    assert any(w.startswith("2 argument line(s) past the first 10 arguments") for w in log.warnings)
    monkeypatch.setattr(megatron_log, "MAX_ARGS", 100)
    assert len(parse_log_text(text).args) == 12


def test_a_warning_per_line_is_one_warning_with_a_count() -> None:
    cancel = "slurmstepd: error: *** JOB 7 ON n1 CANCELLED AT 2026-01-02T03:04:05 DUE TO TIME LIMIT ***\n"
    log = parse_log_text(short_lines(3) + cancel * 3)
    (w,) = [w for w in log.warnings if "cancelled" in w]
    assert w.startswith("line 4: ") and w.endswith("(and 2 more such line(s))")
    (once,) = [w for w in parse_log_text(short_lines(3) + cancel).warnings if "cancelled" in w]
    assert "more such" not in once


def test_unread_lines_are_described_without_being_kept(tmp_path: Path) -> None:
    p = tmp_path / "run.log"
    p.write_text("first line\n" + "x | y\n" * 200_000)
    with pytest.raises(megatron_log.LogFormatError, match=r"found 200,?001 other non-empty line\(s\).*'first line'"):
        parse_log(p)


# -- the same lines as the whole text gave -------------------------------------------------------------------


_PIECES = ["a", "iteration 3/9|TFLOPs:1|", "\x1b[0m", "\x1b[1m", "", "b c"]
_ENDS = ["\n", "\r\n", "\r", "\x1b[0m\n", "\r\x1b[0m\n", "\r\r\x1b[0m\n", "\r\r\n", "\x0c", "\u2028", "\x85", ""]


def test_lines_read_one_by_one_are_those_of_the_cleaned_whole_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``clean_text(text).splitlines()`` is the definition; files are read in pieces of 1 to 5 bytes."""
    rng = random.Random(7)
    p = tmp_path / "run.log"
    for _ in range(400):
        text = "".join(rng.choice(_PIECES) + rng.choice(_ENDS) for _ in range(rng.randint(1, 12)))
        state: dict[str, object] = {}
        got = [line for _, line, _ in megatron_log._clean_lines(megatron_log._split(text), state)]
        assert got == clean_text(text).splitlines(), repr(text)
        assert state["partial"] == (not clean_text(text).endswith(("\n", "\r"))), repr(text)
        raw = text.replace("\x1b", "")  # (escape-heavy short texts read as binary)
        p.write_text(raw, encoding="utf-8", newline="")
        monkeypatch.setattr(textfile, "CHUNK_BYTES", rng.randint(1, 5))
        assert list(LogLines(p)) == raw.splitlines(keepends=True), repr(raw)


def _reference_merge(records: list[tuple[int, int, float | None]], capture_before: set[int]):
    """The parser's rules read one record at a time with a dict (what it did before columns)."""
    kept: dict[int, tuple[int, int, float | None]] = {}
    conflicts: set[int] = set()
    capture, pending = None, False
    for k, rec in enumerate(records):
        pending = pending or k in capture_before
        it, fields, value = rec
        old = kept.get(it)
        if old is not None:
            if old[2] != value and old[1] == fields:
                conflicts.add(it)
            if old[1] > fields:
                continue
            del kept[it]
        kept[it] = (k, fields, value)
        if pending:
            capture, pending = it, False
    order = sorted(kept.values())
    return [records[k][0] for k, _, _ in order], [v for _, _, v in order], sorted(conflicts), capture, pending


def test_duplicate_lines_merge_as_read_one_at_a_time() -> None:
    """Random copies, fragments (fewer fields), conflicting values and capture messages: the merged rows,
    conflicts and capture iteration equal a one-record-at-a-time dict replay."""
    rng = random.Random(3)
    for _ in range(300):
        records, capture_before, lines = [], set(), []
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.15:
                lines.append("> capturing cuda graph for 4 layers")
                capture_before.add(len(records))
            it, value = rng.randint(1, 8), rng.choice([400.0, 401.0])
            fragment = rng.random() < 0.3
            lines.append(
                f"iteration {it}/9|elapsed time per iteration (ms):{value}|" + ("" if fragment else "lm loss:1|")
            )
            records.append((it, 1 if fragment else 2, value))
        its, values, conflicts, capture, pending = _reference_merge(records, capture_before)
        log = parse_log_text("\n".join(lines) + "\n")
        assert [r.iteration for r in log.iterations] == its
        assert [r.elapsed_ms for r in log.iterations] == values
        warned = [w for w in log.warnings if "more than once" in w]
        assert warned == ([f"iterations logged more than once with different values (kept the last): "
                           f"{', '.join(map(str, conflicts[:5]))}"] if conflicts else [])  # fmt: skip
        assert log.capture_iteration == capture
        assert any("capture message with no iteration" in w for w in log.warnings) == pending


# -- compare's figures on the recorded logs, derived from the files -------------------------------------------


_ITER = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*? elapsed time per iteration \(ms\): ([\d.]+) \|"
    r" throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|.*? lm loss: ([-+\w.]+) \|"
    r".*? number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+) \|"
)


_CAPTURE = re.compile(r"capture cuda graph|cuda graph capture|capturing cuda graph|cuda graphs? captured", re.I)


def _expected_series(path: Path, warmup: int = 3) -> tuple[list[float], list[float], list[int]]:
    """Steady (step ms, TFLOP/s, window) of a plain Megatron-LM log, straight from its lines: windows from the
    gaps (at most ``log_interval``), the first ``warmup`` iterations and every window up to the one after a
    CUDA-graph capture message (the grammar table's rule) dropped, then skipped / NaN / non-finite loss."""
    text = path.read_text()
    rows, capture, pending = {}, None, False
    for line in text.splitlines():
        if m := _ITER.search(line):
            rows[int(m[1])] = m
            if pending:
                capture, pending = int(m[1]), False
        elif _CAPTURE.search(line) and "validation" not in line.lower():
            pending = True
    ordered = [rows[k] for k in sorted(rows)]
    interval = int(re.search(r"\blog_interval \.+ (\d+)", text)[1]) if "log_interval ." in text else 1
    its = [int(m[1]) for m in ordered]
    windows = [min(its[0], interval)] + [min(b - a, interval) for a, b in itertools.pairwise(its)]
    start = its[0] - windows[0]
    steady = [
        (float(m[2]), float(m[3]), w)
        for m, it, w in zip(ordered, its, windows, strict=True)
        if it - w >= start + warmup
        and (capture is None or it > capture)
        and m[5] == "0"
        and m[6] == "0"
        and math.isfinite(float(m[4]))
    ]
    return [s[0] for s in steady], [s[1] for s in steady], [s[2] for s in steady]


def _old_summary(values: list[float], windows: list[int]) -> dict[str, float]:
    a = np.repeat(np.asarray(values), windows)
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    return {"mean": a.mean(), "median": p50, "p10": p10, "p90": p90, "min": a.min(), "max": a.max()}


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name)
def test_recorded_log_figures_equal_those_read_straight_from_its_lines(path: Path) -> None:
    ms, tflops, windows = _expected_series(path)
    assert ms, "the regex found no steady line"
    (run,) = resolve_runs([str(path)])
    assert (list(run.step_ms), list(run.tflops)) == (ms, tflops)
    # windows of 1 each are kept as no windows at all (RunRecord: "empty: one each")
    one_each = [1] * len(ms)
    assert (list(run.step_windows) or one_each) == (list(run.tflops_windows) or one_each) == windows
    figures = run_stats(run)
    for series, values in (("step_ms", ms), ("tflops", tflops)):
        got, want = figures[series], _old_summary(values, windows)
        assert got["n"] == len(values)
        for key, v in want.items():
            assert got[key] == pytest.approx(v, rel=1e-12, abs=1e-12), (series, key)


def test_logs_with_windows_exist_among_the_recorded_ones() -> None:
    """The weighted path is exercised above: some recorded log averages lines over 2 iterations."""
    assert any(max(_expected_series(p)[2]) > 1 for p in RECORDED)


# -- statistics: the same numbers in bounded memory -----------------------------------------------------------


def test_weighted_summary_equals_the_repeated_sample() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        values = np.round(rng.normal(400, 5, n), int(rng.integers(0, 3))).tolist()  # ties included
        windows = rng.integers(1, 12, n).tolist()
        got, want = summarise(values, windows), _old_summary(values, windows)
        for key, v in want.items():
            assert got[key] == pytest.approx(v, rel=1e-12), (key, values, windows)


def test_weighted_summary_of_huge_windows_needs_no_repeat() -> None:
    """A window of 10^15 iterations (a hostile gap) would be 8 PB repeated; cumulative weights need 3 values."""
    got = summarise([1.0, 2.0, 3.0], [10**15, 1, 1])
    assert (got["median"], got["p90"], got["max"]) == (1.0, 1.0, 3.0)
    assert got["mean"] == pytest.approx(1.0, abs=1e-12)


def _old_bootstrap(base, other, wa, wb, stat, n_boot=2000, seed=0, level=0.95):
    """The bootstrap as it was: every resample drawn at once, each sorted (the library's sort path)."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(base, dtype=float), np.asarray(other, dtype=float)
    wa = np.maximum(np.asarray(wa, dtype=np.int64), 1)
    wb = np.maximum(np.asarray(wb, dtype=np.int64), 1)
    ma = stats._boot_stat(a, wa, rng.integers(0, a.size, size=(n_boot, a.size)), stat)
    mb = stats._boot_stat(b, wb, rng.integers(0, b.size, size=(n_boot, b.size)), stat)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(mb - ma, [tail, 100 - tail])
    return float(low), float(high)


@pytest.mark.parametrize("n", [5, 63, 64, 300])
@pytest.mark.parametrize("stat", ["median", "mean"])
def test_chunked_bootstrap_equals_drawing_everything_at_once(
    n: int, stat: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stats, "_BOOT_CELLS", 7 * n + 3)  # several chunks, the last a partial one
    rng = np.random.default_rng(n)
    a, b = np.round(rng.normal(400, 5, n), 1), np.round(rng.normal(401, 5, n + 2), 1)
    wa, wb = rng.integers(1, 4, n), rng.integers(1, 4, n + 2)
    got = bootstrap_diff(
        a.tolist(), b.tolist(), stat=stat, base_weights=wa.tolist(), other_weights=wb.tolist(), n_boot=201
    )
    assert got == _old_bootstrap(a, b, wa, wb, stat, n_boot=201)


def test_bootstrap_memory_does_not_grow_with_resamples_times_windows() -> None:
    """100,000 windows x 2,000 resamples is 1.6 GB of indices drawn at once; in chunks it is a few MB."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(400, 5, 100_000), rng.normal(401, 5, 100_000)
    _, _, peak = _retained_and_peak(lambda: bootstrap_diff(a, b, n_boot=40))
    assert peak < 48 << 20, f"{peak:,} bytes"
    # positive control: drawing the 40 resamples at once takes 40 x 100,000 x 8 bytes of indices alone
    _, _, all_at_once = _retained_and_peak(lambda: _old_bootstrap(a, b, [1] * a.size, [1] * b.size, "median", 40))
    assert all_at_once > 60 << 20


# -- the sequence API the records had -------------------------------------------------------------------------


def test_table_reads_like_the_record_list_it_replaced() -> None:
    log = parse_log_text(short_lines(5) + "iteration 6/1|TFLOPs:nan|lm loss:nan|\n")
    rows = log.iterations
    assert rows[-1].iteration == rows[5].iteration == 6 and rows[1:3] == [rows[1], rows[2]] and len(list(rows)) == 6
    assert isinstance(rows[0], IterationRecord) and rows[0].tflops == 201.0 and rows[0].loss is None
    assert math.isnan(rows[5].tflops) and math.isnan(rows[5].loss) and not rows[5].clean
    with pytest.raises(IndexError):
        rows[6]
    steady, dropped = steady_iterations(log, warmup=0)
    assert [r.iteration for r in steady] == [1, 2, 3, 4, 5] and dropped["skipped_or_nan"] == 1
    assert steady == list(steady) and steady != [] and parse_log_text(short_lines(1)).iterations != rows
    rows[0].tflops = 0.0  # a copy: the table is unchanged
    assert rows[0].tflops == 201.0
    empty = megatron_log.MegatronLog(source="x")  # a log made by hand reads as one with no lines
    assert len(empty.iterations) == 0 and list(empty.iterations) == [] and empty.peak("max_reserved_mib") is None


def test_iteration_numbers_past_64_bits_are_dropped_and_named() -> None:
    big = 2**63
    log = parse_log_text(short_lines(3) + f"iteration {big}/1|TFLOPs:1|\niteration 4/{big}|TFLOPs:1|\n")
    assert [r.iteration for r in log.iterations] == [1, 2, 3]
    assert any(w.startswith("2 iteration line(s) with an iteration number or train_iters past") for w in log.warnings)
    ok = parse_log_text(short_lines(3) + f"iteration {big - 1}/1|TFLOPs:1|\n")  # positive control: 2**63 - 1 fits
    assert ok.iterations[-1].iteration == big - 1 and ok.iterations[-1].window == 1


def test_column_reads_are_read_only() -> None:
    table = parse_log_text(short_lines(3)).iterations
    with pytest.raises(ValueError):
        table.column("tflops")[0] = 1.0
    assert list(table.column("tflops")) == [201.0, 202.0, 203.0]
    assert itertable.FLOAT_COLUMNS == ("elapsed_ms", "tflops", "loss", "samples_per_s")


def _megatron_lines(n: int) -> str:
    """Megatron-LM iteration lines as a long run prints them: timing, throughput, loss, zero counts."""
    return "".join(
        f" [2026-12-03 12:00:00] iteration {i:>8}/ 9999999 | consumed samples: {i * 512:>12} | elapsed time per "
        f"iteration (ms): {6000 + i % 97:.1f} | throughput per GPU (TFLOP/s/GPU): {1100 + i % 13:.1f} | lm loss: "
        f"2.345678E+00 | number of skipped iterations:   0 | number of nan iterations:   0 |\n"
        for i in range(1, n + 1)
    )


def test_a_long_megatron_log_costs_its_printed_figures_and_no_more(tmp_path: Path) -> None:
    """A row costs BASE_ROW_BYTES plus 8 per figure printed nonzero (timing, throughput, loss): counts that stay
    0, train_iters that never changes and windows that are all one take no column. What compare keeps of the run
    is its two series, 16 bytes a steady window, as views of the parsed columns (no copy, no window column)."""
    from bufreuse.analysis.runs.itertable import BASE_ROW_BYTES

    n = 40_000
    text = _megatron_lines(n)
    log, kept, _ = _retained_and_peak(lambda: parse_log_text(text))
    assert len(log.iterations) == n
    want = BASE_ROW_BYTES + 3 * 8  # 38 bytes; ROW_BYTES (every column) is 90
    assert kept / n < 1.1 * want, f"{kept / n:.1f} bytes kept per iteration line"
    # positive control: the same lines with nonzero skipped counts pay for that column too
    counts = text.replace("iterations:   0 |", "iterations:   1 |")
    counted, more, _ = _retained_and_peak(lambda: parse_log_text(counts))
    assert len(counted.iterations) == n and more / n > kept / n + 12
    path = tmp_path / "run.log"
    path.write_text(text)
    (run,), held, _ = _retained_and_peak(lambda: resolve_runs([str(path)]))
    assert len(run.step_ms) == n - 3 and len(run.step_windows) == 0  # windows of 1: none kept
    assert held / n < 16 * 1.1, f"{held / n:.1f} bytes kept per steady window"
    assert not run.step_ms.flags.writeable and run.step_ms.base is not None  # a view of the parsed column
