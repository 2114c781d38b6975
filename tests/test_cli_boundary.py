"""The CLI's error boundary: one line, the error's exit code, tracebacks only with --debug."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from bufreuse.cli import app

runner = CliRunner()


def test_version_prints_and_exits_zero() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith("bufreuse ")


def test_python_m_bufreuse_runs_help() -> None:
    out = subprocess.run([sys.executable, "-m", "bufreuse", "--help"], capture_output=True, text=True, check=True)
    assert "Usage" in out.stdout


def test_cli_import_does_not_import_torch() -> None:
    code = "import sys, bufreuse.cli; assert 'torch' not in sys.modules, 'CLI start-up imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_input_is_one_line_exit_2_and_debug_shows_traceback(tmp_path) -> None:
    bad = tmp_path / "empty.pickle"
    bad.write_bytes(b"")
    plain = subprocess.run(
        [sys.executable, "-m", "bufreuse", "snapshot-report", str(bad)], capture_output=True, text=True
    )
    assert plain.returncode == 2
    assert "Traceback" not in plain.stderr
    assert str(bad) in plain.stderr
    debug = subprocess.run(
        [sys.executable, "-m", "bufreuse", "snapshot-report", str(bad), "--debug"], capture_output=True, text=True
    )
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr
