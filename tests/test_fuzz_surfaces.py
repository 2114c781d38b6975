"""A fast seeded fuzz of the input surfaces that must stay bounded: log reading, special files, option conflicts.

- The streaming log reader against a whole-text reference (decode everything, then check): on
  random logs (long lines, digit runs near the limit, CRLF, invalid UTF-8, NUL bytes, gzip members,
  cut gzip) read in pieces as small as 7 bytes, both accept the same logs with the same text.
- A many-line log read under a 2.5 GB address-space limit, in a child process.
- Random FIFO / socket / device paths given to random commands: always one ``error:`` line, exit 2.
- Random combinations of sweep options that conflict: always one ``error:`` line, exit 2, no folder.
Seeded; about 30 s on 2 cores.
"""

from __future__ import annotations

import gzip
import os
import random
import socket
from pathlib import Path

import pytest
from test_bounded_inputs import LOG, ROOT, SNAP, YAML, refused

from bufreuse.analysis.runs import textfile
from bufreuse.errors import LogFormatError
from bufreuse.limits import override

LINE_LIMIT = 1200  # above the 1,000-digit runs, so the number check is what refuses them


def _reference(data: bytes) -> str | None:
    """The whole-text check (what the reader did before it streamed); None = refused."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            return None
    text = data.decode("utf-8", errors="replace")
    try:
        textfile.check_log_text(Path("x"), text)
    except LogFormatError:
        return None
    return text


def _random_log(rng: random.Random) -> bytes:
    parts = []
    for _ in range(rng.randint(0, 24)):
        r = rng.random()
        if r < 0.6:
            parts.append(f" iteration {rng.randint(1, 99)}/ 100 | lm loss: {rng.random():.3f} |".encode())
        elif r < 0.67:
            parts.append(b"9" * rng.choice([5, 998, 999, 1000, 1001, 1500]))
        elif r < 0.74:
            parts.append(b"x" * rng.choice([LINE_LIMIT - 1, LINE_LIMIT, LINE_LIMIT + 1, 2 * LINE_LIMIT]))
        elif r < 0.8:
            parts.append(rng.choice([b"\xff\xfe", b"\xc3", "é€😀".encode(), b"\x00", b"\x01\x02\x03" * 20]))
        else:
            parts.append(rng.choice([b"\n", b"\r\n", b"\r", b"\x0b", b"   "]))
        parts.append(rng.choice([b"\n", b"\n", b"\r\n", b"", b" "]))
    data = b"".join(parts)
    if rng.random() < 0.2:
        data = gzip.compress(data, mtime=0)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data) + 1)]
    return data


@pytest.mark.parametrize("seed", range(6))
def test_streaming_reader_agrees_with_the_whole_text_check(tmp_path: Path, monkeypatch, seed: int) -> None:
    rng = random.Random(seed)
    p = tmp_path / "run.log"
    accepted = refused_n = 0
    for _ in range(150):
        data = _random_log(rng)
        p.write_bytes(data)
        monkeypatch.setattr(textfile, "CHUNK_BYTES", rng.choice([7, 64, 1000, 1 << 20]))
        with override(max_log_line_bytes=LINE_LIMIT):
            expected = _reference(data)
            try:
                got, warning = textfile.read_log(p)
            except LogFormatError:
                got, warning = None, None
        if warning is not None:  # a cut gzip stream: the reader keeps what it holds, the reference refuses it
            assert expected is None and data[:2] == b"\x1f\x8b"
            continue
        if expected is None and got == "" and data[:2] == b"\x1f\x8b":
            continue  # an empty gzip member: nothing to refuse
        assert (got is None) == (expected is None), (seed, data[:200])
        if got is not None:
            assert got == expected
            assert "".join(textfile.iter_log_lines(p)) == expected
        accepted += got is not None
        refused_n += got is None
    assert accepted > 15 and refused_n > 15  # both outcomes were exercised


def test_many_line_log_under_an_address_space_limit(tmp_path: Path) -> None:
    from test_bounded_inputs import _peak_rss_of

    body = LOG.read_bytes()
    log = tmp_path / "many.log.gz"
    log.write_bytes(gzip.compress(body * 60, compresslevel=1))  # ~200,000 lines
    code = (
        "from bufreuse.analysis.runs.megatron_log import parse_log\n"
        f"print('ITER', len(parse_log({str(log)!r}).iterations))"
    )
    rss, stdout = _peak_rss_of(code, tmp_path)
    assert "ITER" in stdout and rss < 600 << 20


_COMMANDS = [
    ["snapshot-report", "{x}"],
    ["snapshot-diff", "{x}", str(SNAP)],
    ["compare", str(LOG), "{x}"],
    ["plan", "{x}"],
    ["check-config", "{x}"],
    ["what-if", "{x}", "--slots", "2"],
    ["compare", "{x}", "{x}"],
]


def test_random_special_files_to_random_commands(tmp_path: Path) -> None:
    rng = random.Random(7)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    link = tmp_path / "link-to-pipe.log"
    link.symlink_to(fifo)
    work = tmp_path / "cwd"
    work.mkdir()
    try:
        for _ in range(6):
            special = rng.choice([fifo, sock_path, link, Path("/dev/null"), Path("/dev/zero")])
            command = rng.choice(_COMMANDS)
            refused([a.replace("{x}", str(special)) for a in command], work, timeout=30)
    finally:
        sock.close()


_CONFLICTS = [
    (["--status", "s", "--cancel", "s"], "--status and --cancel"),
    (["--slurm-partition", "p"], "slurm only"),
    (["--slurm-exclusive"], "slurm only"),
    (["--dry-run"], "slurm only"),
    (["--template", "proxy"], "slurm only"),
    (["--megatron-args", "x"], "--workload megatron only"),
    (["--root", "q/r/s"], "pass --mkdir"),
    (["--slots", "99999"], "max_ring_slots"),
]


def test_random_conflicting_sweep_options(tmp_path: Path) -> None:
    rng = random.Random(11)
    work = tmp_path / "cwd"
    work.mkdir()
    for _ in range(5):
        picked = rng.sample(_CONFLICTS, rng.randint(1, 2))
        args = ["sweep", "--workload", "cpu-smoke"] + [a for opts, _ in picked for a in opts]
        line = refused(args, work, timeout=60)
        assert any(m in line for _, m in picked), (args, line)
    assert YAML.is_file() and ROOT.is_dir()
