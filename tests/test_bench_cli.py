"""`bufreuse bench`'s refusals: a bad --device for ``bench pool`` (the good path: tests/test_pool.py), and ``bench
layer`` without megatron-core; each one error line and exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from bufreuse.cli import app

runner = CliRunner()
TINY = ["--rows", "8", "--hidden", "8", "--iters", "20", "--repeats", "1"]


@pytest.mark.parametrize(
    ("device", "message"),
    [("gpu7", "use cuda, cuda:N or cpu"), ("meta", "use cuda, cuda:N or cpu")],
)
def test_cli_bench_pool_bad_device_exit_two(device: str, message: str) -> None:
    result = runner.invoke(app, ["bench", "pool", "--device", device, *TINY])
    assert result.exit_code == 2, result.output
    assert message in result.output and "internal error" not in result.output


def test_cli_bench_pool_cuda_without_gpu_exit_two() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = runner.invoke(app, ["bench", "pool", "--device", "cuda", *TINY])
    assert result.exit_code == 2 and "no CUDA device is visible" in result.output


BLOCK_MEGATRON = """
import importlib.abc, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    # what an environment without megatron-core raises for it and its submodules
    def find_spec(self, name, path, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
"""


def _without_megatron(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_MEGATRON + code], capture_output=True, text=True, timeout=120)


def test_bench_layer_without_megatron_core_names_the_extra_and_exits_two() -> None:
    """No megatron-core: one line naming the extra to install, exit 2 (not an internal error)."""
    pytest.importorskip("torch")
    # positive control: the block makes megatron-core's import fail here as where it is not installed
    probe = _without_megatron("import megatron.core")
    assert probe.returncode == 1 and "ModuleNotFoundError: No module named 'megatron'" in probe.stderr, probe.stderr
    args = ["bufreuse", "bench", "layer", "--spec", "local", "--device", "cpu", "--steps", "1", "--rounds", "2"]
    run = _without_megatron(f"import sys\nfrom bufreuse.cli import main\nsys.argv = {args!r}\nmain()\n")
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.strip()]
    assert run.returncode == 2, run.stdout + run.stderr
    assert len(lines) == 1, lines
    assert "pip install 'bufreuse[megatron]'" in lines[0] and "install-megatron.sh" in lines[0], lines
    assert "internal error" not in lines[0] and "Traceback" not in lines[0]
