"""Every ``bufreuse ...`` command line in the README runs as written against ``examples/``.

The README's fenced shell blocks are parsed here; each ``bufreuse`` command (a whole line, or the part after
``&&``) runs in a fresh working folder that holds a link to this checkout's ``examples/`` (so the README's
relative paths resolve and nothing is written into the checkout), through this interpreter. It must exit 0
and print something. Where the README shows the output (a ``text`` block right after a block of one
command), every figure in it (a number with a unit or a percent) must be in what the command printed now:
the pasted output is real. A line whose comment says "needs a GPU" is ``gpu``-marked (skipped without CUDA,
with the reason, and run by scripts/gpu-tests.sh).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
SHELL_INFO = {"bash", "sh", "shell", "console"}
FIGURE = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?\s?(?:MiB|GiB|KiB|%|µs|ms)")


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    gpu: bool
    shown: str | None
    """The README's pasted output of this command, if it shows one."""

    @property
    def id(self) -> str:
        return " ".join(self.argv[:3])


def _blocks(text: str) -> list[tuple[str, str]]:
    """``(info string, body)`` of every fenced block, in order."""
    return [(m.group(1).strip(), m.group(2)) for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.M | re.S)]


def readme_commands(text: str = README) -> list[Command]:
    blocks = _blocks(text)
    out: list[Command] = []
    for i, (info, body) in enumerate(blocks):
        if info not in SHELL_INFO:
            continue
        found: list[tuple[tuple[str, ...], bool]] = []
        for line in body.replace("\\\n", " ").splitlines():
            code, _, comment = line.partition(" #")
            gpu = "needs a gpu" in comment.lower()
            for part in code.split("&&"):
                words = shlex.split(part)
                if words and words[0] == "bufreuse":
                    found.append((tuple(words), gpu))
        shown = blocks[i + 1][1] if len(found) == 1 and i + 1 < len(blocks) and blocks[i + 1][0] == "text" else None
        out += [Command(argv, gpu, shown) for argv, gpu in found]
    return out


COMMANDS = readme_commands()


def test_the_readme_shows_the_commands_a_user_runs() -> None:
    """The parse found the quick start and the five commands (a parse that finds nothing would pass vacuously)."""
    subcommands = {c.argv[1] for c in COMMANDS}
    assert {"demo", "sweep", "snapshot-report", "advise", "plan", "check-config", "compare"} <= subcommands
    assert [c.argv[1] for c in COMMANDS if c.gpu] == ["sweep"]
    assert sum(c.shown is not None for c in COMMANDS) >= 5


def test_the_parser_reads_continuations_chains_comments_and_output_blocks() -> None:
    text = (
        "```bash\npip install x && bufreuse demo   # runs\nbufreuse plan a.args \\\n  --data-parallel-size 2\n```\n"
        "```bash\nbufreuse sweep --slots 0,4   # needs a GPU\n```\n```text\n4,864 MiB\n```\n"
        "```python\nbufreuse = 1\n```\n"
    )
    got = readme_commands(text)
    assert [c.argv for c in got] == [
        ("bufreuse", "demo"), ("bufreuse", "plan", "a.args", "--data-parallel-size", "2"),
        ("bufreuse", "sweep", "--slots", "0,4"),
    ]  # fmt: skip
    assert [c.gpu for c in got] == [False, False, True]
    assert [c.shown for c in got] == [None, None, "4,864 MiB\n"]


def _params() -> list:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.gpu] if c.gpu else []) for c in COMMANDS]


@pytest.mark.parametrize("command", _params())
def test_readme_command_runs_as_written(command: Command, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    env.pop("BUFREUSE_SWEEPS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "bufreuse", *command.argv[1:]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.strip(), out
    if command.argv[1] == "demo":  # the README says where the demo writes
        assert "./bufreuse-demo" in README
        assert any((tmp_path / "bufreuse-demo").rglob("*.png")), sorted(tmp_path.rglob("*"))
    if command.shown is not None:
        flat = " ".join(out.split())
        missing = [f for f in FIGURE.findall(command.shown) if " ".join(f.split()) not in flat]
        assert not missing, f"figures shown in the README but not printed now: {missing}\n{out}"


PLACEHOLDER = re.compile(r"<[A-Za-z][^<>\n]*>")


@pytest.mark.parametrize("doc", ["README.md", "examples/README.md", "examples/megatron-h200/README.md"])
def test_every_shell_block_is_a_command_bash_can_run(doc: str) -> None:
    """No ``<placeholder>`` (bash reads ``<`` as a redirection) and valid syntax (``bash -n``), block by block."""
    blocks = [body for info, body in _blocks((ROOT / doc).read_text(encoding="utf-8")) if info in SHELL_INFO]
    assert blocks, doc
    for body in blocks:
        code = "\n".join(line.partition(" #")[0] for line in body.splitlines())
        assert not PLACEHOLDER.search(code), f"{doc}: a <placeholder> in a shell block:\n{body}"
        proc = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True)
        assert proc.returncode == 0, f"{doc}: bash -n: {proc.stderr}\n{body}"
