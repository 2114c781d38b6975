"""What megatron-core really calls on DeepEP's HybridEP API, read from its source (no text kept here).

Two readings of megatron-core's ``fused_a2a.py``:

- :func:`call_sites` walks its syntax tree for every ``HybridEPBuffer(...)`` and every method call
  on the process-wide ``_hybrid_ep_buffer``: positional count and keyword names, ``**`` expansions
  resolved (dict literals, ``a if c else b`` of them, and a local dict filled by ``kw['name'] =``).
  A form it cannot resolve is reported, never skipped.
- :func:`megatron_wrappers` runs megatron's own ``if HAVE_HYBRIDEP:`` block (``hybrid_ep_dispatch``
  / ``hybrid_ep_combine``, defined only when DeepEP imports) in ``fused_a2a``'s namespace, so tests
  call through megatron's code rather than a copy of it.

:func:`unbindable` binds each call site to a class's real signatures; a keyword or arity the class
does not take is a finding.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["CallSite", "call_sites", "megatron_wrappers", "unbindable"]

BUFFER_GLOBAL = "_hybrid_ep_buffer"
BUFFER_CLASS = "HybridEPBuffer"


@dataclass(kw_only=True, slots=True)
class CallSite:
    """One call megatron makes into the HybridEP API."""

    target: str
    """``__init__`` for the constructor, else the method name."""
    line: int
    positional: int
    keywords: frozenset[str]
    conditional: frozenset[str] = field(default_factory=frozenset)
    """Keywords passed only on some branches (``**({...} if c else {})``, ``kw[...] =`` under an ``if``)."""
    unresolved: tuple[str, ...] = ()
    """``*``/``**`` expansions this reader could not resolve (a test fails on any)."""


def _dict_keys(node: ast.expr) -> tuple[set[str], bool] | None:
    """Literal string keys of a dict expression, and whether some are only on one branch."""
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value for k in node.keys}, False  # type: ignore[union-attr]
    if isinstance(node, ast.IfExp):
        a, b = _dict_keys(node.body), _dict_keys(node.orelse)
        if a is None or b is None:
            return None
        return a[0] | b[0], True
    return None


def _local_dict_keys(func: ast.AST, name: str) -> set[str] | None:
    """Keys of ``name = {}`` filled by ``name['k'] = ...`` in ``func``; None if assigned any other way."""
    keys: set[str] = set()
    seen_init = False
    for node in ast.walk(func):
        if not isinstance(node, ast.Assign):
            continue
        for tgt in node.targets:
            if isinstance(tgt, ast.Name) and tgt.id == name:
                if not (isinstance(node.value, ast.Dict) and not node.value.keys):
                    return None
                seen_init = True
            elif isinstance(tgt, ast.Subscript) and isinstance(tgt.value, ast.Name) and tgt.value.id == name:
                if not (isinstance(tgt.slice, ast.Constant) and isinstance(tgt.slice.value, str)):
                    return None
                keys.add(tgt.slice.value)
    return keys if seen_init else None


def _target(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name) and f.id == BUFFER_CLASS:
        return "__init__"
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == BUFFER_GLOBAL:
        return f.attr
    return None


def _site(call: ast.Call, target: str, func: ast.AST) -> CallSite:
    keywords: set[str] = set()
    conditional: set[str] = set()
    unresolved = [ast.unparse(a) for a in call.args if isinstance(a, ast.Starred)]
    for kw in call.keywords:
        if kw.arg is not None:
            keywords.add(kw.arg)
            continue
        keys = _dict_keys(kw.value)
        if keys is not None:
            (conditional if keys[1] else keywords).update(keys[0])
        elif isinstance(kw.value, ast.Name) and (local := _local_dict_keys(func, kw.value.id)) is not None:
            conditional.update(local)
        else:
            unresolved.append("**" + ast.unparse(kw.value))
    return CallSite(
        target=target,
        line=call.lineno,
        positional=len(call.args),
        keywords=frozenset(keywords),
        conditional=frozenset(conditional),
        unresolved=tuple(unresolved),
    )


def call_sites(source: str | Path) -> list[CallSite]:
    """Every HybridEP API call in ``source`` (a path or the text), in line order."""
    text = Path(source).read_text() if isinstance(source, Path) else source
    tree = ast.parse(text)
    sites: list[CallSite] = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and (target := _target(node)) is not None:
                sites.append(_site(node, target, func))
    unique = {(s.line, s.target): s for s in sites}  # nested functions are walked twice
    return sorted(unique.values(), key=lambda s: s.line)


def unbindable(sites: list[CallSite], cls: type) -> list[str]:
    """Each call site whose positional count or keywords ``cls``'s real signatures do not accept, or unread."""
    problems = []
    for s in sites:
        if s.unresolved:
            problems.append(f"line {s.line}: cannot read {', '.join(s.unresolved)} (extend call_sites)")
        fn = getattr(cls, s.target, None)
        if fn is None:
            problems.append(f"line {s.line}: {cls.__name__} has no {s.target}")
            continue
        sig = inspect.signature(fn)
        params = sig.parameters
        kinds = {p.kind for p in params.values()}
        named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        passed = s.keywords | s.conditional
        if inspect.Parameter.VAR_KEYWORD not in kinds and (unknown := sorted(passed - named)):
            problems.append(f"line {s.line}: {cls.__name__}.{s.target} takes no keyword {', '.join(unknown)}")
            passed = passed & named
        try:
            sig.bind(*[object()] * (s.positional + 1), **dict.fromkeys(passed, object()))  # + self
        except TypeError as e:
            problems.append(f"line {s.line}: {cls.__name__}.{s.target}: {e}")
    return problems


def _hybridep_block(tree: ast.Module) -> ast.If:
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "HAVE_HYBRIDEP":
            return node
    raise LookupError("megatron-core's fused_a2a has no top-level `if HAVE_HYBRIDEP:` block")


def megatron_wrappers(fused_a2a: ModuleType) -> dict[str, Any]:
    """Megatron's own ``hybrid_ep_*`` wrappers, defined in ``fused_a2a``'s namespace; module left as it was.

    Returns the names the ``if HAVE_HYBRIDEP:`` branch defines, mapped to the functions (whose
    globals are ``fused_a2a``'s, so they see its ``HybridEPDispatch`` and ``_hybrid_ep_buffer``).
    """
    path = Path(inspect.getfile(fused_a2a))
    block = _hybridep_block(ast.parse(path.read_text()))
    code = compile(ast.Module(body=block.body, type_ignores=[]), str(path), "exec")
    ns = vars(fused_a2a)
    names = [n.name for n in block.body if isinstance(n, ast.FunctionDef)]
    before = {n: ns[n] for n in names if n in ns}
    exec(code, ns)
    made = {n: ns[n] for n in names}
    for n in names:
        if n in before:
            ns[n] = before[n]
        else:
            del ns[n]
    return made
