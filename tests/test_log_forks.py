"""Logs of NeMo 2 / Lightning, Megatron-Bridge, ms-swift and Primus; elided gaps; SLURM; MoE comparability.

Lines copy the shape of what each tool prints (labels, separators, units); the numbers are made up,
and each expectation is computed here from the numbers written into the fixture.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bufreuse.analysis.render.compare_tables import comparison_text
from bufreuse.analysis.runs.compare import compare_runs
from bufreuse.analysis.runs.megatron_log import parse_log, parse_log_text, steady_iterations
from bufreuse.analysis.runs.resolve import resolve_runs


def _nemo(times: list[float], *, prefix: str = "") -> str:
    lines = ["[NeMo I 2025-08-19 14:27:47 nemo_logging:393] Experiments will be logged at /results"]
    for i, t in enumerate(times):
        lines.append(
            f"{prefix}Training epoch 0, iteration {i}/{len(times) - 1} | lr: 1.961e-07 | global_batch_size: 4 | "
            f"global_step: {i} | reduced_train_loss: {11.0 - i / 10:.3f} | train_step_timing in s: {t}"
            + (f" | consumed_samples: {4 * (i + 1)}" if i % 2 else "")
        )
    return "\n".join(lines) + "\n"


def test_nemo2_lines_read_step_time_in_seconds_and_the_unterminated_last_field() -> None:
    times = [5.276, 2.008, 2.011, 1.998, 2.004, 2.02]
    log = parse_log_text(_nemo(times, prefix="retraining/0 [default0]:"))
    assert [r.iteration for r in log.iterations] == list(range(len(times)))
    # every line counts, including those whose timing is the last field (no closing '|')
    assert [r.elapsed_ms for r in log.iterations] == [t * 1000 for t in times]
    assert log.iterations[2].loss == 10.8
    steady, _ = steady_iterations(log, warmup=2)
    assert statistics.median(r.elapsed_ms for r in steady) == statistics.median(t * 1000 for t in times[2:])


def test_a_cut_last_nemo_line_is_not_read() -> None:
    text = (
        _nemo([2.0, 2.1, 2.2]) + "Training epoch 0, iteration 3/3 | reduced_train_loss: 9.9 | train_step_timing in s: 2"
    )
    log = parse_log_text(text)
    assert [r.iteration for r in log.iterations] == [0, 1, 2]  # positive control: the complete lines are read


def test_megatron_bridge_step_time_line_fills_an_iteration_line_without_timing() -> None:
    text = (
        "Step Time : 2.34s GPU utilization: 452.1MODEL_TFLOP/s/GPU\n"
        " [2025-10-07 10:00:00] iteration        5/     100 | consumed samples:          320 | learning rate: 1.0E-04 |"
        " global batch size:    64 | lm loss: 7.1E+00 | loss scale: 1.0 |\n"
        "Step Time : 2.30s GPU utilization: 460.0MODEL_TFLOP/s/GPU\n"
        " [2025-10-07 10:00:10] iteration       10/     100 | consumed samples:          640 |"
        " elapsed time per iteration (ms): 2291.0 | learning rate: 1.0E-04 | global batch size:    64 |"
        " lm loss: 6.9E+00 |\n"
    )
    log = parse_log_text(text)
    five, ten = log.iterations
    assert (five.elapsed_ms, five.tflops) == (2340.0, 452.1)
    # the line's own elapsed time wins; the Step Time line only adds what the line lacks
    assert (ten.elapsed_ms, ten.tflops) == (2291.0, 460.0)


MEGATRON_LINE = (
    " iteration {i:8d}/     100 | consumed samples: {s:12d} | elapsed time per iteration (ms): {t} |{mem}"
    " learning rate: 1.0E-04 | global batch size:    64 | lm loss: 7.1E+00 | loss scale: 1.0 |"
    " number of skipped iterations:   0 | number of nan iterations:   0 |\n"
)


def test_ms_swift_and_primus_memory_fields_are_read_and_unknown_ones_named() -> None:
    swift = "".join(
        MEGATRON_LINE.format(i=i, s=64 * i, t=1000.0 + i, mem=f" memory(GiB): {40 + i / 4} |") for i in range(1, 5)
    )
    log = parse_log_text(swift)
    assert log.peak("max_reserved_mib") == (40 + 4 / 4) * 1024
    assert not any("not read" in w for w in log.warnings)
    primus = "".join(
        MEGATRON_LINE.format(
            i=i,
            s=64 * i,
            t=13372.8,
            mem=f" hip mem usage/free/total/usage_ratio: {150 + i}.81GB/102.17GB/255.98GB/60.09% |",
        )
        for i in range(1, 4)
    )
    log = parse_log_text(primus)
    assert log.peak("device_used_mib") == 153.81 * 1024
    assert log.iterations[0].elapsed_ms == 13372.8  # the fields after it still read
    other = MEGATRON_LINE.format(i=1, s=64, t=900.0, mem=" mem-alloc-GB: 72.5 | peak_memory_usage: 70833405952 |")
    log = parse_log_text(other)
    assert any("'mem-alloc-GB'" in w and "'peak_memory_usage'" in w for w in log.warnings)
    assert log.peak("max_reserved_mib") is None


def test_elided_gap_weighs_one_log_interval_and_says_so() -> None:
    args = "    log_interval .................................... 1\n"
    times = {1: 100.0, 2: 101.0, 3: 102.0, 4: 103.0, 30: 200.0, 31: 104.0}
    body = "".join(MEGATRON_LINE.format(i=i, s=64 * i, t=t, mem="") for i, t in times.items())
    elided = body.replace(MEGATRON_LINE.format(i=30, s=64 * 30, t=200.0, mem=""),
                          "[...]\n" + MEGATRON_LINE.format(i=30, s=64 * 30, t=200.0, mem=""))  # fmt: skip
    log = parse_log_text(args + elided)
    assert {r.iteration: r.window for r in log.iterations} == dict.fromkeys(times, 1)
    assert any("gap longer than the logging interval" in w and "log_interval is 1" in w for w in log.warnings)
    # without log_interval: the usual gap (1) stands in, and a warning says it was not printed
    log = parse_log_text(elided)
    assert log.iterations[4].window == 1 and any("log_interval is not printed" in w for w in log.warnings)
    # positive control: an interval of 10 with every line present gives windows of 10 and no warning
    regular = "".join(MEGATRON_LINE.format(i=i, s=64 * i, t=100.0, mem="") for i in (10, 20, 30))
    log = parse_log_text("    log_interval .................................... 10\n" + regular)
    assert [r.window for r in log.iterations] == [10, 10, 10]
    assert not any("gap longer" in w for w in log.warnings)


def test_slurm_cancellation_is_flagged_and_job_id_read_from_name_dash_id(tmp_path: Path) -> None:
    body = "".join(MEGATRON_LINE.format(i=i, s=64 * i, t=100.0, mem="") for i in range(1, 4))
    cancel = "slurmstepd: error: *** JOB 4412 ON gpu-017 CANCELLED AT 2025-03-01T12:00:00 DUE TO TIME LIMIT ***\n"
    p = tmp_path / "mixtral-8x7b-4412.out"
    p.write_text(body + cancel)
    log = parse_log(p)
    assert log.job_id == "4412"
    assert any("cancelled at 2025-03-01T12:00:00 due to time limit" in w for w in log.warnings)
    q = tmp_path / "run_991.err"
    q.write_text(body)
    done = parse_log(q)
    assert done.job_id == "991" and not any("cancelled" in w for w in done.warnings)
    r = tmp_path / "run-2.log"  # not a SLURM output name: no job id guessed
    r.write_text(body)
    assert parse_log(r).job_id is None


DS_ARGS = """\
  num_experts ..................................... {experts}
  moe_expert_parallel_size ........................ {ep}
  topk ............................................ {topk}
  micro_batch_size ................................ 4
  log_interval .................................... 10
