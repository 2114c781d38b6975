"""The rings' hot path in C (``hotpath.c``): built once per machine and Python, loaded when it builds.

Standard library only (no torch): :mod:`bufreuse.pool` and :mod:`bufreuse.integrations` derive their hot
classes from its struct types and call its functions; nothing here knows either.

The extension uses only the Python C API (no torch headers), so it compiles in about a second with the C
compiler Python was built with (else ``cc``, ``gcc``; ``$CC`` overrides), against whatever torch is installed.
It is built on first use into a cache folder (``BUFREUSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/bufreuse``, else
``~/.cache/bufreuse``), named by a hash of the source, the interpreter and the compiler command, written
atomically, and loaded from there afterwards. No compiler, a failed build or load, or ``BUFREUSE_NATIVE=0``: the
Python hot path runs, which does the same steps (the C code falls back to it for everything but the common
case), and :func:`status` says why.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

__all__ = ["SOURCE", "build", "hotpath", "native_base", "status"]

_log = logging.getLogger("bufreuse.pool")

SOURCE = Path(__file__).with_name("hotpath.c")
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    explicit = os.environ.get("BUFREUSE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "bufreuse"


def _flags() -> list[str]:
    flags = ["-O2", "-fPIC", "-shared"]
    if sys.platform == "darwin":  # the interpreter resolves the C API's symbols at load time
        flags += ["-undefined", "dynamic_lookup"]
    return flags


def _target(source: bytes, cc: list[str]) -> Path:
    key = b"\0".join([source, sys.version.encode(), " ".join([*cc, *_flags()]).encode()])
    digest = hashlib.sha256(key).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return _cache_dir() / f"_hotpath-{digest}{suffix}"


def build(target: Path | None = None) -> Path:
    """Compile ``hotpath.c`` for this interpreter into ``target`` (default: the cache); its path.

    The cache name covers the source, the interpreter and the compiler command, so a build is reused only for the
    same three. Each compiler candidate is tried in turn (:func:`_compilers`) until one builds.

    Raises:
        RuntimeError: no compiler builds it, or no Python headers (the last compiler's output in the message).
    """
    source = SOURCE.read_bytes()  # compiled from this copy: the cache name and the build are of the same text
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        raise RuntimeError(f"no Python.h in {include} (install the Python development headers)")
    why = "no C compiler"
    for cc in _compilers():
        path = _target(source, cc) if target is None else target
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=path.parent) as tmp:
            src, out = Path(tmp, "hotpath.c"), Path(tmp, path.name)
            src.write_bytes(source)
            cmd = [*cc, *_flags(), f"-I{include}", str(src), "-o", str(out)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=60)
            except (OSError, subprocess.SubprocessError) as e:
                why = f"cannot run the C compiler {cc[0]!r}: {e}"
                continue
            if done.returncode != 0:
                why = f"{' '.join(cmd)} failed: {(done.stderr or done.stdout).strip()[-2000:]}"
                continue
            out.chmod(0o755)  # as pip installs extensions: usable by whoever shares the cache
            os.replace(out, path)  # atomic: a concurrent build or import sees all of it or nothing
        return path
    raise RuntimeError(why)


def _compilers() -> list[list[str]]:
    """``$CC`` alone when set; else the compiler Python was built with, then ``cc`` and ``gcc`` (a conda Python
    may name a compiler that is not on the machine)."""
    try:
        if os.environ.get("CC"):
            return [shlex.split(os.environ["CC"])]
        out = [shlex.split(c) for c in (sysconfig.get_config_var("CC"), "cc", "gcc") if c]
    except ValueError as e:  # unbalanced quotes in $CC or sysconfig's CC
        raise RuntimeError(f"cannot parse the C compiler command: {e}") from e
    return [c for i, c in enumerate(out) if c and c not in out[:i]]


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("bufreuse.native._hotpath", str(path))
    spec = importlib.util.spec_from_file_location("bufreuse.native._hotpath", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def hotpath() -> ModuleType | None:
    """The C hot path, built and loaded on first call; None when off or unavailable (:func:`status`)."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    module = None
    if os.environ.get("BUFREUSE_NATIVE", "1") == "0":
        _state["why"] = "off (BUFREUSE_NATIVE=0)"
    else:
        try:
            module = _load(build())
            _state["why"] = "on"
        except Exception as e:  # whatever the build or load raised: the Python path runs, and status() says why
            text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            _state["why"] = f"unavailable: {text}"
            _log.info("bufreuse: the C hot path is %s; the Python one runs", _state["why"])
    _state["module"] = module
    return module


def native_base(name: str) -> type:
    """The C struct type ``name`` (``Slot``, ``Ring``, ...) a pool class derives from, or ``object`` without the
    extension: the class then declares its fields as ``__slots__`` (or a ``__dict__``) itself.

    Decided once, when the class is defined (the first import of :mod:`bufreuse.pool` builds the extension).
    """
    module = hotpath()
    return object if module is None else getattr(module, name)


def status() -> str:
    """``"on"``, ``"off (BUFREUSE_NATIVE=0)"`` or ``"unavailable: <why>"`` (builds on first call)."""
    hotpath()
    return str(_state["why"])


def _reset() -> None:
    """Forget the loaded state (tests switching ``BUFREUSE_NATIVE``; a loaded extension stays in memory)."""
    _state.clear()
