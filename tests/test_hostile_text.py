"""Hostile logs and configs: binary junk, gzip, invalid UTF-8, huge lines and numbers, YAML bombs."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from bufreuse.analysis.runs.megatron_log import parse_log
from bufreuse.analysis.runs.textfile import MAX_LINE_CHARS, read_log_text
from bufreuse.config import load_megatron_file
from bufreuse.errors import InputError, LogFormatError

LOG = Path(__file__).parent / "data" / "logs" / "slurm-2796012.out"
YAML = Path(__file__).parent / "data" / "megatron" / "hybridep-ready.yaml"


def test_gzip_log_parses_like_the_plain_one(tmp_path: Path) -> None:
    gz = tmp_path / "run.log.gz"
    gz.write_bytes(gzip.compress(LOG.read_bytes()))
    assert len(parse_log(gz).iterations) == len(parse_log(LOG).iterations) > 0


def test_invalid_utf8_in_a_log_is_replaced_not_fatal(tmp_path: Path) -> None:
    p = tmp_path / "cut.log"
    p.write_bytes(LOG.read_bytes().replace(b"\n", b"\xff\xc3\n", 3))
    assert "\ufffd" in read_log_text(p)
    assert parse_log(p).iterations


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\x00\x01\x02binary" * 100, "a binary file"),
        (bytes(range(256)) * 50, "a binary file"),
        (
            b"iteration 1/ 2 | " + b"x" * (MAX_LINE_CHARS + 1) + b"\n",
            "characters in one line: 1,048,594 exceeds the max_log_line_bytes budget of 1,048,576; "
            "raise it with --limit max-log-line-bytes=N",
        ),
        (b"iteration " + b"9" * 5000 + b"/ 10 |\n", "a number of 1,000\\+ digits at line 1"),
        (b"\x1f\x8b\x08\x00junk", "corrupt gzip stream"),
    ],
)
def test_hostile_log_is_one_log_format_error(tmp_path: Path, data: bytes, problem: str) -> None:
    p = tmp_path / "bad.log"
    p.write_bytes(data)
    with pytest.raises(LogFormatError, match=problem):
        parse_log(p)


def test_missing_log_and_folder_are_log_format_errors(tmp_path: Path) -> None:
    with pytest.raises(LogFormatError, match="no such log file"):
        read_log_text(tmp_path / "nope.log")
    with pytest.raises(LogFormatError, match="a folder"):
        read_log_text(tmp_path)


_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b]\n"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (_LAUGHS.encode(), r"aliases \(\*name\) are not allowed"),
        (b"a: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested too deep|not valid YAML"),
        (b"hidden_size: 7168\n\xff\xfe\n", "not UTF-8 text"),
        (b"hidden_size: 7168\n\x00\x00", "a binary file"),
        (b"hidden_size: 1e400\n", "hidden_size is a str, expected an integer"),
        (b"seq_length: [4096]\n", "seq_length is a list"),
        (b"num_moe_experts: " + b"9" * 50 + b"\n", "num_moe_experts is out of range"),
        (b"moe_expert_capacity_factor: .inf\n", "moe_expert_capacity_factor is out of range"),
        (b"'[/]': [\n", "not valid YAML at line 2"),
    ],
)
def test_hostile_config_is_one_input_error(tmp_path: Path, text: bytes, problem: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_bytes(text)
    with pytest.raises(InputError, match=problem) as info:
        load_megatron_file(p)
    assert "[/]" not in str(info.value)  # never quotes the file's text


def test_anchors_without_aliases_still_load(tmp_path: Path) -> None:
    p = tmp_path / "anchor.yaml"
    p.write_text(YAML.read_text() + "extra: &anchor 3\n")
    assert load_megatron_file(p)["extra"] == 3


def test_huge_config_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "huge.yaml"
    p.write_bytes(b"# " + b"x" * (17 << 20))
    with pytest.raises(InputError, match="larger than 16 MiB"):
        load_megatron_file(p)
