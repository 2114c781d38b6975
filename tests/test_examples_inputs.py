"""``examples/`` holds inputs only (issue 46 item 7): every entry is read by a command shown in the README or
``docs/``, no dated recording sits there, and the folder stays small. Recordings live in ``docs/recordings/``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DATED = re.compile(r"\d{4}-\d{2}-\d{2}")
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.M | re.S)


def _shell_text() -> str:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(EXAMPLES.rglob("README.md"))]
    return "\n".join(b for p in docs for b in SHELL_BLOCK.findall(p.read_text(encoding="utf-8")))


def test_every_example_is_read_by_a_shown_command() -> None:
    shell = _shell_text()
    entries = sorted(p.name for p in EXAMPLES.iterdir() if p.name != "README.md")
    assert entries, "examples/ is empty"
    unread = [name for name in entries if f"examples/{name}" not in shell]
    assert not unread, f"examples/ entries no command in the README or docs/ reads: {unread}"


def test_no_dated_recording_in_examples() -> None:
    dated = sorted(str(p.relative_to(ROOT)) for p in EXAMPLES.rglob("*") if p.is_dir() and DATED.search(p.name))
    assert not dated, f"dated recordings belong in docs/recordings/: {dated}"


def test_examples_stay_small() -> None:
    size = sum(p.stat().st_size for p in EXAMPLES.rglob("*") if p.is_file())
    assert size < 1_000_000, f"examples/ holds {size:,} bytes; recordings belong in docs/recordings/"


def test_every_recording_folder_is_in_the_recordings_index() -> None:
    index = (ROOT / "docs" / "recordings" / "README.md").read_text(encoding="utf-8")
    names = sorted(p.name for p in (ROOT / "docs" / "recordings").iterdir() if p.name != "README.md")
    missing = [n for n in names if f"`{n}" not in index]
    assert not missing, f"docs/recordings/README.md does not list: {missing}"
