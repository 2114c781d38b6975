"""The project's resource budgets: how much one command may read, expand, fork or allocate.

Every long or large path (a snapshot file and its trace, a host list, a log line, a YAML file, a
worker pool, a ring sized from options) checks its budget here before it spends the time or memory,
so a hostile or careless input ends in one ``error:`` line instead of an hour of swapping. The one
budget mechanism of the project: the snapshot loader's budgets are fields here too (its helpers in
:mod:`bufreuse.analysis.snapshot.budget` read them). A torch-free foundation module: any layer may
import it; it imports only :mod:`bufreuse.errors`.

Budgets are raised per run, never by editing code: ``bufreuse --limit max-trace-entries=20000000 ...``
on the command line, or ``BUFREUSE_LIMITS="max-trace-entries=20000000,max-hosts=100000"`` in the
environment (the flag wins); ``snapshot-report`` also takes shorthands (``--max-trace-entries N``)
that set the same fields. Library callers use :func:`override` or pass a :class:`Limits` (worker
processes get the object itself: the :func:`override` context does not cross processes).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import ClassVar

from bufreuse.errors import InputError

__all__ = [
    "ENV_VAR",
    "BudgetExceededError",
    "Limits",
    "check",
    "current",
    "flag_for",
    "override",
    "parse_overrides",
]

ENV_VAR = "BUFREUSE_LIMITS"
"""Environment variable of comma-separated ``NAME=VALUE`` budget overrides."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Limits:
    """Resource budgets; each field is raised with ``--limit NAME=VALUE`` (NAME with '-' or '_')."""

    max_hosts: int = 4096
    """Host names one SLURM host list may expand to; larger lists are kept as ranges and counted."""
    max_workers: int = 64
    """Worker processes one command may fork (never more than the files or the CPUs either)."""
    max_trace_entries: int = 8_000_000
    """Allocator trace entries of one snapshot, all devices (5M-entry recordings fit; 1M load in seconds)."""
    max_file_bytes: int = 4 * 2**30
    """Bytes of one snapshot file on disk (4 GiB)."""
    max_pickle_bytes: int | None = None
    """Bytes of a snapshot's pickle after gzip decompression: stops gzip bombs. None (auto): 200 x the
    gzip file + 64 MiB, at most 64 GiB (real snapshots compress 5-30x)."""
    max_blocks: int = 2_000_000
    """Segments plus blocks in one snapshot's final state."""
    max_memory_bytes: int = 1536 * 2**20
    """Memory loading and analysing one snapshot may add, whatever its size (1.5 GiB: a 1M-entry trace fits);
    a file that needs more is refused (raise it for bigger recordings), so no hostile file can take the machine."""
    max_log_line_bytes: int = 1 * 2**20
    """Characters of one log line; a log with a longer line is refused (Megatron's longest, the argument
    dump, is tens of KiB)."""
    max_log_bytes: int = 4 * 2**30
    """Bytes read from one training log, after gzip decompression (4 GiB; a month-long run is a few hundred MiB)."""
    max_log_iterations: int = 1_000_000
    """Iteration lines one training log may hold, every rank's copy counted (a month-long run logging every
    iteration has a few hundred thousand). A row costs 38-90 bytes while read (38 for Megatron-LM's usual
    line), a compared run keeps 16 a window: two 3,000,000-line logs compare in under 300 MB."""
    max_yaml_aliases: int = 1000
    """YAML aliases in one config or site file (a 'billion laughs' file has millions)."""
    max_dim: int = 2**24
    """Largest single shape option: tokens, hidden, FFN, sequence length, micro-batch size (16,777,216)."""
    max_ring_slots: int = 1024
    """Slots of one ring (``--slots``); the sweeps that pay off use 2 to 12."""
    max_pipeline_stages: int = 512
    """Pipeline stages, and virtual stages per rank, one schedule may have (``plan``, ``sweep --slots plan``)."""
    max_schedule_steps: int = 65_536
    """Microbatches x virtual stages ``plan`` simulates (each costs ~1.7 KB and ~0.1 ms; a global batch of
    16,384 at micro-batch 1 and data-parallel 4 with VPP 16 is 65,536)."""
    max_buffer_bytes: int = 2**40
    """Bytes one ring or benchmark buffer set may come to (slots x rows x columns x element size; 1 TiB)."""

    def replace(self, **changes: int | None) -> Limits:
        """A copy with ``changes`` applied (names with '-' or '_'); unknown names raise InputError."""
        return dataclasses.replace(self, **{_field_name(k): _positive(k, v) for k, v in changes.items()})


