"""Slot counts written as plans: ``plan``, ``plan+2`` (for ``bufreuse sweep --slots``), and the proxy's order.

The sweep's proxy (``bufreuse.bench.schedule.MoEProxy.step``) is forward-only and issues the next
microbatch's dispatch before this one's experts::

    comm:    D0 D1 C0 D2 C1 ...      compute: E0 E1 E2 ...

so its dispatch ring holds two acquisitions (``D(i+1)`` before ``E(i)`` releases ``D(i)``) and its
expert ring one: :func:`proxy_ops` writes that order as :class:`~bufreuse.plan.ops.Op` for the depth
and hazard models.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from bufreuse import limits
from bufreuse.errors import InputError
from bufreuse.plan.depth import ring_depths
from bufreuse.plan.ops import COMM, COMPUTE, Acq, Op

__all__ = ["proxy_minimum", "proxy_ops", "resolve_slot_spec"]

_SPEC = re.compile(r"^plan(?:\s*([+-])\s*(\d+))?$")


def proxy_ops(microbatches: int, buffers: Iterable[str] = ("dispatch", "expert")) -> list[Op]:
    """The proxy's step as stream operations (one chunk, one layer, ``microbatches`` forwards)."""
    bufs = set(buffers)
    ops: list[Op] = []

    def add(stream: str, name: str, mb: int, **kw: tuple[Acq, ...]) -> None:
        ops.append(Op(len(ops), mb, stream, name, mb, 0, 0, **kw))

    def d(mb: int) -> tuple[Acq, ...]:
        return (("dispatch", 0, mb, 0, 0),) if "dispatch" in bufs else ()

    def e(mb: int) -> tuple[Acq, ...]:
        return (("expert", 0, mb, 0, 0),) if "expert" in bufs else ()

    if microbatches >= 1:
        add(COMM, "dispatch.fwd", 0, acquires=d(0))
    for i in range(microbatches):
        if i + 1 < microbatches:
            add(COMM, "dispatch.fwd", i + 1, acquires=d(i + 1))
        add(COMPUTE, "experts.fwd", i, reads=d(i), acquires=e(i), releases=d(i))
        add(COMM, "combine.fwd", i, reads=e(i), releases=e(i))
    return ops


def proxy_minimum(microbatches: int, buffers: Iterable[str] = ("dispatch", "expert")) -> int:
    """Smallest slot count that runs the proxy with one count for every buffer in ``buffers``.

    Raises:
        BudgetExceededError: ``microbatches`` over the ``max_schedule_steps`` budget (``sweep --slots plan``).
    """
    limits.check("max_schedule_steps", microbatches, what=f"schedule steps ({microbatches:,} proxy microbatches)")
    depths = ring_depths(proxy_ops(microbatches, buffers))
    return max((dep.peak for dep in depths.values()), default=1)


def resolve_slot_spec(text: str, minimum: int | Callable[[], int], *, option: str = "--slots") -> int:
    """``"plan"`` -> the planned minimum, ``"plan+2"`` -> two more, ``"7"`` -> 7.

    ``minimum`` may be a callable, evaluated only when a ``plan`` spec needs it. Raises ``InputError``
    for anything else or a negative result.
    """
    token = text.strip().lower()
    if token.isdigit():
        return int(token)
    match = _SPEC.match(token)
    if match is None:
        raise InputError(f"{option} {text!r}: expected an integer, 'plan' or 'plan+N' / 'plan-N'")
    base = minimum() if callable(minimum) else int(minimum)
    sign, n = match.groups()
    value = base + (int(n) if sign == "+" else -int(n) if sign == "-" else 0)
    if value < 0:
        raise InputError(f"{option} {text!r}: the plan is {base} slot(s), so this is {value}")
    return value
