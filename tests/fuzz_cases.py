"""Hostile and broken inputs for the fuzz suite: snapshot files, training logs and Megatron configs.

:func:`make_case` writes case ``i`` of a seeded run to a file (random bytes, truncated / bit-flipped
/ multi-member gzip, wrong schemas, pickles whose ``__reduce__`` would run a shell command, memo and
shared-reference bombs, deep nesting, real files mutated); :func:`run_case` sends it through what a
user would run (loading, analysis and rendering for snapshots; ``compare`` and ``check-config`` for
logs and configs) and names the outcome. Shared by ``tests/test_fuzz_snapshots.py`` (CI, small
scale) and ``scripts/fuzz_hostile.py`` (10,000+ cases, one process per case).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT_SEEDS = sorted((ROOT / "tests/data/snapshots").glob("*.pickle*")) + sorted(
    (ROOT / "examples/sweep-h200").glob("*/snapshot.pickle.gz")
)
LOG_SEEDS = [
    ROOT / "tests/data/logs" / name
    for name in ("slurm-2796012.out", "slurm-2796654.out", "cuda-graph-capture.log", "interleaved-partial.log")
]
CONFIG_SEEDS = sorted((ROOT / "tests/data/megatron").glob("*.yaml")) + sorted(
    (ROOT / "tests/data/megatron").glob("*.args")
)
BASE_LOG = ROOT / "tests/data/logs/slurm-2796012.out"

OUTCOMES = ("accepted", "rejected", "uncaught", "traceback", "executed")
MARKUP = ("[/]", "[bold red]x[/]", "[link=file:///etc]y", "$\\frac{1}{$", "[/bold]]", "\x1b[31mred\x1b[0m", "a\nb")


@dataclass(kw_only=True, slots=True)
class Case:
    index: int
    target: str  # "snapshot" | "log" | "config"
    kind: str
    path: Path


class _Evil:
    """Pickles into a call of ``func(*args)``: what a hostile snapshot would ask the loader to run."""

    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


_CACHE: dict[str, Any] = {}


def _seed_objects() -> list[tuple[bytes, Any]]:
    if "seeds" not in _CACHE:
        from bufreuse.analysis.snapshot.unpickle import loads_restricted

        out = []
        for p in SNAPSHOT_SEEDS:
            raw = p.read_bytes()
            out.append((raw, loads_restricted(raw)))
        _CACHE["seeds"] = out
    return _CACHE["seeds"]


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=1, mtime=0)


def _hostile_value(rng: random.Random) -> Any:
    choices: list[Any] = [
        10**5000, -1, 2**63, 2**64, 2**64 - 1, 2**62 + 7, -(2**63), float("nan"), float("inf"), 1.5, True, None,
        "", "x" * 100_000, b"bytes", [], [1, 2], {}, {"a": 1}, (1, 2), (2**70, -1), set(), frozenset({1}),
        [[[[[[[[[[1]]]]]]]]]], *MARKUP,
    ]  # fmt: skip
    return rng.choice(choices)


def _mutate_object(obj: Any, rng: random.Random, steps: int) -> Any:
    """Replace ``steps`` random nodes of a (copied) plain-data tree with hostile values."""
    obj = pickle.loads(pickle.dumps(obj))
    for _ in range(steps):
        node, parent_key, parent = obj, None, None
        for _depth in range(rng.randint(1, 7)):
            if isinstance(node, dict) and node:
                k = rng.choice(list(node))
            elif isinstance(node, list) and node:
                k = rng.randrange(len(node))
            else:
                break
            parent, parent_key, node = node, k, node[k]
        if parent is None:
            return _hostile_value(rng)
        if isinstance(parent, dict) and rng.random() < 0.15:
            del parent[parent_key]
        elif isinstance(parent, dict) and rng.random() < 0.1:
            parent[rng.choice(MARKUP)] = _hostile_value(rng)
        else:
            parent[parent_key] = _hostile_value(rng)
    return obj


def _walk_strings(obj: Any, rng: random.Random, keys: tuple[str, ...]) -> None:
    """Put markup into every ``keys`` string field of frames and entries (iterative, shallow data)."""
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k in keys and isinstance(v, str):
                    node[k] = v + rng.choice(MARKUP)
                elif isinstance(v, dict | list):
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(x for x in node if isinstance(x, dict | list))


def _set_sizes(obj: Any, value: int) -> None:
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("size", "total_size", "requested_size", "allocated_size", "active_size") and type(v) is int:
                    node[k] = value
                elif isinstance(v, dict | list):
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(x for x in node if isinstance(x, dict | list))


def _ref_bomb(kind: str, n: int) -> bytes:
    """A protocol-2 snapshot pickle whose trace, devices, segments or blocks are ``n`` shared references."""
    entry = {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "frames": []}
    if kind == "devices":
        item, where = [], "traces"
    elif kind == "segments":
        item, where = {"device": 0, "address": 0, "total_size": 2 << 20, "stream": 0, "blocks": []}, "segments"
    elif kind == "blocks":
        item, where = {"size": 512, "state": "active_allocated"}, "blocks"
    else:
        item, where = entry, "trace"
    body = pickle.dumps(item, protocol=2)[2:-1]
    rep = b"(" + b"h\xc8" * (n - 1) + b"e"  # MARK, BINGET 200 x (n-1), APPENDS

    def s(text: str) -> bytes:
        return b"X" + struct.pack("<I", len(text)) + text.encode()

    shared = b"]" + body + b"q\xc8a" + rep  # list, item (memo 200), append, appends
    if where == "trace":
        traces = b"]" + shared + b"a"
        segs = b"]"
    elif where == "traces":
        traces = shared
        segs = b"]"
    elif where == "segments":
        traces, segs = b"]", shared
    else:
        seg = b"}(" + s("total_size") + b"J\x00\x00\x20\x00" + s("blocks") + shared + b"u"
        traces, segs = b"]", b"]" + seg + b"a"
    return b"\x80\x02}(" + s("segments") + segs + s("device_traces") + traces + b"u."


_RAW_KINDS = ("memo_put", "memo_get", "len_unicode8", "len_bytes8", "len_binbytes", "long4", "deep", "deep_seg")


def _raw_pickle(rng: random.Random) -> tuple[str, bytes]:
    """Hand-written opcode streams: memo bombs, declared lengths past the end, deep nesting."""
    kind = rng.choice(
        ["memo_put", "memo_get", "len_unicode8", "len_bytes8", "len_binbytes", "long4", "deep", "deep_seg"]
    )
    if kind == "memo_put":
        return kind, b"\x80\x02]r" + struct.pack("<I", rng.choice([2**24, 2**27, 2**29, 2**31, 2**32 - 1])) + b"."
    if kind == "memo_get":
        return kind, b"\x80\x02j" + struct.pack("<I", rng.randrange(2**32)) + b"."
    if kind == "len_unicode8":
        return kind, b"\x80\x04\x8d" + struct.pack("<Q", rng.choice([2**31, 2**40, 2**63])) + b"abc."
    if kind == "len_bytes8":
        return kind, b"\x80\x04\x8e" + struct.pack("<Q", rng.choice([2**30, 2**36, 2**62])) + b"abc."
    if kind == "len_binbytes":
        return kind, b"\x80\x03B" + struct.pack("<I", 2**31 - 1) + b"xyz."
    if kind == "long4":
        return kind, b"\x80\x02\x8b" + struct.pack("<i", 2**31 - 1) + b"\x01\x02."
    depth = rng.choice([10_000, 100_000, 1_000_000])
    nest = b"]" * depth + b"a" * (depth - 1)
    if kind == "deep":
        return kind, b"\x80\x02" + nest + b"."
    s = b"X\x08\x00\x00\x00segments"
    return kind, b"\x80\x02}" + s + b"]}X\x06\x00\x00\x00blocks" + nest + b"sas."


def _exec_pickle(rng: random.Random, canary: Path) -> tuple[str, bytes]:
    import builtins
    import subprocess

    cmd = f"touch {canary}"
    evil = rng.choice(
        [
            _Evil(os.system, (cmd,)),
            _Evil(subprocess.call, (["touch", str(canary)],)),
            _Evil(builtins.exec, (f"open({str(canary)!r}, 'w').close()",)),
            _Evil(builtins.eval, (f"__import__('os').system({cmd!r})",)),
        ]
    )
    proto = rng.choice([0, 1, 2, 4, 5])
    where = rng.choice(["top", "action", "frames", "segment"])
    if where == "top":
        obj: Any = evil
    elif where == "action":
        obj = {"segments": [], "device_traces": [[{"action": evil, "addr": 1, "size": 1, "stream": 0}]]}
    elif where == "frames":
        obj = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 1, "frames": [evil]}]]}
    else:
        obj = {"segments": [evil]}
    data = pickle.dumps(obj, protocol=proto)
    if rng.random() < 0.2:  # the classic hand-written GLOBAL + REDUCE
        data = b"cos\nsystem\n(S'" + cmd.encode() + b"'\ntR."
    return f"exec_{where}_p{proto}", data


def snapshot_bytes(rng: random.Random, canary: Path, scale: float) -> tuple[str, bytes]:
    """One hostile snapshot file's bytes and its kind."""
    seeds = _seed_objects()
    raw, obj = rng.choice(seeds)
    plain = raw if raw[:2] != b"\x1f\x8b" else gzip.decompress(raw)
    r = rng.random()
    if r < 0.08:
        return "random_bytes", rng.randbytes(rng.randint(0, 4096))
    if r < 0.11:
        return "random_gzip", _gz(rng.randbytes(rng.randint(0, 4096)))
    if r < 0.13:
        return "pickle_header_junk", b"\x80" + bytes([rng.randint(0, 6)]) + rng.randbytes(rng.randint(0, 256))
    if r < 0.20:
        k = rng.randrange(len(raw))
        return "truncated_file", raw[:k]
    if r < 0.26:
        return "truncated_pickle_gz", _gz(plain[: rng.randrange(len(plain))])
    if r < 0.32:
        data = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return "bitflip_file", bytes(data)
    if r < 0.42:
        data = bytearray(plain)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return "bitflip_pickle", _gz(bytes(data)) if rng.random() < 0.5 else bytes(data)
    if r < 0.46:
        k = rng.randrange(len(plain))
        kind = rng.choice(["split", "junk_member", "junk_tail"])
        if kind == "split":
            return "multigzip_split", _gz(plain[:k]) + _gz(plain[k:])
        if kind == "junk_member":
            return "multigzip_junk", _gz(plain) + _gz(rng.randbytes(64))
        return "gzip_junk_tail", _gz(plain) + rng.randbytes(rng.randint(1, 64))
    if r < 0.62:
        mutated = _mutate_object(obj, rng, rng.randint(1, 4))
        data = pickle.dumps(mutated, protocol=rng.choice([2, 4, 5]))
        return "schema_mutation", _gz(data) if rng.random() < 0.5 else data
    if r < 0.66:
        wrong = rng.choice([[1, 2, 3], "str", 7, (1,), {1, 2}, {"segments": "x"}, {"device_traces": []}, [[1]], {}])
        return "wrong_top", pickle.dumps(wrong)
    if r < 0.71:
        copy = pickle.loads(pickle.dumps(obj))
        _walk_strings(copy, rng, ("name", "filename", "action", "state"))
        return "markup_strings", _gz(pickle.dumps(copy))
    if r < 0.74:
        copy = pickle.loads(pickle.dumps(obj))
        _set_sizes(copy, rng.choice([2**62, 2**62 + 3, 2**63 - 1, 2**63, 2**64 - 1]))
        return "huge_sizes", _gz(pickle.dumps(copy))
    if r < 0.80:
        return _exec_pickle(rng, canary)
    if r < 0.86:
        kind, data = _raw_pickle(rng)
        return kind, _gz(data) if rng.random() < 0.5 else data
    if r < 0.92:
        kind = rng.choice(["trace", "devices", "segments", "blocks"])
        n = {"trace": 9_000_000, "devices": 1_000_000, "segments": 10_000_000, "blocks": 10_000_000}[kind]
        n = max(2, int(n * scale))
        key = f"bomb_{kind}_{n}"
        if key not in _CACHE:
            _CACHE[key] = _gz(_ref_bomb(kind, n))
        return f"ref_bomb_{kind}", _CACHE[key]
    if r < 0.95:
        n = max(1 << 20, int((1 << 30) * scale))
        key = f"gzip_bomb_{n}"
        if key not in _CACHE:
            bomb = pickle.dumps({"segments": [], "device_traces": [], "pad": bytes(n)}, protocol=4)
            _CACHE[key] = gzip.compress(bomb, compresslevel=9, mtime=0)  # ~1000x: past GZIP_EXPANSION
        return "gzip_bomb", _CACHE[key]
    if r < 0.97:
        leaf: Any = {"filename": "x.py", "line": 1, "name": "f"}
        for _ in range(12):
            leaf = [leaf] * 10  # 10^12 frames if anything walked them
        copy = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 8, "frames": leaf}] * 3]}
        return "frame_laughs", _gz(pickle.dumps(copy))
    if r < 0.98:
        return "empty", b""
    return "real", raw


