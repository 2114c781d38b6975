"""Name where a block was allocated (its site) and which buffer it is (its category), from frames.

Only the frames of a block's ``alloc`` entry are used (never those of its free), and only for the
few blocks a report names, so the cost grows with the named blocks, not with the events.

- site: the N-th "user" frame, ``path:line:function`` with the path cut to its last two parts;
  only Python frames can be one (a ``.py`` file, or an IPython cell, with a line above 0): the C++
  frames torch records by default (``stacks="all"``: ``??``, ``memory_snapshot.cpp``,
  ``CUDACachingAllocator.cpp``, empty names, line 0) never are, and Python frames from torch, the
  standard library, ``<frozen ...>`` and ``bufreuse/pool`` are skipped (the ring's own allocation
  frames would hide who asked for it). Windows paths (``torch\functional.py``) are read with ``/``.
- category: the first rule whose regex is found in a ``filename:name`` line of the stack. The
  built-in MoE rules read only the user Python frames (so ``at::indexing::dispatch_index`` or
  ipykernel's ``dispatch_shell`` are not a dispatch buffer); user rules read every frame, C++ too.

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
    "NO_FRAMES_SITE",
    "RING_CATEGORIES",
    "UNKNOWN_SITE",
    "SiteRules",
    "parse_category_options",
]

_MOE_FILES = r"token_dispatcher|hybrid_ep|fused_a2a|grouped_linear|GroupedMLP|SequentialMLP|experts|moe_utils"
BUILTIN_CATEGORIES: dict[str, str] = {
    "moe_other": rf"({_MOE_FILES})[^\n]*:(backward\w*|\w*combine\w*|\w*unpermute\w*)$",
    "dispatch_output": r"token_dispatcher|hybrid_ep|fused_a2a|dispatch_with_permute|:\w*dispatch(_tokens?)?$",
    "expert_output": r"grouped_linear|GroupedMLP|SequentialMLP|TEGroupedMLP|expert_fc2",
}
"""The two MoE buffers the rings replace (the shared contract; user rules come first), after ``moe_other``.

Matched line by line (``re.M``) on ``filename:name`` of user Python frames only: a function named
``dispatch``, ``*_dispatch`` or ``*dispatch_tokens``, or a Megatron/TE MoE file or class. ``moe_other``
is tried first: a block allocated under a MoE file's autograd ``backward`` (gradients: GroupedLinear's dgrad,
HybridEP's backward dispatch and combine) or in a combine / unpermute (the combine's output) is MoE memory
that no ring replaces, so it is never counted as ``dispatch_output`` or ``expert_output``."""
RING_CATEGORIES = ("dispatch_output", "expert_output")
"""The categories a ring replaces (what ``advise`` and the A/B summaries count as removable)."""

_PY_FILE = re.compile(r"(\.pyw?$|^<ipython-input-)", re.I)
_WIN_STDLIB = r"(?i:(^|/)python3\d*/lib/)(?!site-packages/)"  # C:/Python311/Lib/threading.py
_STDLIB = re.escape(sysconfig.get_paths()["stdlib"].rstrip("/") + "/")
DEFAULT_SITE_SKIP: tuple[str, ...] = (
    r"(^|/)torch/",  # torch internals (site-packages/torch/..., a source checkout's torch/...)
    r"^<frozen ",
    r"(^|/)lib/python3\.\d+/(?!site-packages/|dist-packages/)",  # any stdlib, not only this Python's
    _STDLIB + r"(?!site-packages/)",
    r"(^|/)bufreuse/pool(\.py$|/)",
    r"^\?\?$|^$",  # frames without a file
    _WIN_STDLIB,
)
UNKNOWN_SITE = "<no user frame>"
NO_FRAMES_SITE = "<no frames>"
"""A block whose alloc carries no frame at all (recorded without stacks): what it is cannot be read."""
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
    _cats: list[tuple[str, re.Pattern[str], bool]] = field(init=False, repr=False)  # name, regex, user rule
    _moe: re.Pattern[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.site_frame < 0:
            raise ValueError(f"site_frame must be >= 0, got {self.site_frame}")
        self._skip = re.compile("|".join(f"(?:{p})" for p in (*DEFAULT_SITE_SKIP, *self.site_skip)))
        self._cats = [(name, re.compile(rx, re.M), True) for name, rx in self.categories.items()]
        self._cats += [
            (name, re.compile(rx, re.M), False)
            for name, rx in BUILTIN_CATEGORIES.items()
            if name not in self.categories
        ]
        self._moe = re.compile("|".join(f"(?:{BUILTIN_CATEGORIES[c]})" for c in RING_CATEGORIES), re.M)

    @property
    def category_names(self) -> list[str]:
        return [name for name, _, _ in self._cats]

    @property
    def ring_category_names(self) -> list[str]:
        """The categories a ring can take: user rules, then ``dispatch_output`` and ``expert_output``.

        What ``what-if`` and ``advise`` model as rings by default; ``moe_other`` (gradients, combine outputs)
        is reported, never ringed.
        """
        return [name for name, _, user in self._cats if user or name in RING_CATEGORIES]

    def user_frame(self, f: Any) -> tuple[str, str, str] | None:
        """``(path, line, name)`` of a frame that can be a site (a user Python frame), else None."""
        if not isinstance(f, dict):
            return None
        filename = clean_text(f.get("filename"), "").replace("\\", "/")
        line = f.get("line")
        if not _PY_FILE.search(filename) or (type(line) is int and line <= 0) or self._skip.search(filename):
            return None
        line_text = str(line) if type(line) is int and 0 < line < U64 else "?"
        return filename, line_text, clean_text(f.get("name"))

    def is_moe_frame(self, f: Any) -> bool:
        """A user Python frame that a built-in MoE rule matches (what a ring needs to be built from)."""
        u = self.user_frame(f)
        return u is not None and self._moe.search(f"{u[0]}:{u[2]}") is not None

    def site(self, frames: Any) -> str:
        """The configured user frame of ``frames`` (innermost first, as torch records them)."""
        if not isinstance(frames, list):
            return UNKNOWN_SITE
        k = self.site_frame
        for f in frames[:MAX_FRAMES]:
            u = self.user_frame(f)
            if u is None:
                continue
            if k == 0:
                return f"{'/'.join(u[0].rsplit('/', 2)[-2:])}:{u[1]}:{u[2]}"
            k -= 1
        return UNKNOWN_SITE

    def category(self, frames: Any) -> str:
        """The first category whose regex matches a ``filename:name`` line, else ``other`` (module docstring)."""
        if not isinstance(frames, list):
            return "other"
        every, python = [], []
        for f in frames[:MAX_FRAMES]:
            if not isinstance(f, dict):
                continue
            every.append(f"{clean_text(f.get('filename'), '').replace(chr(92), '/')}:{clean_text(f.get('name'), '')}")
            u = self.user_frame(f)
            if u is not None:
                python.append(f"{u[0]}:{u[2]}")
        text_all, text_py = "\n".join(every), "\n".join(python)
        for name, rx, user in self._cats:
            if rx.search(text_all if user else text_py):
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
