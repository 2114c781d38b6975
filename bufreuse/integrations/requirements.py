"""The requirement matrix: which megatron-core settings each buffer x path x policy needs.

One table (:data:`REQUIREMENTS`), no scattered ifs: each row names the buffers, dispatch paths and
policies it applies to, a predicate over the ``TransformerConfig`` (any object with its field
names: a real config, or the flat dict ``bufreuse check-config`` reads), and the field to change.
The rows a dispatch path's hooks need belong to its adapter
(:data:`bufreuse.integrations.registry.ADAPTERS`); the rows every path shares are here.
``check`` evaluates every applicable row; ``validate`` raises ONE :class:`ConfigError` listing all
unmet rows. Fields missing from older megatron-core read as unset, and a row that needs one says
it cannot be met on that version. Backend support is detected by feature (signatures, importable
keys), never by version string. Importing this module imports neither torch nor megatron-core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bufreuse.config import (
    BufferBound,
    BufReuseConfig,
    TorchAssumption,
    dispatch_path,
    static_bounds,
    tokens_per_microbatch,
    unused_rings,
)
from bufreuse.errors import ConfigError
from bufreuse.integrations.core import (
    ALL_POLICIES,
    BOTH,
    INSTALL_ROWS,
    PATHS,
    RING,
    CheckContext,
    Requirement,
    cfg_has,
)
from bufreuse.integrations.features import Features, detect_features
from bufreuse.integrations.registry import ADAPTERS, adapter

__all__ = ["REQUIREMENTS", "CheckItem", "CheckReport", "Requirement", "check", "dispatch_path", "validate"]


_FIRST = (
    Requirement(
        key="dispatcher",
        buffers=BOTH,
        paths=PATHS | {None},
        policies=ALL_POLICIES,  # type: ignore[operator]
        text="a supported dispatcher: NCCL all-to-all, or flex with the HybridEP backend",
        fix="set moe_token_dispatcher_type='alltoall', or 'flex' with moe_flex_dispatcher_backend='hybridep'",
        why="the hooks exist for these two dispatch paths only",
        test=lambda c: c.path is not None,
    ),
)
_SHARED = (
    *INSTALL_ROWS,
    Requirement(
        key="tokens_known",
        buffers=BOTH,
        paths=PATHS,
        policies=RING,
        text="the tokens per microbatch (to size the slots)",
        fix="pass seq_length and micro_batch_size (--seq-length, --micro-batch-size)",
        why="slot size = static bound rows x hidden x element size, and the rows depend on the tokens",
        test=lambda c: c.tokens is not None,
    ),
)
_LAST = (
    Requirement(
        key="dispatch_slots",
        buffers=frozenset({"dispatch"}),
        paths=PATHS | {None},
        policies=RING,  # type: ignore[operator]
        text="at least one dispatch-output slot",
        fix="set moe_hybridep_num_dispatch_output_buffers >= 1 (4 is a good start)",
        why="a ring with 0 slots cannot hold a buffer",
        test=lambda c: c.knobs.slots("dispatch") != 0,  # an int >= 1 or "auto"
    ),
)


def _assemble() -> tuple[Requirement, ...]:
    """Shared rows and every adapter's rows, in the order ``check-config`` reports them."""
    ordered = ("hybridep", "te")  # their rows come before the shared sizing rows
    rows = [*_FIRST]
    for name in ordered:
        rows.extend(adapter(name).requirements())
    rows.extend(_SHARED)
    for a in ADAPTERS:
        if a.name not in ordered:
            rows.extend(a.requirements())
    rows.extend(_LAST)
    return tuple(rows)


REQUIREMENTS: tuple[Requirement, ...] = _assemble()
"""Every row: the shared ones and each registered adapter's."""


@dataclass(kw_only=True, slots=True)
class CheckItem:
    """One evaluated row for one buffer."""

    key: str
    buffer: str
    policy: str
    ok: bool
    text: str
    why: str
    fix: str
    note: str = ""


