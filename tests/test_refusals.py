"""Option conflicts, budgets and validation before work: each refused with one ``error:`` line, exit 2, nothing written.

Every refusal has a positive control: the same command with the conflict removed gets past the check
(another exit code or another message), so a test cannot pass because the command fails for an
unrelated reason.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_bounded_inputs import ROOT, refused, run_cli
from test_compare import make_metrics, make_sweep

SNAP = ROOT / "tests/data/snapshots/empty_cache.pickle"

_PLAN_YAML = """\
num_layers: 8
pipeline_model_parallel_size: 2
hidden_size: 1024
num_moe_experts: 8
moe_router_topk: 2
moe_token_dispatcher_type: flex
moe_flex_dispatcher_backend: hybridep
moe_hybridep_reuse_dispatch_output_buffers: true
seq_length: 128
micro_batch_size: 2
bf16: true
"""


@pytest.fixture
def plan_yaml(tmp_path: Path) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(_PLAN_YAML)
    return p


@pytest.fixture
def work(tmp_path: Path) -> Path:
    w = tmp_path / "cwd"
    w.mkdir()
    return w


def _ran_past_validation(args: list[str], cwd: Path) -> str:
    """The control: the command ran (exit 0 or 1, a check that did not pass), no refusal."""
    out = run_cli(args, cwd)
    assert out.returncode in (0, 1), (args, out.stdout[-400:], out.stderr[-800:])
    return out.stdout + out.stderr


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--num-microbatches", "1000000000000"], "max_schedule_steps budget of 65,536"),
        (["--num-microbatches", "40000", "--limit-pp-vpp"], "max_schedule_steps"),
        (["--num-microbatches", "8", "--global-batch-size", "64", "--data-parallel-size", "2"], "conflicts"),
        (["--global-batch-size", "65", "--data-parallel-size", "2"], "not a multiple of micro batch 2"),
    ],
)
def test_plan_refuses_schedules_over_budget_and_bad_batch_arithmetic(
    plan_yaml: Path, work: Path, extra: list[str], match: str
) -> None:
    if "--limit-pp-vpp" in extra:  # 40,000 microbatches x VPP 2 > 65,536: the product is what is bounded
        plan_yaml.write_text(_PLAN_YAML + "virtual_pipeline_model_parallel_size: 2\n")
        extra = [e for e in extra if e != "--limit-pp-vpp"]
    refused(["plan", str(plan_yaml), *extra], work, match=match)


def test_plan_controls_run(plan_yaml: Path, work: Path) -> None:
    _ran_past_validation(["plan", str(plan_yaml), "--num-microbatches", "8"], work)
    _ran_past_validation(["plan", str(plan_yaml), "--global-batch-size", "64", "--data-parallel-size", "2"], work)
    text = _ran_past_validation(
        ["--limit", "max-schedule-steps=100000", "plan", str(plan_yaml), "--num-microbatches", "70000", "--json"], work
    )
    assert json.loads(text.splitlines()[0])["schedule"]["microbatches"] == 70000


def test_plan_budget_on_pipeline_stages(plan_yaml: Path, work: Path) -> None:
    plan_yaml.write_text(_PLAN_YAML.replace("pipeline_model_parallel_size: 2", "pipeline_model_parallel_size: 4096"))
    refused(["plan", str(plan_yaml), "--num-microbatches", "8"], work, match="max_pipeline_stages budget of 512")


def test_sweep_plan_hint_names_the_file_fields(plan_yaml: Path, work: Path) -> None:
    line = refused(["sweep", "--slots", "0,plan", "--plan-config", str(plan_yaml), "--workload", "cpu-smoke"], work)
    assert "set num_microbatches" in line and "--num-microbatches" not in line


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--slots", "99999999999"], "max_ring_slots budget of 1,024"),
        (["--slots", "2,4", "--measured", f"6={SNAP}"], "6 slot(s) is not predicted (--slots 2,4)"),
        (["--slots", "2", "--measured", f"2={SNAP}", "--measured", f"2={SNAP}"], "given twice"),
    ],
)
def test_what_if_refusals(work: Path, args: list[str], match: str) -> None:
    refused(["what-if", str(SNAP), *args], work, match=match)


def test_what_if_control_with_a_measured_count_that_was_asked_for(work: Path) -> None:
    out = run_cli(["what-if", str(SNAP), "--slots", "2,4", "--measured", f"4={SNAP}"], work)
    assert "not predicted" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--status", "d", "--cancel", "d"], "--status and --cancel: give one"),
        (["--slurm-partition", "gpu"], "--slurm-partition: apply to --launcher slurm only"),
        (["--no-wait", "--slurm-nodes", "2"], "--slurm-nodes, --no-wait: apply to --launcher slurm only"),
        (["--megatron-args", "--foo 1"], "--megatron-args applies to --workload megatron only"),
        (["--root", "a/b/c"], "folder a/b does not exist; create it or pass --mkdir"),
        (["--workload", "proxy", "--tokens", "100", "--world-size", "1"], "--tokens 100 must be a multiple of"),
        (["--workload", "proxy", "--cuda-graph", "--warmup-steps", "0", "--world-size", "1"], "--cuda-graph needs"),
        (["--slots", "0,plan", "--num-microbatches", "10000000"], "max_schedule_steps budget of 65,536"),
    ],
)
def test_sweep_refusals_before_any_folder_or_process(work: Path, args: list[str], match: str) -> None:
    base = [] if "--workload" in args else ["--workload", "cpu-smoke"]
    refused(["sweep", "--slots", "0,2", *base, *args], work, match=match)


@pytest.mark.parametrize("value", ["file", "a/b"])
def test_sweeps_env_var_is_checked_like_root(work: Path, value: str) -> None:
    (work / "file").write_text("x")
    match = "is a file" if value == "file" else "folder a does not exist"
    line = refused(["sweep", "--slots", "0", "--workload", "cpu-smoke"], work, env={"BUFREUSE_SWEEPS": value})
    assert line.startswith("error: BUFREUSE_SWEEPS ") and match in line
    line2 = refused(["sweep", "--slots", "0", "--workload", "cpu-smoke", "--root", value], work)
    assert line2.replace("--root", "BUFREUSE_SWEEPS") == line  # the same words as the option it stands for


def test_sweep_controls_run_and_mkdir_creates_the_parents(work: Path) -> None:
    out = run_cli(["sweep", "--slots", "0,2", "--workload", "cpu-smoke", "--root", "a/b/c", "--mkdir"], work)
    assert out.returncode == 0, out.stderr[-800:]
    assert (work / "a/b/c").is_dir() and list((work / "a/b/c").iterdir())
    out = run_cli(["sweep", "--slots", "0", "--workload", "cpu-smoke"], work, env={"BUFREUSE_SWEEPS": "sw"})
    assert out.returncode == 0 and (work / "sw").is_dir()
    out = run_cli(["sweep", "--status", str(next((work / "sw").iterdir()))], work)
    assert out.returncode == 0, out.stderr[-500:]


def test_duplicate_yaml_key_is_refused(tmp_path: Path, work: Path) -> None:
    p = tmp_path / "dup.yaml"
    p.write_text(_PLAN_YAML + "hidden_size: 2048\n")
    refused(["check-config", str(p)], work, match="duplicate key 'hidden_size' (first at line 3)")
    p.write_text(_PLAN_YAML)  # control: the same file without the repeat
    _ran_past_validation(["check-config", str(p)], work)


def test_unknown_args_file_flags_are_reported(tmp_path: Path, work: Path) -> None:
    p = tmp_path / "args.txt"
    p.write_text("--num-layers 8\n--hidden-size 1024\n--moe-hybridep-reuse-dispatch-output-buffer\n--not-a-flag 3\n")
    text = _ran_past_validation(["check-config", str(p)], work)
    warning = next(ln for ln in text.splitlines() if ln.startswith("warning:"))
    assert "--moe-hybridep-reuse-dispatch-output-buffer, --not-a-flag:" in warning
    assert "did you mean --moe-hybridep-reuse-dispatch-output-buffers?" in warning
    p.write_text("--num-layers 8\n--hidden-size 1024\n--moe-hybridep-reuse-dispatch-output-buffers\n")  # control
    assert "warning:" not in _ran_past_validation(["check-config", str(p)], work)


def test_unknown_flag_and_a_bad_value_end_in_one_error_line(tmp_path: Path, work: Path) -> None:
    """A bad file is refused in its one error line: the unknown-flag warning is not printed before it."""
    p = tmp_path / "args.txt"
    p.write_text("--num-layers 8\n--num-experts x\n--not-a-flag 3\n")
    refused(["check-config", str(p)], work, match="num_experts is a str")
    p.write_text("--num-layers 8\n--num-experts 8\n--not-a-flag 3\n")  # control: the value fixed, the warning stays
    assert "warning:" in _ran_past_validation(["check-config", str(p)], work)


@pytest.mark.parametrize("bad", [-5 * 2**20, math.nan, 1.5])
def test_metrics_with_a_bad_size_is_refused_alone(tmp_path: Path, work: Path, bad: float) -> None:
    m = make_metrics("slots4")
    m["max_reserved_bytes"] = bad
    make_sweep(tmp_path / "root", metrics={"slots4": m})
    out = run_cli(["compare", "control", "feature", "--root", str(tmp_path / "root"), "--json"], work)
    data = json.loads(out.stdout)
    by_label = {c["label"]: c for c in data["comparisons"]}
    assert by_label["slots4"]["status"] == "failed"
    assert "refused: max_reserved_bytes is" in json.dumps(by_label["slots4"])
    assert by_label["slots2"]["status"] == "ok" and by_label["slots10"]["status"] == "ok"  # the others reported


def test_demo_with_a_broken_manifest_writes_nothing(tmp_path: Path, work: Path) -> None:
    import shutil

    ex = tmp_path / "ex"
    shutil.copytree(ROOT / "examples", ex)
    manifests = sorted(ex.rglob("manifest.json"))
    manifests[-1].write_text('{"configs": ')
    refused(["demo", "--examples", str(ex), "--out", "out"], work, match="unreadable manifest")
    manifests[-1].write_text(json.dumps({"configs": ["slots0", "../escape"]}))
    refused(["demo", "--examples", str(ex), "--out", "out"], work)


def test_cpu_smoke_failure_is_under_the_one_error_root() -> None:
    from bufreuse.bench.cpu_smoke import CpuSmokeFailure
    from bufreuse.errors import BufreuseError, JobFailedError, exit_code_for

    assert issubclass(CpuSmokeFailure, JobFailedError) and issubclass(CpuSmokeFailure, BufreuseError)
    assert not issubclass(CpuSmokeFailure, RuntimeError)
    assert exit_code_for(CpuSmokeFailure("x")) == 1


def test_every_project_exception_has_the_one_root() -> None:
    """Every exception class defined in bufreuse derives from BufreuseError (a second root is a bug)."""
    import importlib
    import inspect
    import pkgutil

    import bufreuse
    from bufreuse.errors import BufreuseError

    strays = []
    for mod in pkgutil.walk_packages(bufreuse.__path__, "bufreuse."):
        if any(p in mod.name for p in ("integrations", "pool", "bench.proxy", "bench.runner", "bench.measure")):
            continue  # import torch / megatron; their errors are covered by tests/test_pool.py and the adapters
        module = importlib.import_module(mod.name)
        for name, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == mod.name and not issubclass(obj, BufreuseError):
                strays.append(f"{mod.name}.{name}")
    assert not strays, strays


def test_snapshot_frame_fields_of_the_wrong_type_are_no_internal_error(tmp_path: Path, work: Path) -> None:
    import gzip
    import pickle

    from bufreuse.analysis.snapshot.unpickle import loads_restricted

    src = sorted((ROOT / "examples/sweep-h200").glob("*/snapshot.pickle.gz"))[0]
    snap = loads_restricted(gzip.decompress(src.read_bytes()))
    for trace in snap["device_traces"]:
        for e in trace:
            for f in e.get("frames") or []:
                f["filename"] = ["a", "b"]
    p = tmp_path / "frames.pickle"
    p.write_bytes(pickle.dumps(snap))
    for command in (["snapshot-report", str(p)], ["what-if", str(p)]):
        out = run_cli(command, work)
        assert "internal error" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-500:]
        assert out.returncode in (0, 2)


def test_site_skip_error_names_the_option(work: Path) -> None:
    refused(["snapshot-report", str(SNAP), "--site-skip", "("], work, match="--site-skip '(': not a regular expression")


def test_refused_command_with_mkdir_leaves_no_folder(tmp_path: Path, work: Path) -> None:
    """--mkdir checks that the folders can be made; they appear only with the result (control: a good file)."""
    bad = tmp_path / "empty.pickle"
    bad.write_bytes(b"")
    refused(["snapshot-report", str(bad), "--plot", "a/b/x.png", "--mkdir"], work, match="empty file")
    good = run_cli(["snapshot-report", str(ROOT / "tests/data/snapshots/record_stream.pickle.gz"),
                    "--plot", "a/b/x.png", "--mkdir"], work)  # fmt: skip
    assert good.returncode == 0 and (work / "a/b/x.png").is_file(), good.stderr[-500:]
