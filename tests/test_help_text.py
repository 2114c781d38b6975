"""Help text (issue 46 item 5): every command's ``--help`` reads right, one option name means one thing in every
command, old spellings still work with a deprecation warning, and ``advise`` accepts the flags it suggests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from bufreuse.cli import app
from bufreuse.cli._common import DEPRECATED_OPTIONS, renew_options

ROOT = Path(__file__).resolve().parents[1]
CONTROL = ROOT / "examples" / "sweep-h200" / "slots0" / "snapshot.pickle.gz"
EP64 = ROOT / "examples" / "megatron-ep64" / "megatron.args"
runner = CliRunner()


def _commands() -> dict[tuple[str, ...], object]:
    """Every command of the CLI by path, sub-commands of groups included."""
    out: dict[tuple[str, ...], object] = {}

    def walk(cmd: object, path: tuple[str, ...]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, (*path, name))
        else:
            out[path] = cmd

    walk(typer.main.get_command(app), ())
    return out


COMMANDS = _commands()


def _help(path: tuple[str, ...]) -> str:
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def _options(path: tuple[str, ...]) -> dict[str, object]:
    return {name: p for p in COMMANDS[path].params for name in getattr(p, "opts", [])}  # type: ignore[attr-defined]


def test_the_walk_finds_every_command() -> None:
    assert {("sweep",), ("compare",), ("advise",), ("bench", "layer"), ("bench", "pool")} <= set(COMMANDS)


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_help_shows_no_bool_placeholder_and_keeps_brackets(path: tuple[str, ...]) -> None:
    text = _help(path)
    assert "<bool>" not in text, text
    assert "pip install 'bufreuse'" not in text, text  # rich markup ate an extra's [name]


def test_bench_layer_help_names_the_extra() -> None:
    assert "pip install 'bufreuse[megatron]'" in " ".join(_help(("bench", "layer")).split())


def test_one_option_name_means_one_thing() -> None:
    """--slots is a comma list of slot counts, --warmup counts log iterations, microbatches are
    --num-microbatches, --tokens is tokens per microbatch: wherever each appears."""
    for path in COMMANDS:
        opts = _options(path)
        if "--slots" in opts:
            assert "comma" in (opts["--slots"].help or ""), (path, opts["--slots"].help)  # type: ignore[attr-defined]
        if "--warmup" in opts:
            assert "Iterations" in (opts["--warmup"].help or ""), path  # type: ignore[attr-defined]
        if "--tokens" in opts:
            assert (opts["--tokens"].help or "").startswith("Tokens per microbatch"), path  # type: ignore[attr-defined]
        assert "--microbatches" not in opts, path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "layer", "--warmup", "2", "--slots=4"],
         ["bench", "layer", "--warmup-rounds", "2", "--ring-slots=4"]),
        (["--debug", "bench", "pool", "--tokens", "8"], ["--debug", "bench", "pool", "--rows", "8"]),
        (["sweep", "--microbatches", "4"], ["sweep", "--num-microbatches", "4"]),
        (["compare", "--warmup", "3", "a", "b"], ["compare", "--warmup", "3", "a", "b"]),  # compare's own --warmup
        (["bench", "layer", "--", "--slots"], ["bench", "layer", "--", "--slots"]),
    ],
)
def test_old_spellings_are_renamed_for_their_command_only(argv: list[str], expected: list[str]) -> None:
    assert renew_options(typer.main.get_command(app), argv) == expected


def test_every_new_spelling_exists_and_names_the_old_one() -> None:
    for path, renamed in DEPRECATED_OPTIONS.items():
        opts = _options(path)
        for old, new in renamed.items():
            assert new in opts and old not in opts, (path, old, new)
            assert f"was {old}" in (opts[new].help or ""), (path, new)  # type: ignore[attr-defined]


def test_an_old_spelling_runs_with_a_deprecation_warning(tmp_path: Path) -> None:
    args = ["bench", "pool", "--device", "cpu", "--slots", "2", "--tokens", "8", "--hidden", "8",
            "--iters", "10", "--repeats", "1", "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "warning: bufreuse bench pool --slots is deprecated; use --ring-slots" in result.output
    assert "warning: bufreuse bench pool --tokens is deprecated; use --rows" in result.output


def test_advise_accepts_the_flags_it_suggests() -> None:
    plain = runner.invoke(app, ["advise", str(CONTROL), "--args", str(EP64)], env={"COLUMNS": "400"})
    assert plain.exit_code == 0, plain.output
    (planner,) = [line for line in plain.output.splitlines() if "microbatches is unknown" in line]
    suggested = set(re.findall(r"--[a-z][a-z-]+", planner))
    assert "--data-parallel-size" in suggested, planner
    assert suggested <= set(_options(("advise",))), suggested - set(_options(("advise",)))
    given = runner.invoke(app, ["advise", str(CONTROL), "--args", str(EP64), "--data-parallel-size", "64"])
    assert given.exit_code == 0, given.output
    assert "slot depth (bufreuse plan)" in given.output and "microbatches is unknown" not in given.output


def test_advise_planner_flags_without_a_config_are_one_line_and_exit_2() -> None:
    result = runner.invoke(app, ["advise", str(CONTROL), "--data-parallel-size", "64"])
    assert result.exit_code == 2
    assert "pass --args FILE or --config FILE" in result.output


def test_compare_help_says_what_feature_means() -> None:
    assert "feature: every run that is not the control" in " ".join(_help(("compare",)).split())


def test_bufreuse_megatron_help_explains_the_wrapper_and_every_knob(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from bufreuse.config import add_arguments
    from bufreuse.integrations.entry import main

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    knobs = [a.option_strings[0] for a in add_arguments(argparse.ArgumentParser())._actions if a.option_strings]
    assert len(text.splitlines()) > 10, text  # more than the one usage line
    assert "--megatron-lm PATH" in text and "goes to the script unchanged" in " ".join(text.split()), text
    assert len(knobs) > 5 and [k for k in knobs if k not in text] == [], text  # every knob is listed
