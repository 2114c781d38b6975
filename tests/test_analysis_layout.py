"""The shape of ``bufreuse.analysis``: three subpackages with explicit exports, pure rendering, no torch."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import bufreuse.analysis

ROOT = Path(__file__).resolve().parents[1] / "bufreuse"
ANALYSIS = ROOT / "analysis"
_FILE_METHODS = {"read_text", "read_bytes", "write_text", "write_bytes", "savefig", "mkdir", "unlink"}


def _calls(path: Path) -> list[tuple[int, str]]:
    """Every call to ``print``/``open`` and to a file method (``x.read_text()``...) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("print", "open"):
            found.append((node.lineno, f.id))
        elif isinstance(f, ast.Attribute) and f.attr in _FILE_METHODS:
            found.append((node.lineno, f.attr))
    return found


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("path", sorted((ANALYSIS / "render").glob("*.py")), ids=lambda p: p.name)
def test_render_module_never_reads_files_or_prints(path: Path) -> None:
    allowed = {("export.py", "savefig")}  # PNG encoding into a BytesIO, not a file
    calls = [(line, name) for line, name in _calls(path) if (path.name, name) not in allowed]
    assert not calls, f"{path.name} reads, writes or prints: {calls}"
    assert not _imports(path) & {"bufreuse.fsutil", "bufreuse.sweepdir", "pathlib", "shutil"}


@pytest.mark.parametrize("path", [*sorted(ANALYSIS.rglob("*.py")), ROOT / "demo.py"], ids=lambda p: p.name)
def test_analysis_module_imports_no_torch_and_no_cli(path: Path) -> None:
    bad = {m for m in _imports(path) if m.split(".")[0] == "torch" or m.startswith(("bufreuse.cli", "bufreuse.pool"))}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("package", ["snapshot", "runs", "render"])
def test_analysis_subpackage_exports_every_name_it_lists(package: str) -> None:
    mod = importlib.import_module(f"bufreuse.analysis.{package}")
    assert mod.__all__ and len(set(mod.__all__)) == len(mod.__all__)
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing, f"bufreuse.analysis.{package}.__all__ names what it lacks: {missing}"


def test_analysis_lazy_exports_all_resolve() -> None:
    for name in bufreuse.analysis.__all__:
        assert getattr(bufreuse.analysis, name) is not None
    with pytest.raises(AttributeError):
        _ = bufreuse.analysis.no_such_name


@pytest.mark.parametrize("path", sorted(ANALYSIS.rglob("*.py")), ids=lambda p: str(p.relative_to(ANALYSIS)))
def test_analysis_module_declares_all(path: Path) -> None:
    tree = ast.parse(path.read_text())
    names = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    names |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert "__all__" in names, f"{path.relative_to(ROOT)} has no __all__"
