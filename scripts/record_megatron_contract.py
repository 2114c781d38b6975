#!/usr/bin/env python3
"""Record what bufreuse's megatron-core contract touches, read from Megatron-LM sources (no import).

CI installs megatron-core from PyPI only, so Megatron-LM ``main`` and ``dev`` are checked from a recording:
for every :data:`bufreuse.integrations._compat_megatron.CONTRACT` entry (and :data:`EXTRA`), whether
``module.attr`` is defined in the file at each ref and, for a function, its parameter names, read with
``ast`` from a Megatron-LM git directory. Writes ``tests/data/megatron/contract-upstream.json``.

    python scripts/record_megatron_contract.py --git-dir /path/to/Megatron-LM.git main dev core_r0.19.0
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from bufreuse.fsutil import atomic_write_text
from bufreuse.integrations._compat_megatron import CONTRACT, EXTRA

OUT = Path(__file__).parents[1] / "tests" / "data" / "megatron" / "contract-upstream.json"


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True).stdout


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def _module_level(tree: ast.Module, name: str) -> ast.AST | None:
    """A top-level definition of ``name``, also inside module-level if/try blocks (imports included)."""
    todo: list[ast.stmt] = list(tree.body)
    found: ast.AST | None = None
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
        if _defines(node, name):
            found = found or node
        elif isinstance(node, ast.If | ast.Try):
            todo.extend(node.body)
            todo.extend(getattr(node, "orelse", []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return found


def _defines(node: ast.stmt, name: str) -> bool:
    """An assignment, annotated assignment or import binding ``name``."""
    if isinstance(node, ast.Assign):
        return any(_binds(t, name) for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return _binds(node.target, name)
    if isinstance(node, ast.Import | ast.ImportFrom):
        return any((a.asname or a.name) == name for a in node.names)
    return False


def _binds(target: ast.AST, name: str) -> bool:
    if isinstance(target, ast.Name):
        return target.id == name
    if isinstance(target, ast.Tuple | ast.List):
        return any(_binds(t, name) for t in target.elts)
    return False


def _member(cls: ast.ClassDef, name: str) -> ast.AST | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(_binds(t, name) for t in node.targets):
            return node
        if isinstance(node, ast.AnnAssign) and _binds(node.target, name):
            return node
    return None


def lookup(source: str | None, attr: str) -> dict:
    """``{"present": bool, "params": [...] | None}`` for ``attr`` (``Class.method`` or a name) in ``source``."""
    if source is None:
        return {"present": False, "params": None, "why": "module file absent"}
    tree = ast.parse(source)
    head, _, rest = attr.partition(".")
    node = _module_level(tree, head)
    if node is not None and rest:
        node = _member(node, rest) if isinstance(node, ast.ClassDef) else None
    if node is None:
        return {"present": False, "params": None}
    params = _params(node) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None
    return {"present": True, "params": params}


def record(git_dir: str, refs: list[str]) -> dict:
    out: dict = {
        "source": "github.com/NVIDIA/Megatron-LM",
        "recorded_on": datetime.date.today().isoformat(),
        "refs": {},
        "symbols": {},
    }
    for ref in refs:
        commit, date = _git(git_dir, "log", "-1", "--format=%H %cI", ref).split()
        out["refs"][ref] = {"commit": commit, "date": date}
        symbols: dict[str, dict] = {}
        for a in (*CONTRACT, *EXTRA):
            path = a.module.replace(".", "/") + ".py"
            try:
                source = _git(git_dir, "show", f"{commit}:{path}")
            except subprocess.CalledProcessError:
                source = None
            symbols[f"{a.module}:{a.attr}"] = lookup(source, a.attr)
        out["symbols"][ref] = symbols
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--git-dir", required=True)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("refs", nargs="+")
    args = p.parse_args()
    data = record(args.git_dir, args.refs)
    atomic_write_text(args.out, json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
