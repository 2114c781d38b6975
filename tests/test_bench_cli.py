"""`bufreuse bench pool`: a bad --device is one error line and exit 2 (the good path: tests/test_pool.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from bufreuse.cli import app

runner = CliRunner()
TINY = ["--tokens", "8", "--hidden", "8", "--iters", "20", "--repeats", "1"]


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
