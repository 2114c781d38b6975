"""SLURM host lists (``node[01-04,07],gpu-a[1-2]``) as bounded sets: compressed first, expanded only when small.

A log line or a ``metrics.json`` / ``job.json`` field can name any number of hosts
(``n[0-999999999]``); expanding that would take minutes and gigabytes. :func:`parse_hostlist`
merges each bracket's ranges, counts the hosts from the ranges, and materialises the names only
up to the ``max_hosts`` budget of :class:`bufreuse.limits.Limits` (default 4,096, raised with
``--limit max-hosts=N``). Larger sets stay compressed: they compare by their canonical expression
and are described as ``n[0-999999999] (10^9 hosts)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bufreuse.limits import Limits, current, flag_for

__all__ = ["MAX_EXPANDED_HOSTS", "HostSet", "expand_hostlist", "hosts_from_names", "parse_hostlist"]

MAX_EXPANDED_HOSTS = Limits().max_hosts
"""The default ``max_hosts`` budget (an alias: the budget in force is ``bufreuse.limits.current().max_hosts``)."""

_Range = tuple[int, int, int]  # (lo, hi, width): zero-padded to ``width`` digits


@dataclass(frozen=True, slots=True)
class HostSet:
    """A set of hosts: its canonical compressed expression, its size, and the names when small."""

    expr: str
    count: int
    hosts: tuple[str, ...] | None
    """The names in list order (duplicates removed), or None when ``count`` is over the ``max_hosts`` budget."""

    def describe(self) -> str:
        """``pool0-[0001-0032] (32 hosts)``, ``n[0-999999999] (10^9 hosts)``."""
        return f"{self.expr} ({_count_text(self.count)} host{'s' if self.count != 1 else ''})"

    def same_as(self, other: HostSet) -> bool:
        """Equal sets: by name when both are expanded, else by canonical expression."""
        if self.hosts is not None and other.hosts is not None:
            return set(self.hosts) == set(other.hosts)
        return self.expr == other.expr and self.count == other.count

    def shared(self, other: HostSet) -> tuple[int, int] | None:
        """(hosts in both, hosts in either) when both are expanded, else None (not computed)."""
        if self.hosts is None or other.hosts is None:
            return None
        a, b = set(self.hosts), set(other.hosts)
        return len(a & b), len(a | b)


def parse_hostlist(expr: str, *, limits: Limits | None = None) -> HostSet:
    """Parse a SLURM host list without expanding more names than ``max_hosts`` (``limits``, default: in force).

    Raises:
        ValueError: unbalanced brackets or a malformed range.
    """
    text = expr.strip().strip("\"'")
    parts = [_parse_part(p) for p in _split_top(text)]
    count = sum(_part_count(p) for p in parts)
    canonical = ",".join(sorted({_part_text(p) for p in parts}))
    if count > (limits or current()).max_hosts:
        return HostSet(expr=canonical, count=count, hosts=None)
    names = list(dict.fromkeys(name for p in parts for name in _part_names(p)))
    return HostSet(expr=canonical, count=len(names), hosts=tuple(names))


def hosts_from_names(names: Iterable[str]) -> HostSet:
    """A host set from names already listed (``job.json``'s ``nodes`` list)."""
    unique = list(dict.fromkeys(str(n) for n in names))
    return HostSet(expr=",".join(sorted(unique)), count=len(unique), hosts=tuple(unique))


def expand_hostlist(expr: str, *, limit: int | None = None) -> list[str]:
    """Expand a SLURM host list into host names (zero padding kept), at most ``limit`` (default ``max_hosts``).

    Raises:
        ValueError: malformed, or more than ``limit`` hosts (the message says how many).
    """
    limits = current() if limit is None else current().replace(max_hosts=limit)
    hs = parse_hostlist(expr, limits=limits)
    if hs.hosts is None:
        raise ValueError(
            f"host list {hs.describe()} is larger than {limits.max_hosts:,} names: not expanded "
            f"(raise with {flag_for('max_hosts')})"
        )
    return list(hs.hosts)


def _count_text(n: int) -> str:
    if n >= 10**6 and str(n).rstrip("0") == "1":
        return f"10^{len(str(n)) - 1}"
    return f"{n:,}"


# A part is a sequence of segments: a literal string or a merged list of ranges.
_Segment = str | tuple[_Range, ...]


def _split_top(expr: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in host list {expr[:80]!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {expr[:80]!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in host list {expr[:80]!r}")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _parse_part(part: str) -> list[_Segment]:
    segments: list[_Segment] = []
    rest = part
    while (start := rest.find("[")) >= 0:
        end = rest.index("]", start)
        if start:
            segments.append(rest[:start])
        segments.append(_parse_body(rest[start + 1 : end], part))
        rest = rest[end + 1 :]
    if rest:
        segments.append(rest)
    return segments


def _parse_body(body: str, part: str) -> tuple[_Range, ...]:
    ranges: list[_Range] = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        hi = hi if sep else lo
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"bad range {item!r} in host list {part[:80]!r}")
        ranges.append((int(lo), int(hi), len(lo)))
    ranges.sort(key=lambda r: (r[2], r[0]))
    merged: list[_Range] = []
    for lo, hi, width in ranges:
        if merged and merged[-1][2] == width and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]), width)
        else:
            merged.append((lo, hi, width))
    return tuple(merged)


def _part_count(segments: list[_Segment]) -> int:
    n = 1
    for seg in segments:
        if isinstance(seg, tuple):
            n *= sum(hi - lo + 1 for lo, hi, _ in seg)
    return n


def _part_text(segments: list[_Segment]) -> str:
    out = []
    for seg in segments:
        if isinstance(seg, str):
            out.append(seg)
            continue
        items = [f"{lo:0{w}d}" if lo == hi else f"{lo:0{w}d}-{hi:0{w}d}" for lo, hi, w in seg]
        out.append("[" + ",".join(items) + "]")
    return "".join(out)


def _part_names(segments: list[_Segment]) -> list[str]:
    names = [""]
    for seg in segments:
        if isinstance(seg, str):
            names = [n + seg for n in names]
        else:
            values = [f"{v:0{w}d}" for lo, hi, w in seg for v in range(lo, hi + 1)]
            names = [n + v for n in names for v in values]
    return names