GRAMMAR_VALUES = ("nan", "inf", "1e400")
"""Number mutations only a log grammar can judge (``inf`` where an int belongs)."""


def log_bytes(rng: random.Random, scale: float) -> tuple[str, bytes]:
    seed = rng.choice(LOG_SEEDS).read_bytes()
    r = rng.random()
    if r < 0.12:
        return "random_bytes", rng.randbytes(rng.randint(1, 8192))
    if r < 0.2:
        return "gzip_log", _gz(seed if rng.random() < 0.7 else seed[: rng.randrange(len(seed) + 1)])
    if r < 0.3:
        data = bytearray(seed)
        for _ in range(rng.randint(1, 20)):
            data.insert(rng.randrange(len(data) + 1), rng.choice([0xFF, 0xC3, 0xE2, 0x80, 0xED]))
        return "invalid_utf8", bytes(data)
    if r < 0.38:
        n = rng.choice([2 << 20, int((8 << 20) * max(scale, 0.25))])
        return "huge_line", seed + b"iteration 1/ 10 | " + b"x" * n + b"\n"
    if r < 0.5:
        lines = seed.split(b"\n")
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(lines))
            mark = rng.choice(MARKUP).encode()
            lines[i] = lines[i] + mark  # glued to a figure ("64[/]"): only the grammar can judge it
        return "markup_lines", b"\n".join(lines)
    if r < 0.68:
        text = seed.decode("utf-8", "replace")
        out, digits = [], 0
        for ch in text:
            if ch.isdigit() and rng.random() < 0.02:
                values = ["9" * 5000, "-1", "0", "[/]", *GRAMMAR_VALUES]
                out.append(rng.choice(values))
                digits += 1
            else:
                out.append(ch)
        return "number_mutation", "".join(out).encode()
    if r < 0.78:
        return "truncated", seed[: rng.randrange(len(seed) + 1)]
    if r < 0.86:  # flipped digits ("71>8") are for the grammar to judge
        data = bytearray(seed)
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return "bitflip", bytes(data)
    if r < 0.9:
        return "nul_bytes", seed[:100] + b"\0" * 64 + seed[100:]
    if r < 0.94:
        return "many_lines", seed * max(1, int(2000 * scale))
    if r < 0.97:
        return "empty", b""
    return "real", seed