@dataclass(kw_only=True, slots=True)
class CheckReport:
    """Everything ``check`` found: rows, path, bounds, features."""

    path: str | None
    knobs: BufReuseConfig
    items: list[CheckItem] = field(default_factory=list)
    bounds: dict[str, BufferBound] = field(default_factory=dict)
    features: Features | None = None
    unused: dict[str, str] = field(default_factory=dict)
    """Enabled buffer -> why its ring stands down (``install()`` hooks nothing for it; ``config.unused_rings``)."""

    @property
    def ok(self) -> bool:
        return all(i.ok for i in self.items)

    @property
    def all_stand_down(self) -> bool:
        """Whether buffers are enabled and every one of them stands down (``install()`` would hook nothing)."""
        enabled = self.knobs.enabled()
        return bool(enabled) and set(enabled) <= set(self.unused)

    @property
    def unmet(self) -> list[CheckItem]:
        return [i for i in self.items if not i.ok]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (``bufreuse check-config --json``)."""
        return {
            "ok": self.ok,
            "path": self.path,
            "enabled": self.knobs.enabled(),
            "requirements": [
                {k: getattr(i, k) for k in ("key", "buffer", "policy", "ok", "text", "why", "fix", "note")}
                for i in self.items
            ],
            "rings": {
                b.buffer: {
                    "rows": b.rows,
                    "hidden": b.hidden,
                    "element_size": b.element_size,
                    "slots": b.slots,
                    "slot_bytes": b.slot_bytes,
                    "persistent_bytes": b.persistent_bytes,
                    "bound_source": b.source,
                }
                for b in self.bounds.values()
            },
            "persistent_bytes_total": sum(b.persistent_bytes for b in self.bounds.values()),
            "stood_down": dict(self.unused),
            "all_stand_down": self.all_stand_down,
            "features": None if self.features is None else self.features.to_dict(),
        }


def check(
    cfg: Any,
    knobs: BufReuseConfig,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    features: Features | None = None,
    torch_version: TorchAssumption | None = None,
) -> CheckReport:
    """Evaluate every applicable row of :data:`REQUIREMENTS` for the enabled buffers (never raises on unmet rows).

    Args:
        cfg: a megatron-core ``TransformerConfig``, or a flat dict of its fields.
        knobs: the bufreuse knobs (which buffers, policies, slots).
        seq_length: sequence length (with ``micro_batch_size``, sizes the static bounds).
        micro_batch_size: microbatch size.
        features: backend capabilities; detected in this environment when None.
        torch_version: what the EP >= 2 stream rule judges by (default: the installed torch).
    """
    feats = features if features is not None else detect_features()
    path = dispatch_path(cfg)
    tokens = tokens_per_microbatch(cfg, seq_length=seq_length, micro_batch_size=micro_batch_size)
    ctx = CheckContext(cfg=cfg, knobs=knobs, path=path, tokens=tokens, features=feats)
    report = CheckReport(path=path, knobs=knobs, features=feats)
    unused = unused_rings(cfg, knobs, path, torch_version=torch_version)  # install() hooks none: nothing to require
    report.unused = dict(unused)
    for buffer, policy in knobs.enabled().items():
        for req in REQUIREMENTS:
            if buffer not in req.buffers or policy not in req.policies:
                continue
            if path is not None and path not in req.paths:
                continue
            if (path is None or buffer in unused) and req.key != "dispatcher":
                continue
            ok = bool(req.test(ctx))
            note = ""
            missing = [f for f in req.needs_fields if not cfg_has(cfg, f)]
            if not ok and missing:
                note = f"cannot be met on this megatron-core: field(s) {', '.join(missing)} do not exist (needs 0.19+)"
            if req.key == "deepep_output_token" or req.key == "te_grouped_output":
                note = feats.deepep_detail if req.key == "deepep_output_token" else feats.te_detail
            elif req.key == "expert_output_writer" and not ok:
                note = feats.te_detail
            report.items.append(
                CheckItem(
                    key=req.key, buffer=buffer, policy=policy, ok=ok, text=req.text, why=req.why, fix=req.fix, note=note
                )
            )
    if path is not None:
        report.bounds = static_bounds(cfg, knobs, path=path, tokens=tokens, torch_version=torch_version)
    return report


def validate(
    cfg: Any,
    knobs: BufReuseConfig,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    features: Features | None = None,
) -> CheckReport:
    """Check at start-up; raise ONE :class:`ConfigError` naming every unmet row and its fix.

    Args: as :func:`check`.

    Returns:
        The report (every row met).

    Raises:
        ConfigError: one or more rows unmet; the message lists each as ``[buffer/policy] key: needs ... -> fix``.
    """
    report = check(cfg, knobs, seq_length=seq_length, micro_batch_size=micro_batch_size, features=features)
    if not report.ok:
        lines = [
            f"[{i.buffer}/{i.policy}] {i.key}: needs {i.text} -> {i.fix}" + (f" ({i.note})" if i.note else "")
            for i in report.unmet
        ]
        raise ConfigError(
            f"bufreuse cannot be enabled as configured ({len(lines)} unmet requirement(s)): " + "; ".join(lines)
        )
    return report
