"""Import direction, torch-freedom and acyclicity of ``bufreuse``, read with ``ast`` (nothing is imported).

Every import counts, module-level or inside a function: a lazy import is how a cycle hides.
The layer table is by package prefix, so it covers whatever modules exist; a module no prefix
maps fails the test (add it to :data:`LAYERS` and docs/architecture.md).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parents[1] / "bufreuse"

LAYERS: tuple[tuple[str, str], ...] = (
    # longest prefix wins
    ("bufreuse.__main__", "cli"),
    ("bufreuse.cli", "cli"),
    ("bufreuse.demo", "cli"),
    ("bufreuse.launch", "launch"),
    ("bufreuse.bench", "bench"),
    ("bufreuse.analysis", "analysis"),
    ("bufreuse.integrations", "integrations"),
    ("bufreuse.pool", "pool"),
    ("bufreuse.plan", "foundation"),
    ("bufreuse.errors", "foundation"),
    ("bufreuse.limits", "foundation"),
    ("bufreuse.fsutil", "foundation"),
    ("bufreuse.config", "foundation"),
    ("bufreuse.sweepdir", "foundation"),
    ("bufreuse", "foundation"),  # the root package itself (``__version__``)
)

ALLOWED: dict[str, frozenset[str]] = {
    "foundation": frozenset({"foundation"}),
    "pool": frozenset({"pool", "foundation"}),  # and of the foundation only bufreuse.errors (below)
    "integrations": frozenset({"integrations", "pool", "foundation"}),
    "analysis": frozenset({"analysis", "foundation"}),
    "bench": frozenset({"bench", "integrations", "pool", "analysis", "foundation"}),
    # launch runs bench jobs by module name in a subprocess (not an import); it reads bench's workload
    # table and parses logs with analysis.
    "launch": frozenset({"launch", "bench", "analysis", "foundation"}),
    "cli": frozenset({"cli", "launch", "bench", "analysis", "integrations", "pool", "foundation"}),
}
"""Layer -> the layers its modules may import (the dependency direction of docs/architecture.md)."""

TORCH_FREE = frozenset({"foundation", "analysis"})


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(name: str) -> str | None:
    """The existing bufreuse module ``name`` refers to (itself, or the longest existing prefix)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported name, line) for every import statement in the module, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(name) else name.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    # Imports under ``if TYPE_CHECKING:`` never run: annotations only, so they make no runtime cycle.
    type_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in node.body
        for sub in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, node.lineno))
            out.extend((f"{base}.{a.name}", node.lineno) for a in node.names if f"{base}.{a.name}" in MODULES)
    return out


def _edges() -> dict[str, dict[str, int]]:
    """Module -> {bufreuse module it imports: line}, parent packages included (they run on import)."""
    edges: dict[str, dict[str, int]] = defaultdict(dict)
    for name, path in MODULES.items():
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for target, line in _imports(name, path):
            if not target.startswith("bufreuse"):
                continue
            mod = _resolve(target)
            if mod is None or mod == name:
                continue
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep != name and dep not in ancestors and dep in MODULES:
                    edges[name].setdefault(dep, line)
    return edges


def layer_of(module: str) -> str | None:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    return dict(LAYERS)[best] if best is not None else None


def test_every_module_maps_to_a_layer() -> None:
    unmapped = [m for m in MODULES if layer_of(m) is None]
    assert not unmapped, f"modules with no layer in tests/test_architecture.py LAYERS: {unmapped}"


def test_no_upward_import() -> None:
    bad = []
    for src, deps in _edges().items():
        for dst, line in deps.items():
            a, b = layer_of(src), layer_of(dst)
            if b not in ALLOWED[a]:
                bad.append(f"{src}:{line} imports {dst}: layer '{a}' may import only {sorted(ALLOWED[a])}, not '{b}'")
    assert not bad, "\n".join(bad)


def test_pool_imports_only_torch_and_errors() -> None:
    bad = []
    for name, path in MODULES.items():
        if layer_of(name) != "pool":
            continue
        for target, line in _imports(name, path):
            mod = _resolve(target) if target.startswith("bufreuse") else None
            allowed = ("bufreuse.errors", "bufreuse")
            if mod is not None and layer_of(mod) == "foundation" and mod not in allowed:
                bad.append(f"{name}:{line} imports {target}: the pool imports only torch and errors")
    assert not bad, "\n".join(bad)


def test_no_torch_in_analysis_or_foundation() -> None:
    bad = [
        f"{name}:{line} imports {target}: layer '{layer_of(name)}' never imports torch"
        for name, path in MODULES.items()
        if layer_of(name) in TORCH_FREE
        for target, line in _imports(name, path)
        if target == "torch" or target.startswith("torch.")
    ]
    assert not bad, "\n".join(bad)


def test_nothing_imports_cli() -> None:
    bad = [
        f"{src}:{line} imports {dst}: nothing outside bufreuse.cli imports it (only bufreuse.__main__ runs it)"
        for src, deps in _edges().items()
        for dst, line in deps.items()
        if (dst == "bufreuse.cli" or dst.startswith("bufreuse.cli."))
        and not (src.startswith("bufreuse.cli") or src == "bufreuse.__main__")
    ]
    assert not bad, "\n".join(bad)


def _cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for deps in edges.values() for w in deps}):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    edges = _edges()
    cycles = _cycles(edges)
    detail = [
        " <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}:{edges[a][b]}" for a in c for b in edges.get(a, {}) if b in c)
        for c in cycles
    ]
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(detail)


def test_cycle_finder_sees_a_lazy_import_cycle() -> None:
    fake = {"a": {"b": 1}, "b": {"a": 9}, "c": {"a": 2}}
    assert _cycles(fake) == [["a", "b"]]