class BudgetExceededError(InputError):
    """An input needs more than a budget allows; names the budget, the value and how to raise it.

    ``SHORTHANDS`` (subclasses) maps a budget to a command's own flag that raises it too. Pickles
    across processes (snapshot workers send it back): it is rebuilt from its fields.
    """

    SHORTHANDS: ClassVar[dict[str, str]] = {}

    def __init__(self, budget: str, *, value: int | float | str, limit: int, what: str) -> None:
        self.budget = budget
        self.value = value
        self.limit = limit
        self.what = what
        shown = f"{value:,} exceeds" if isinstance(value, int) else f"{value}, over"
        super().__init__(
            f"{what}: {shown} the {budget} budget of {limit:,}; "
            f"raise it with {flag_for(budget, shorthand=self.SHORTHANDS.get(budget))} if this is intended"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.budget, self.value, self.limit, self.what))


def _rebuild(
    cls: type[BudgetExceededError], budget: str, value: int | float | str, limit: int, what: str
) -> BudgetExceededError:
    return cls(budget, value=value, limit=limit, what=what)


_override: contextvars.ContextVar[Limits | None] = contextvars.ContextVar("bufreuse_limits", default=None)


def current() -> Limits:
    """The budgets in force: :func:`override` if active, else the defaults with ``$BUFREUSE_LIMITS`` applied."""
    active = _override.get()
    if active is not None:
        return active
    env = os.environ.get(ENV_VAR, "").strip()
    return Limits().replace(**parse_overrides(env.split(","), source=ENV_VAR)) if env else Limits()


@contextlib.contextmanager
def override(limits: Limits | None = None, **changes: int) -> Iterator[Limits]:
    """Run the block with ``limits`` (default: the current ones) plus ``changes`` in force."""
    new = (limits or current()).replace(**changes)
    token = _override.set(new)
    try:
        yield new
    finally:
        _override.reset(token)


def check(
    budget: str,
    value: int | float,
    *,
    what: str,
    limits: Limits | None = None,
    error: type[BudgetExceededError] = BudgetExceededError,
) -> None:
    """Raise ``error`` (a :class:`BudgetExceededError`) if ``value`` is above the budget named ``budget``.

    Args:
        budget: a :class:`Limits` field name, e.g. ``"max_trace_entries"``.
        value: what the input needs (entries, bytes, hosts).
        what: where, for the message (``"snap.pickle: trace entries"``).
        limits: the budgets to check against (default :func:`current`).
        error: the class raised (a subclass may also be a format error and name a shorthand flag).

    Raises:
        BudgetExceededError: ``value`` is above the budget.
    """
    limit = getattr(limits or current(), _field_name(budget))
    if limit is not None and value > limit:
        raise error(_field_name(budget), value=value, limit=limit, what=what)


def flag_for(budget: str, *, shorthand: str | None = None) -> str:
    """How a user raises ``budget``: ``--limit max-trace-entries=N`` (or a command's ``shorthand``, or the env)."""
    main = f"--limit {_field_name(budget).replace('_', '-')}=N"
    return f"{main} (or {shorthand} N, or {ENV_VAR})" if shorthand else f"{main} (or {ENV_VAR})"


def parse_overrides(items: Iterable[str], *, source: str = "--limit") -> dict[str, int]:
    """``["max-hosts=100000", ...]`` to ``{"max_hosts": 100000}``; bad items raise InputError."""
    out: dict[str, int] = {}
    for item in items:
        item = item.strip()
        if not item:
            continue
        key, sep, raw = item.partition("=")
        if not sep:
            raise InputError(f"{source} {item!r}: expected NAME=VALUE, NAME one of {', '.join(_names())}")
        name = _field_name(key.strip(), source=source)
        try:
            value = int(raw.strip().replace("_", ""))
        except ValueError:
            raise InputError(f"{source} {item!r}: VALUE must be a whole number") from None
        out[name] = _positive(name, value, source=source)
    return out


def _names() -> list[str]:
    return [f.name.replace("_", "-") for f in fields(Limits)]


def _field_name(key: str, *, source: str = "--limit") -> str:
    name = key.replace("-", "_")
    if name not in {f.name for f in fields(Limits)}:
        raise InputError(f"{source}: unknown budget {key!r}; known: {', '.join(_names())}")
    return name


_AUTO = frozenset({"max_pickle_bytes"})
"""Fields whose default is None: computed from the input (see the field's docstring)."""


def _positive(name: str, value: int | None, *, source: str = "--limit") -> int | None:
    if value is None and _field_name(name) in _AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{source} {name.replace('_', '-')}={value}: must be a whole number >= 1")
    return value
