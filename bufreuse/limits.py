"""The project's resource budgets: how much one command may read, expand, fork or allocate.

Every long or large path (a snapshot's trace, a host list, a log line, a YAML file, a worker pool,
a ring sized from options) checks its budget here before it spends the time or memory, so a hostile
or careless input ends in one ``error:`` line instead of an hour of swapping. A torch-free foundation
module: any layer may import it; it imports only :mod:`bufreuse.errors`.

Budgets are raised per run, never by editing code: ``bufreuse --limit max-trace-entries=20000000 ...``
on the command line, or ``BUFREUSE_LIMITS="max-trace-entries=20000000,max-hosts=100000"`` in the
environment (the flag wins). Library callers use :func:`override` or pass a :class:`Limits`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields

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
    max_trace_entries: int = 5_000_000
    """Allocator trace events read from one snapshot (a 1M-event snapshot is a few seconds)."""
    max_snapshot_bytes: int = 4 * 2**30
    """Bytes of one snapshot file, after decompression (4 GiB)."""
    max_log_line_bytes: int = 1 * 2**20
    """Characters of one log line; longer lines are cut there (a Megatron line is < 2 KiB)."""
    max_log_bytes: int = 16 * 2**30
    """Bytes read from one training log (16 GiB)."""
    max_yaml_aliases: int = 1000
    """YAML aliases in one config or site file (a 'billion laughs' file has millions)."""
    max_dim: int = 2**24
    """Largest single shape option: tokens, hidden, FFN, sequence length, micro-batch size (16,777,216)."""
    max_ring_slots: int = 1024
    """Slots of one ring (``--slots``); the sweeps that pay off use 2 to 12."""
    max_buffer_bytes: int = 2**40
    """Bytes one ring or benchmark buffer set may come to (slots x rows x columns x element size; 1 TiB)."""

    def replace(self, **changes: int) -> Limits:
        """A copy with ``changes`` applied (names with '-' or '_'); unknown names raise InputError."""
        return dataclasses.replace(self, **{_field_name(k): _positive(k, v) for k, v in changes.items()})


class BudgetExceededError(InputError):
    """An input needs more than a budget allows; names the budget, the value and how to raise it."""

    def __init__(self, budget: str, *, value: int | float | str, limit: int, what: str) -> None:
        self.budget = budget
        self.value = value
        self.limit = limit
        self.what = what
        shown = f"{value:,}" if isinstance(value, int) else str(value)
        super().__init__(
            f"{what}: {shown} exceeds the {budget} budget of {limit:,}; "
            f"raise it with {flag_for(budget)} if this is intended"
        )


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


def check(budget: str, value: int | float, *, what: str, limits: Limits | None = None) -> None:
    """Raise :class:`BudgetExceededError` if ``value`` is above the budget named ``budget``.

    Args:
        budget: a :class:`Limits` field name, e.g. ``"max_trace_entries"``.
        value: what the input needs (entries, bytes, hosts).
        what: where, for the message (``"snap.pickle: trace entries"``).
        limits: the budgets to check against (default :func:`current`).

    Raises:
        BudgetExceededError: ``value`` is above the budget.
    """
    limit = getattr(limits or current(), _field_name(budget))
    if value > limit:
        raise BudgetExceededError(_field_name(budget), value=value, limit=limit, what=what)


def flag_for(budget: str) -> str:
    """How a user raises ``budget``: ``--limit max-trace-entries=N`` (or ``$BUFREUSE_LIMITS``)."""
    return f"--limit {_field_name(budget).replace('_', '-')}=N (or {ENV_VAR})"


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


def _positive(name: str, value: int, *, source: str = "--limit") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{source} {name.replace('_', '-')}={value}: must be a whole number >= 1")
    return value
