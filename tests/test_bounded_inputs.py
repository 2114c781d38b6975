"""Bad inputs refused cleanly and within bounds: special files, big logs under a memory cap, planted snapshots.

Every refusal is checked the same way (:func:`refused`): a real ``python -m bufreuse`` process,
exit code 2, exactly one output line and it starts ``error:``, no traceback, and nothing written
into the folder it ran in. A hang is a failure too (every run has a timeout).
"""

from __future__ import annotations

import gzip
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "tests/data/logs/slurm-2796012.out"
SNAP = ROOT / "tests/data/snapshots/empty_cache.pickle"
YAML = ROOT / "tests/data/megatron/hybridep-ready.yaml"


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def run_cli(args: list[str], cwd: Path, *, env: dict[str, str] | None = None, timeout: float = 60, **kw):
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "bufreuse", *args], cwd=cwd, env=full_env, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL, **kw,
    )  # fmt: skip


def refused(args: list[str], cwd: Path, *, env: dict[str, str] | None = None, match: str = "", **kw) -> str:
    """Run the CLI; assert exit 2, one ``error:`` line (containing ``match``), no traceback, nothing written."""
    before = _tree(cwd)
    out = run_cli(args, cwd, env=env, **kw)
    text = (out.stdout + out.stderr).strip()
    assert out.returncode == 2, f"exit {out.returncode}: {text[-2000:]}"
    assert "Traceback" not in text
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text[-2000:]
    assert match in lines[0], lines[0]
    assert _tree(cwd) == before, f"files written: {_tree(cwd) - before}"
    return lines[0]


@pytest.fixture
def specials(tmp_path: Path):
    """A FIFO, a listening Unix socket and a character device, by name."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    yield {"fifo": fifo, "socket": sock_path, "device": Path("/dev/zero")}
    sock.close()


def test_positive_control_the_same_commands_run_on_regular_files(tmp_path: Path) -> None:
    for args in (["compare", str(LOG), str(LOG)], ["snapshot-report", str(SNAP)], ["check-config", str(YAML)]):
        out = run_cli(args, tmp_path)
        assert out.returncode in (0, 1), (args, out.stderr[-500:])


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
@pytest.mark.parametrize(
    "command",
    [
        ["snapshot-report", "{x}"],
        ["snapshot-diff", "{x}", str(SNAP)],
        ["snapshot-diff", str(SNAP), "{x}"],
        ["compare", "{x}", str(LOG)],
        ["plan", "{x}"],
        ["check-config", "{x}"],
        ["what-if", "{x}"],
        ["what-if", str(SNAP), "--slots", "2", "--measured", "2={x}"],
    ],
)
def test_special_files_are_refused_before_open(tmp_path: Path, specials, kind: str, command: list[str]) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    x = str(specials[kind])
    line = refused([a.replace("{x}", x) for a in command], work, timeout=30)
    assert x in line and ("FIFO" in line or "socket" in line or "device" in line)


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2_500_000 * 1024, 2_500_000 * 1024))


@pytest.mark.parametrize("gz", [False, True])
def test_compare_works_under_a_2_5_gb_address_space_limit(tmp_path: Path, gz: bool) -> None:
    """A normal log under ``ulimit -v 2500000``: no read asks for a budget-sized (4 GiB) buffer."""
    log = tmp_path / ("run.log.gz" if gz else "run.log")
    log.write_bytes(gzip.compress(LOG.read_bytes()) if gz else LOG.read_bytes())
    out = run_cli(["compare", str(log), str(log)], tmp_path, preexec_fn=_limit_address_space)
    assert out.returncode == 0, out.stderr[-800:]
    assert "TFLOP/s/GPU" in out.stdout


_HWM = (
    "import atexit, os\n"
    "def _hwm():\n"
    "    with open('/proc/self/status') as f:\n"
    "        kb = next(line for line in f if line.startswith('VmHWM')).split()[1]\n"
    "    with open(os.environ['BUFREUSE_TEST_HWM'], 'w') as out:\n"
    "        out.write(kb)\n"
    "atexit.register(_hwm)\n"
)
"""Writes the process's own peak RSS (``VmHWM``: per address space, so not the forking test process's)."""


def _peak_rss_of(code: str, tmp_path: Path) -> tuple[int, str]:
    hwm = tmp_path / "hwm.txt"
    out = subprocess.run(
        [sys.executable, "-c", _HWM + code], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "BUFREUSE_TEST_HWM": str(hwm)},
        capture_output=True, text=True, timeout=120, preexec_fn=_limit_address_space,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-800:]
    return int(hwm.read_text()) * 1024, out.stdout


@pytest.mark.parametrize("gz", [False, True])
def test_many_line_log_streams_in_bounded_memory(tmp_path: Path, gz: bool) -> None:
    """600,000 lines (48 MB) read line by line: peak RSS stays far below the text's size, gzip or not."""
    line = b"[2026-01-01] iteration 7/ 100 | elapsed time per iteration (ms): 1.5 | lm loss: 2.0 |\n"
    n = 600_000
    data = line * n
    log = tmp_path / ("big.log.gz" if gz else "big.log")
    log.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
    code = (
        "from bufreuse.analysis.runs.textfile import iter_log_lines\n"
        f"n = sum(1 for _ in iter_log_lines({str(log)!r}))\nprint('LINES', n)"
    )
    rss, stdout = _peak_rss_of(code, tmp_path)
    assert f"LINES {n}" in stdout
    baseline, _ = _peak_rss_of("import bufreuse.analysis.runs.textfile", tmp_path)
    assert rss - baseline < 24 << 20, f"reading {len(data):,} bytes added {rss - baseline:,} bytes of RSS"