_YAML_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
)


def config_bytes(rng: random.Random, scale: float) -> tuple[str, bytes]:
    seed_path = rng.choice(CONFIG_SEEDS)
    seed = seed_path.read_bytes()
    r = rng.random()
    if r < 0.1:
        return "random_bytes", rng.randbytes(rng.randint(1, 4096))
    if r < 0.24:
        return "yaml_laughs", _YAML_LAUGHS.encode()
    if r < 0.27:  # rare: PyYAML takes most of a second to give up on these
        depth = rng.choice([1000, 1000 + int(50_000 * scale), 1000 + int(500_000 * scale)])
        return "deep_nesting", b"a: " + b"[" * depth + b"]" * depth + b"\n"
    if r < 0.34:
        return "deep_mapping", "".join("  " * i + f"k{i}:\n" for i in range(rng.choice([200, 3000]))).encode()
    if r < 0.42:
        data = bytearray(seed)
        for _ in range(rng.randint(1, 10)):
            data.insert(rng.randrange(len(data) + 1), rng.choice([0xFF, 0xC3, 0x80]))
        return "invalid_utf8", bytes(data)
    if r < 0.45:
        return "huge_file", b"# " + b"x" * int((17 << 20) * max(scale, 1.0)) + b"\n"
    if r < 0.47:
        return "nul_bytes", seed + b"\0\0\0"
    if r < 0.75:
        lines = seed.decode().split("\n")
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(lines))
            value = rng.choice(
                ["1e400", "-1", "9" * 5000, "[1, 2]", "{a: 1}", "'[/]'", "null", ".nan", ".inf", "'$x$'", "0", "true"]
            )
            if seed_path.suffix == ".args":
                head = lines[i].split(" ")[0] if lines[i].startswith("--") else "--num-experts"
                lines[i] = f"{head} {value}"
            else:
                key = lines[i].split(":")[0] if ":" in lines[i] else "num_moe_experts"
                lines[i] = f"{key}: {value}"
        return "value_mutation", "\n".join(lines).encode()
    if r < 0.82:
        return "markup_keys", seed + f"\n'{rng.choice(MARKUP)}': 1\n{9**3000}: x\n".encode()
    if r < 0.9:
        return "truncated", seed[: rng.randrange(len(seed) + 1)]
    if r < 0.95:
        return "args_junk", b"--num-experts 8 --hidden-size '[/]' --x \"unterminated\n"
    return "real", seed


