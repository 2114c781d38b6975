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