def test_log_budget_names_the_real_size(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_bytes(LOG.read_bytes())
    work = tmp_path / "cwd"
    work.mkdir()
    line = refused(["--limit", "max-log-bytes=1", "compare", str(log), str(log)], work)
    assert f"bytes: {log.stat().st_size:,} exceeds the max_log_bytes budget of 1" in line


def test_number_split_across_read_pieces_is_still_found(tmp_path: Path) -> None:
    from bufreuse.analysis.runs.textfile import CHUNK_BYTES, read_log_text
    from bufreuse.errors import LogFormatError

    pad = b"iteration 1/ 2 |\n" * ((CHUNK_BYTES - 600) // 17)
    p = tmp_path / "run.log"
    p.write_bytes(pad + b"x" * ((CHUNK_BYTES - 600) % 17) + b"9" * 1200 + b"\n")
    with pytest.raises(LogFormatError, match=r"1,000\+ digits at line " + str(pad.count(b"\n") + 1)):
        read_log_text(p)
    p.write_bytes(pad + b"9" * 999 + b"\n")  # control: 999 digits pass
    assert read_log_text(p).endswith("9\n")


def _planted(tmp_path: Path, mb: int, seed: int) -> Path:
    out = tmp_path / f"planted-{seed}.pickle"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/gen_planted_snapshot.py"), str(out), "--mb", str(mb), "--seed", str(seed)],
        check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    return out


def _measured_run(args: list[str], cwd: Path) -> tuple[int, str, int]:
    """Exit code, output and peak RSS (bytes, ``VmHWM`` of the CLI process itself) of one CLI run."""
    hwm = cwd.parent / f"{cwd.name}.hwm"
    code = (
        _HWM
        + "import sys, runpy\nsys.argv = ['bufreuse', *sys.argv[1:]]\nrunpy.run_module('bufreuse', run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "BUFREUSE_TEST_HWM": str(hwm)},
    )  # fmt: skip
    return out.returncode, out.stdout + out.stderr, int(hwm.read_text()) * 1024


def test_planted_snapshot_is_held_to_max_memory_bytes_not_its_size(tmp_path: Path) -> None:
    """A 60 MB file of planted strings costs far more once loaded; the budget caps the whole command."""
    snap = _planted(tmp_path, 60, seed=4)
    work = tmp_path / "cwd"
    work.mkdir()
    budget = 60_000_000
    rc, text, peak = _measured_run(["--limit", f"max-memory-bytes={budget}", "snapshot-report", str(snap)], work)
    lines = text.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "max_memory_bytes budget of 60,000,000" in lines[0], text[-800:]
    assert not list(work.iterdir())
    _, _, idle = _measured_run(["--version"], work)
    assert peak < idle + budget + (64 << 20), f"peak RSS {peak:,} with a budget of {budget:,} (start-up {idle:,})"
    rc, text, full = _measured_run(["snapshot-report", str(snap)], work)  # control: the default budget reads it
    assert rc == 0 and full > peak + budget // 2, (rc, full, peak, text[-500:])