def make_case(index: int, seed: int, folder: Path, canary: Path, *, scale: float = 1.0) -> Case:
    """Write case ``index`` of run ``seed`` into ``folder``; the mix is ~70% snapshots, 15% logs, 15% configs."""
    rng = random.Random(f"{seed}:{index}")
    r = rng.random()
    if r < 0.7:
        target, (kind, data), name = "snapshot", snapshot_bytes(rng, canary, scale), f"case{index}.pickle"
    elif r < 0.85:
        target, (kind, data), name = "log", log_bytes(rng, scale), f"case{index}.log"
    else:
        target, (kind, data), name = "config", config_bytes(rng, scale), f"case{index}.yaml"
        if kind in ("args_junk",) or (kind == "value_mutation" and data.startswith(b"--")):
            name = f"case{index}.args"
    path = folder / name
    path.write_bytes(data)
    return Case(index=index, target=target, kind=kind, path=path)


def _cli(args: list[str]) -> tuple[str, str]:
    """Run the CLI in-process; classify by exit code and stderr (one ``error:`` line for bad input)."""
    from typer.testing import CliRunner

    from bufreuse.cli import app

    res = CliRunner().invoke(app, args, env={"COLUMNS": "160", "BUFREUSE_CLI_DEBUG": "0"})
    out = (res.stdout or "") + (res.stderr or "")
    if "Traceback" in out:
        return "traceback", out[-400:]
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        return "uncaught", f"{type(res.exception).__name__}: {str(res.exception)[:300]}"
    err_lines = [ln for ln in (res.stderr or "").splitlines() if ln.strip()]
    if res.exit_code == 2:
        if len(err_lines) == 1 and err_lines[0].startswith("error:"):
            return "rejected", err_lines[0][:200]
        return "uncaught", f"exit 2 but stderr {len(err_lines)} lines: {(res.stderr or '')[:300]}"
    if res.exit_code in (0, 1) and "internal error" not in out:
        return "accepted", f"exit {res.exit_code}"
    return "uncaught", out[-400:]