"""


def _ds_log(tmp_path: Path, name: str, experts: str, ep: str, topk: str, t: float, tail: str = "") -> Path:
    body = "".join(
        f" iteration {i:8d}/ 1000 | consumed samples: {i * 64:10d} | elapsed time per iteration (s): {t + i / 1000} |"
        f" samples per second: 10.0 | TFLOPs: 100.0 |\n"
        for i in range(10, 210, 10)
    )
    p = tmp_path / name
    p.write_text(DS_ARGS.format(experts=experts, ep=ep, topk=topk) + body + tail)
    return p


def test_moe_vs_dense_runs_are_not_like_for_like(tmp_path: Path) -> None:
    dense = _ds_log(tmp_path, "dense.log", "[1]", "-1", "1", 1.0)
    cancel = "slurmstepd: error: *** STEP 77.0 ON n1 CANCELLED AT 2025-03-01T12:00:00 ***\n"
    moe = _ds_log(tmp_path, "moe.log", "[64]", "4", "2", 1.52, tail=cancel)
    result = compare_runs(resolve_runs([str(dense), str(moe)]))
    caveats = result.comparisons[0].comparability
    assert "configurations differ: experts [1] in dense, [64] in moe" in caveats
    assert "configurations differ: EP -1 in dense, 4 in moe" in caveats
    assert "configurations differ: top-k 1 in dense, 2 in moe" in caveats
    text = comparison_text(result)
    assert "not like for like" in text
    assert "moe: line 26: the job was cancelled" in text and "moe: moe:" not in text  # the run's warning, once
    # positive control: two runs with the same MoE settings raise no MoE caveat
    same = _ds_log(tmp_path, "moe2.log", "[64]", "4", "2", 1.5)
    again = compare_runs(resolve_runs([str(moe), str(same)])).comparisons[0].comparability
    assert not any("experts" in c or "EP" in c or "top-k" in c for c in again)


def _nemo_mem(rows: list[tuple[float, str, str]]) -> str:
    """NeMo 2 lines as its ProgressPrinter prints them with ``log_memory_usage``: MegatronStrategy logs
    ``max_memory_reserved`` / ``max_memory_allocated`` (torch's byte counts), printed ``{val:.4}`` or as an
    integer when the window's mean is whole."""
    return "".join(
        f"Training epoch 0, iteration {i}/{len(rows) - 1} | lr: 1.961e-07 | global_batch_size: 4 | global_step: {i} |"
        f" max_memory_reserved: {res} | max_memory_allocated: {alloc} | reduced_train_loss: 10.5 |"
        f" train_step_timing in s: {t}\n"
        for i, (t, res, alloc) in enumerate(rows)
    )


def test_nemo2_memory_fields_are_read_from_bytes_as_mib() -> None:
    rows = [(5.2, "5.926e+10", "4.812e+10"), (2.0, "6.359e+10", "5.214e+10"), (2.1, "63590000000", "52140000000")]
    log = parse_log_text(_nemo_mem(rows))
    assert len(log.iterations) == 3
    assert log.peak("max_reserved_mib") == 6.359e10 / 2**20
    assert log.peak("max_allocated_mib") == 5.214e10 / 2**20
    assert [r.memory_mib["max_reserved_mib"] for r in log.iterations] == [float(x[1]) / 2**20 for x in rows]
    assert not any("not read" in w for w in log.warnings)
    # a byte count with a unit glued on is not a byte count: named, never guessed at
    odd = parse_log_text(_nemo_mem([(2.0, "59.2GB", "48.1GB")]))
    assert odd.peak("max_reserved_mib") is None and any("'max_memory_reserved'" in w for w in odd.warnings)


def test_nemo2_ab_shows_memory_in_mib(tmp_path: Path) -> None:
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text(_nemo_mem([(2.0, "6.359e+10", "5.214e+10")] * 6))
    b.write_text(_nemo_mem([(2.0, "5.500e+10", "5.214e+10")] * 6))
    text = comparison_text(compare_runs(resolve_runs([str(a), str(b)])))
    assert f"{6.359e10 / 2**20:,.0f}" in text and f"{5.5e10 / 2**20:,.0f}" in text, text
