"""Name where a block was allocated (its site) and which buffer it is (its category), from frames.

Only the frames of a block's ``alloc`` entry are used (never those of its free), and only for the
few blocks a report names, so the cost grows with the named blocks, not with the events.

- site: the N-th "user" frame, ``path:line:function`` with the path cut to its last two parts;
  frames from torch, the standard library, ``<frozen ...>`` and ``bufreuse/pool`` are skipped
  (the ring's own allocation frames would hide who asked for it).
- category: the first rule whose regex is found in any ``filename:name`` of the whole stack.

Frames come from an untrusted file: only the first ``MAX_FRAMES`` of a stack are read, fields that
are not strings (or ints, for lines) read as ``?``, and long names are cut to ``MAX_TEXT``.
"""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bufreuse.analysis.snapshot.validate import MAX_FRAMES, U64, clean_text

__all__ = [
    "BEFORE_TRACE_SITE",
    "BUILTIN_CATEGORIES",
    "DEFAULT_SITE_SKIP",
    "UNKNOWN_SITE",
    "SiteRules",
    "parse_category_options",
]

BUILTIN_CATEGORIES: dict[str, str] = {
    "dispatch_output": r"token_dispatcher|hybrid_ep|fused_a2a|dispatch_with_permute|[:._]dispatch",
    "expert_output": r"grouped_linear|GroupedMLP|SequentialMLP|TEGroupedMLP|expert_fc2",
}
"""The two MoE buffers the rings replace (the shared contract; user rules come first)."""

_STDLIB = re.escape(sysconfig.get_paths()["stdlib"].rstrip("/") + "/")
DEFAULT_SITE_SKIP: tuple[str, ...] = (
    r"(^|/)torch/",  # torch internals (site-packages/torch/..., a source checkout's torch/...)
    r"^<frozen ",
    r"(^|/)lib/python3\.\d+/(?!site-packages/|dist-packages/)",  # any stdlib, not only this Python's
    _STDLIB + r"(?!site-packages/)",
    r"(^|/)bufreuse/pool(\.py$|/)",
    r"^\?\?$|^$",  # frames without a file
)
UNKNOWN_SITE = "<no user frame>"
BEFORE_TRACE_SITE = "<alloc not in trace>"


@dataclass(kw_only=True, slots=True)
class SiteRules:
    """How sites and categories are read from frames (all regexes use ``re.search``)."""

    site_frame: int = 0
    """Which user frame names the site: 0 = the innermost user frame, 1 = its caller, ..."""
    site_skip: Sequence[str] = ()
    """Extra regexes on a frame's filename; matching frames are not user frames."""
    categories: Mapping[str, str] = field(default_factory=dict)
    """User rules ``name -> regex`` tried before the built-in ones (same name replaces a built-in)."""
    _skip: re.Pattern[str] = field(init=False, repr=False)
    _cats: list[tuple[str, re.Pattern[str]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.site_frame < 0:
            raise ValueError(f"site_frame must be >= 0, got {self.site_frame}")
        self._skip = re.compile("|".join(f"(?:{p})" for p in (*DEFAULT_SITE_SKIP, *self.site_skip)))
        merged = {**dict(self.categories), **{k: v for k, v in BUILTIN_CATEGORIES.items() if k not in self.categories}}
        self._cats = [(name, re.compile(rx)) for name, rx in merged.items()]

    @property
    def category_names(self) -> list[str]:
        return [name for name, _ in self._cats]

    def site(self, frames: Any) -> str:
        """The configured user frame of ``frames`` (innermost first, as torch records them)."""
        if not isinstance(frames, list):
            return UNKNOWN_SITE
        k = self.site_frame
        for f in frames[:MAX_FRAMES]:
            if not isinstance(f, dict):
                continue
            filename = clean_text(f.get("filename"), "")
            if self._skip.search(filename):
                continue
            if k == 0:
                short = "/".join(filename.rsplit("/", 2)[-2:])
                line = f.get("line")
                line_text = str(line) if type(line) is int and 0 <= line < U64 else "?"
                return f"{short}:{line_text}:{clean_text(f.get('name'))}"
            k -= 1
        return UNKNOWN_SITE

    def category(self, frames: Any) -> str:
        """The first category whose regex matches any ``filename:name`` of the stack, else ``other``."""
        if not isinstance(frames, list):
            return "other"
        text = "\n".join(
            f"{clean_text(f.get('filename'), '')}:{clean_text(f.get('name'), '')}"
            for f in frames[:MAX_FRAMES]
            if isinstance(f, dict)
        )
        for name, rx in self._cats:
            if rx.search(text):
                return name
        return "other"


def parse_category_options(options: Sequence[str]) -> dict[str, str]:
    """``["name=regex", ...]`` → dict; raises ``ValueError`` naming the bad option."""
    out: dict[str, str] = {}
    for opt in options:
        name, sep, rx = opt.partition("=")
        if not sep or not name.strip() or not rx:
            raise ValueError(f"--category must be NAME=REGEX, got {opt!r}")
        try:
            re.compile(rx)
        except re.error as e:
            raise ValueError(f"--category {name}: bad regex {rx!r} ({e})") from None
        out[name.strip()] = rx
    return out