def run_snapshot(path: Path, *, plot: bool) -> tuple[str, str]:
    """Load, analyse and render one snapshot as ``snapshot-report`` would (table, JSON, error line, plot)."""
    import json

    from rich.console import Console
    from rich.markup import escape

    from bufreuse.analysis.render.export import renderable_text
    from bufreuse.analysis.render.snapshot_tables import combined_table, file_renderable
    from bufreuse.analysis.snapshot import ReportConfig, analyze_file, combine

    res = analyze_file(str(path), ReportConfig(timeline_points=400 if plot else 0))
    if res.error is not None:
        console = Console(file=io.StringIO(), width=160)
        console.print(f"[bold red]error:[/] {escape(res.error)}", soft_wrap=True, highlight=False)
        text = console.file.getvalue()  # type: ignore[attr-defined]
        if res.exit_code != 2 or text.count("\n") != 1 or "\n" in res.error:
            return "uncaught", res.error[:300]
        return "rejected", res.error[:200]
    assert res.report is not None
    json.dumps(res.report, allow_nan=False)
    renderable_text(file_renderable(res.report), width=160)
    renderable_text(combined_table(combine([res, res])), width=160)
    if plot and res.timeline is not None:
        from bufreuse.analysis.render.export import png_bytes
        from bufreuse.analysis.render.plots import timeline_figure

        png_bytes(timeline_figure(res.timeline, title=str(path) + "[/]$x$"))
    return "accepted", f"{res.report['num_trace_events']} events"


def run_case(case: Case, canary: Path, *, plot: bool = False) -> tuple[str, str]:
    """The outcome of ``case`` (one of :data:`OUTCOMES`) and a short detail line."""
    try:
        if case.target == "snapshot":
            outcome, detail = run_snapshot(case.path, plot=plot)
        elif case.target == "log":
            outcome, detail = _cli(["compare", str(BASE_LOG), str(case.path)])
        else:
            outcome, detail = _cli(["check-config", str(case.path)])
    except BaseException as e:  # the point is to see anything escape
        outcome, detail = "uncaught", f"{type(e).__name__}: {str(e)[:300]}"
    if canary.exists():
        canary.unlink()
        return "executed", detail
    return outcome, detail
