"""``--torch-version`` on ``plan``, ``check-config`` and ``advise``: the EP >= 2 stream rule judges a config by the
training run's torch, not by the torch where the command runs, and every ring it leaves unused says which version
it judged for and where that came from (the option, the installed torch, or >= 2.8 assumed when there is none).

Expected outcomes follow docs/megatron.md's table "Which buffers cross streams at EP >= 2": NCCL before torch 2.8
records its stream on the dispatch output (the dispatch ring is used), from 2.8 it does not (left unused).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_advise import ARGS, EXPERT, _megatron_trace
from test_snapshot_sites import MEGATRON, NATIVE
from typer.testing import CliRunner

from bufreuse import config
from bufreuse.cli.app import app

runner = CliRunner()
RINGS = "--moe-hybridep-reuse-dispatch-output-buffers\n--moe-hybridep-num-expert-output-buffers 2\n"


def _args(tmp_path: Path) -> Path:
    """EP 2 on NCCL, 8 experts (4 local), no EP overlap, both rings switched on."""
    path = tmp_path / "run.args"
    path.write_text(ARGS.format(ep=2) + RINGS)
    return path


def _plan(args: Path, *extra: str, env: dict | None = None) -> dict:
    res = runner.invoke(app, ["plan", str(args), "--num-microbatches", "4", "--json", *extra], env=env)
    assert res.exit_code == 0, res.output
    return {b["buffer"]: b.get("unused") for b in json.loads(res.stdout)["buffers"]}


def _check(args: Path, *extra: str) -> dict:
    res = runner.invoke(app, ["check-config", str(args), "--json", *extra])
    assert res.exit_code == 0, res.output
    return {b: (r["slots"], r["bound_source"]) for b, r in json.loads(res.stdout)["rings"].items()}


def test_plan_judges_by_the_option_and_says_so(tmp_path: Path) -> None:
    args = _args(tmp_path)
    new = _plan(args, "--torch-version", "2.9.0")
    assert new["dispatch"] and new["expert"], new  # 2.9: nothing pending-free, both left unused
    assert all("judged for torch 2.9.0 (--torch-version)" in why for why in new.values()), new
    old = _plan(args, "--torch-version", "2.7.1")
    assert old["dispatch"] is None, old  # positive control: NCCL before 2.8 records its stream, the ring is used
    assert "judged for torch 2.7.1 (--torch-version)" in old["expert"]  # 4 local experts: combine reads a copy
    # a pre-release of 2.8 (a nightly, an NGC build) may predate the change: counted as 2.7, and the reason says so
    nightly = _plan(args, "--torch-version", "2.8.0a0+gitabc123")
    assert nightly["dispatch"] is None, nightly
    assert "2.8.0a0+gitabc123 (--torch-version), a pre-release counted as 2.7" in nightly["expert"], nightly
    # before 2.8 the variable decides it (read where the command runs), and the reason names it
    avoided = _plan(args, "--torch-version", "2.7.1", env={"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"})
    assert "with TORCH_NCCL_AVOID_RECORD_STREAMS set" in avoided["dispatch"], avoided


def test_plan_without_the_option_names_the_installed_torch_or_the_assumption(tmp_path: Path, monkeypatch) -> None:
    args = _args(tmp_path)
    monkeypatch.setattr(config, "_installed_torch", lambda: "2.9.1+cu128")
    installed = _plan(args)
    assert all("judged for torch 2.9.1+cu128 (installed here)" in why for why in installed.values()), installed
    monkeypatch.setattr(config, "_installed_torch", lambda: "2.6.0")
    assert _plan(args)["dispatch"] is None  # the installed torch decides when no option is given
    monkeypatch.setattr(config, "_installed_torch", lambda: None)
    assumed = _plan(args)
    assert all("judged for torch >= 2.8 (assumed: no torch installed here" in w for w in assumed.values()), assumed


def test_check_config_judges_by_the_option_and_says_so(tmp_path: Path) -> None:
    args = _args(tmp_path)
    new = _check(args, "--torch-version", "2.9.0")
    assert new["dispatch"][0] == 0 and "judged for torch 2.9.0 (--torch-version)" in new["dispatch"][1], new
    old = _check(args, "--torch-version", "2.7.1")
    assert old["dispatch"][0] > 0 and "judged for" not in old["dispatch"][1], old  # used: its slots count


def test_advise_judges_by_the_option_and_says_so(tmp_path: Path) -> None:
    snap = _megatron_trace(tmp_path, [*NATIVE, *MEGATRON], [*NATIVE, *EXPERT])
    args = tmp_path / "run.args"
    args.write_text(ARGS.format(ep=2))
    argv = ["advise", str(snap), "--args", str(args), "--num-microbatches", "6", "--json"]
    new = json.loads(runner.invoke(app, [*argv, "--torch-version", "2.9.0"]).stdout)
    warned = [w for w in new["warnings"] if "install() would leave its ring unused" in w]
    assert len(warned) == 2 and all("judged for torch 2.9.0 (--torch-version)" in w for w in warned), warned
    old = json.loads(runner.invoke(app, [*argv, "--torch-version", "2.7.1"]).stdout)
    warned = [w for w in old["warnings"] if "install() would leave its ring unused" in w]
    assert len(warned) == 1 and "expert_fc2_output" in warned[0], warned  # the dispatch ring is used before 2.8


@pytest.mark.parametrize("command", ["plan", "check-config", "advise"])
def test_a_bad_torch_version_is_one_line_and_exit_2(tmp_path: Path, command: str) -> None:
    args = _args(tmp_path)
    argv = {"plan": ["plan", str(args), "--num-microbatches", "4"], "check-config": ["check-config", str(args)],
            "advise": ["advise", str(tmp_path / "none.pickle"), "--args", str(args)]}[command]  # fmt: skip
    res = runner.invoke(app, [*argv, "--torch-version", "banana"])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--torch-version 'banana'" in lines[0], res.output
