"""What every dispatch-path adapter shares: buffer names, the installation, the adapter protocol.

An :class:`Installation` records every attribute an adapter replaced and puts it back on
``uninstall()``; a few class-level patches (megatron's own release paths) are shared by all live
installations and stay while any is alive. A :class:`PathAdapter` owns one dispatch path's hooks
and the requirement rows (:class:`Requirement`) that path needs; the registry of adapters is
:data:`bufreuse.integrations.registry.ADAPTERS`.

Releases are by fact (:class:`Held`); where they are *expected* comes from the planner's one table,
:mod:`bufreuse.plan.rules`: the installation keeps each hooked ring's :class:`~bufreuse.plan.rules.ReleaseRule`
(``expected_release``), takes its ring-policy refusals from the same rows (:data:`INSTALL_ROWS` is built
from :data:`bufreuse.plan.rules.REFUSALS`), and :meth:`Installation.release_check` compares the
observed deferrals with the rules (in debug mode, which counts every stage, a disagreement means the
planner's depth is wrong, not the run).

Importing this module imports neither torch nor megatron-core (``bufreuse check-config`` reads the
requirement rows without them); :func:`aliases` and :func:`acquire_with_hint` import torch and the
pool when first called.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from bufreuse.config import BufferBound, BufReuseConfig, unused_rings
from bufreuse.errors import ConfigError
from bufreuse.plan.report import initial_slots
from bufreuse.plan.rules import REFUSALS, ReleasePoint, ReleaseRule, release_rule

if TYPE_CHECKING:
    import torch

    from bufreuse.integrations.features import Features
    from bufreuse.pool import BufferPool

__all__ = [
    "ALL_POLICIES",
    "AUTO_START",
    "BOTH",
    "DISPATCH",
    "EXPERT",
    "INSTALL_ROWS",
    "KNOBS",
    "PATHS",
    "REUSE",
    "RING",
    "CheckContext",
    "ConfigView",
    "Held",
    "Installation",
    "PathAdapter",
    "ReleaseDisagreement",
    "ReleaseRuleWarning",
    "Requirement",
    "acquire_with_hint",
    "active_installations",
    "aliases",
    "cfg_get",
    "cfg_has",
    "dtype_refusal",
    "effective_config",
    "expected_deferred",
    "install_refusals",
    "reads_live",
    "ring_name",
    "shared_patch",
    "shared_patches_applied",
    "tracked",
    "with_reuse_hint",
]

_log = logging.getLogger("bufreuse.integrations")

DISPATCH = "dispatch_output"
"""Pool ring name of the MoE dispatch output."""
EXPERT = "expert_fc2_output"
"""Pool ring name of the expert FC2 output."""
KNOBS = {
    DISPATCH: "moe_hybridep_num_dispatch_output_buffers",
    EXPERT: "moe_hybridep_num_expert_output_buffers",
}
"""Ring name -> the knob that sets its slot count (named in early-reuse errors)."""

ALL_POLICIES = frozenset({"ring", "stream-ordered", "record-stream"})
REUSE = frozenset({"ring", "stream-ordered"})
RING = frozenset({"ring"})
BOTH = frozenset({"dispatch", "expert"})
PATHS = frozenset({"hybridep", "alltoall"})


def ring_name(buffer: str) -> str:
    """The pool ring name of a buffer key (``dispatch`` / ``expert``)."""
    return DISPATCH if buffer == "dispatch" else EXPERT


def cfg_get(cfg: Any, name: str, default: Any = None) -> Any:
    """A field of a ``TransformerConfig`` or of the flat dict ``check-config`` reads."""
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def cfg_has(cfg: Any, name: str) -> bool:
    """Whether the config has the field at all (older megatron-core lacks some)."""
    return name in cfg if isinstance(cfg, Mapping) else hasattr(cfg, name)


@dataclass(frozen=True, slots=True)
class CheckContext:
    """What a requirement row's predicate sees."""

    cfg: Any
    knobs: BufReuseConfig
    path: str | None
    tokens: int | None
    features: Features


@dataclass(frozen=True, slots=True)
class Requirement:
    """One row of the requirement matrix: buffers x paths x policies it applies to, and its test."""

    key: str
    buffers: frozenset[str]
    paths: frozenset[str]
    policies: frozenset[str]
    text: str
    """What must hold, in words."""
    fix: str
    """The field to change and how."""
    why: str
    test: Callable[[CheckContext], bool]
    needs_fields: tuple[str, ...] = ()
    """Fields this row can only be met through; absent on older megatron-core -> cannot be met."""


def _refusal_row(key: str) -> Requirement:
    r = next(r for r in REFUSALS if r.key == key)
    return Requirement(
        key=r.key,
        buffers=BOTH if r.buffer == "both" else frozenset({r.buffer}),
        paths=PATHS,
        policies=RING,
        text=r.text,
        fix=r.fix,
        why=r.why,
        test=lambda c: not r.applies(c.cfg),
    )


INSTALL_ROWS: tuple[Requirement, ...] = tuple(_refusal_row(r.key) for r in REFUSALS)
"""Rows ``install()`` itself enforces per layer: the release rules' refusals
(:data:`bufreuse.plan.rules.REFUSALS`, one place), also rows of the matrix."""
_INSTALL_ROW = {row.key: row for row in INSTALL_ROWS}


def install_refusals(cfg: Any, knobs: BufReuseConfig, path: str) -> list[str]:
    """The refusals of the release rules for the enabled ring buffers, each naming the field to change.

    ``release_rule(cfg, buffer).refusals`` decides; the words are the :data:`INSTALL_ROWS` row's.
    """
    out = []
    unused = unused_rings(cfg, knobs, path)  # not registered, not hooked: nothing of theirs to refuse
    for buffer, policy in knobs.enabled().items():
        if path not in PATHS or buffer in unused:
            continue
        for key in release_rule(cfg, buffer, path=path).refusals:
            row = _INSTALL_ROW[key]
            if policy in row.policies:
                out.append(f"[{buffer}/{policy}] {row.key}: needs {row.text} -> {row.fix} ({row.why})")
    return out


class ConfigView(Mapping):
    """A ``TransformerConfig`` (or a mapping) read as a flat mapping, with fields overridden.

    The planner's functions read a mapping (``fields.get``); this lets them read a live config.
    """

    def __init__(self, cfg: Any, **overrides: Any) -> None:
        self._cfg = cfg
        self._over = overrides

    def __getitem__(self, name: str) -> Any:
        if name in self._over:
            return self._over[name]
        if isinstance(self._cfg, Mapping):
            return self._cfg[name]
        try:
            return getattr(self._cfg, name)
        except AttributeError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        base = self._cfg if isinstance(self._cfg, Mapping) else vars(self._cfg)
        return iter(dict.fromkeys([*base, *self._over]))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def effective_config(cfg: Any) -> ConfigView:
    """``cfg`` as the release rules should read it in this process.

    ``deterministic_mode`` is also on when ``torch.use_deterministic_algorithms(True)`` is: megatron's
    ``unpermute`` takes its ``index_add_`` path on ``torch.are_deterministic_algorithms_enabled()``.
    """
    import torch

    on = bool(cfg_get(cfg, "deterministic_mode", False)) or torch.are_deterministic_algorithms_enabled()
    return ConfigView(cfg, deterministic_mode=on)


class ReleaseRuleWarning(RuntimeWarning):
    """The release observed (by fact) contradicts the planner's rule: the planned depth is wrong."""


@dataclass(frozen=True, slots=True)
class ReleaseDisagreement:
    """One ring whose observed deferred releases contradict its :class:`ReleaseRule`."""

    ring: str
    rule: ReleaseRule
    acquisitions: int
    deferred: int
    expected_deferred: int
    empty: int = 0
    """Acquisitions of zero rows among ``acquisitions`` (never deferred; ``RingStats.empty_acquisitions``)."""

    def __str__(self) -> str:
        r = self.rule
        empty = f" ({self.empty} empty, never deferred)" if self.empty else ""
        return (
            f"bufreuse: ring '{self.ring}' released against its rule: rule says release at {r.point.value}"
            f"{' (MoE recompute)' if r.recompute else ''} ({r.reason}); observed {self.deferred} of "
            f"{self.acquisitions} acquisition(s){empty} deferred past the forward, the rule predicts "
            f"{self.expected_deferred}. {self._consequence()}"
        )

    def _consequence(self) -> str:
        depth = "the planner's depth (bufreuse plan, num_slots='auto' start) is wrong for this config"
        if self.deferred >= self.expected_deferred:
            return f"Releases wait for every saved reference counted, but {depth}"
        # production skips the stages that only pass a slot on and the experts after FC2; debug mode tracks them
        return (
            f"Fewer releases waited than predicted: either {depth}, or (in production mode) a stage saved a slot "
            "where production does not count (the release came early; debug mode, BUFREUSE_DEBUG=1, counts every "
            "stage and raises on that)"
        )


def expected_deferred(rule: ReleaseRule, acquisitions: int) -> int:
    """Releases a rule predicts are deferred past the forward, out of ``acquisitions`` (all released).

    Forward: none. Backward / wgrad: every one, or under MoE recompute the recomputed half (the
    checkpointed forward saves nothing).
    """
    if rule.point is ReleasePoint.FORWARD:
        return 0
    return acquisitions // 2 if rule.recompute else acquisitions


AUTO_START = 2
"""The first depth of an ``auto`` ring when no plan is available (the pool's default)."""


def tracked(pool: BufferPool, fn: Callable[..., Any], reads: Callable[[Any], bool] | None = None) -> Callable[..., Any]:
    """``fn`` run inside ``pool.track_saved()`` when it reads ring storage: what it saves from it is counted.

    The dispatch path's stages and the experts' forward (the combine stages inline the same logic,
    :func:`bufreuse.integrations.alltoall.hooks.hook_fc2_release`). ``reads(first argument)`` says
    whether this call receives a slot (:func:`reads_live`, or ``pool.views_ring_storage``); only then
    is the region entered (one push of the pool's prebuilt saved-tensor hooks,
    :meth:`~bufreuse.pool.tracking.SavedTracker.run`), so a stage that receives a copy pays a pointer
    comparison. ``reads=None``: always. A nested entry
    pushes the same hooks again (one C call). Releases (``Held.release``) then wait for exactly the
    saved references those regions made.
    """
    import functools

    run = pool.track_saved().run

    if reads is None:

        @functools.wraps(fn)
        def always(*args: Any, **kwargs: Any) -> Any:
            return run(fn, args, kwargs)

        return always

    @functools.wraps(fn)
    def when_read(*args: Any, **kwargs: Any) -> Any:
        # megatron passes the hidden states first; by keyword, the first keyword is looked at instead
        if reads(args[0] if args else next(iter(kwargs.values()), None)):
            return run(fn, args, kwargs)
        return fn(*args, **kwargs)

    return when_read


def reads_live(live: Callable[[], Held | None]) -> Callable[[Any], bool]:
    """A ``reads`` predicate for :func:`tracked`: the argument views the acquisition ``live()`` returns."""

    def reads(x: Any) -> bool:
        held = live()
        return held is not None and held.read_by(x)

    return reads


class Held:
    """One acquisition and where it is released: at its last reader, by fact.

    ``release()`` is called after the forward's final reader; the pool releases at once when no
    autograd-saved reference (counted inside ``pool.track_saved()``) and no ``Hold`` is left, else
    when the last of them is gone (``pool.release_when_unsaved``). The acquisition's byte span is
    kept so that "is this a view of it?" (:meth:`read_by`) is one pointer comparison.
    """

    __slots__ = ("deferred", "entry", "hi", "lo", "name", "pool", "released", "tensor")

    def __init__(
        self, pool: BufferPool, name: str, tensor: torch.Tensor, entry: Any = None, span: tuple[int, int] | None = None
    ) -> None:
        self.pool = pool
        self.name = name
        self.tensor = tensor
        self.entry = pool.get(name) if entry is None else entry
        """The pool's buffer ``name`` (hot paths pass the one they acquired from: no lookup per call)."""
        if span is None:
            lo = tensor.data_ptr()
            span = (lo, lo + tensor.nbytes)
        self.lo, self.hi = span
        """The acquisition's bytes (hot paths that read the pointer already pass them)."""
        self.released = False
        self.deferred = False
        """Whether the release waited for a saved reference or a hold (what the planner's rule must predict)."""

    def read_by(self, x: Any) -> bool:
        """Whether ``x`` is a tensor viewing this acquisition's bytes (a zero-size one views nothing)."""
        try:
            ptr = x.data_ptr()
        except (AttributeError, RuntimeError, TypeError):
            return False
        return self.lo <= ptr < self.hi

    def release(self, stream: Any = None) -> None:
        """The forward's final reader is enqueued on ``stream`` (default: current); release once, by fact."""
        if not self.released:
            self.released = True
            self.deferred = not self.entry.release_when_unsaved(self.tensor, stream)

    def __repr__(self) -> str:
        return f"Held({self.name!r}, released={self.released}, deferred={self.deferred})"


def aliases(a: Any, b: torch.Tensor) -> bool:
    """Whether ``a`` shares storage with ``b`` (pure; by untyped storage pointer)."""
    import torch

    if not isinstance(a, torch.Tensor):
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def acquire_with_hint(
    pool: BufferPool, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``pool.acquire`` whose early-reuse error names the knob to raise; refuses a dtype mismatch.

    Raises:
        EarlyReuseError: the ring is too shallow; the message names the knob (for an ``auto`` ring, also
            ``moe_bufreuse_auto_max_mib``) and the minimum depth.
        StaticShapeError: ``dtype`` is not the registered one (a copy would cast silently); nothing
            stays acquired.
    """
    from bufreuse.pool import EarlyReuseError

    try:
        tensor = pool.acquire(name, shape)
    except EarlyReuseError as e:
        raise with_reuse_hint(pool, name, e) from e
    if dtype is not None and tensor.dtype != dtype:
        pool.release(name, tensor)
        raise dtype_refusal(name, tensor.dtype, dtype)
    return tensor


def dtype_refusal(name: str, held: Any, produced: Any) -> Exception:
    """The ``StaticShapeError`` for a layer producing ``produced`` into buffer ``name`` of dtype ``held``."""
    from bufreuse.pool import StaticShapeError

    return StaticShapeError(
        f"buffer '{name}' holds {held} but the layer produces {produced}; the ring dtype comes from "
        "TransformerConfig.params_dtype (set bf16/params_dtype to the activation dtype)"
    )


def with_reuse_hint(pool: BufferPool, name: str, e: Any) -> Exception:
    """``e`` (an ``EarlyReuseError``) again, its message naming the knob to raise and the planner's minimum."""
    from bufreuse.integrations.planned import planned_minimum
    from bufreuse.pool import EarlyReuseError

    knob, plan = KNOBS.get(name, "the slot count"), planned_minimum(pool, name)
    need = max(e.min_depth or 0, plan[0] if plan else 0)
    hint = f"raise {knob} to at least {need}"
    if getattr(pool.get(name), "max_bytes", None) is not None:  # num_slots='auto': the cap or the settling
        hint = (
            f"raise moe_bufreuse_auto_max_mib (the 'auto' ring's cap) to hold at least {need} slots, "
            f"or set {knob} to at least {need}"
        )
    if plan:
        hint += f" (the planner's minimum for this schedule is {plan[0]}: {plan[1]})"
    return EarlyReuseError(f"{e} -> {hint}", ring=e.ring, slot=e.slot, generation=e.generation, min_depth=e.min_depth)


_ACTIVE: list[Installation] = []
"""Installations alive now; the shared class-level patches stay while any is."""
_SHARED_UNDO: list[Callable[[], None]] = []


def active_installations() -> list[Installation]:
    """The live installations (the pure ring-storage probe and the graph wrapper ask all of them)."""
    return list(_ACTIVE)


def shared_patches_applied() -> bool:
    """Whether the class-level patches shared by all installations are in place."""
    return bool(_SHARED_UNDO)


def shared_patch(undo: Callable[[], None]) -> None:
    """Record the undo of a class-level patch; it runs when the last installation uninstalls."""
    _SHARED_UNDO.append(undo)


@dataclass(slots=True, eq=False)
class Installation:
    """What ``install`` replaced; ``uninstall()`` puts it back (idempotent). Also a context manager.

    Compared by identity: two installations on one pool are still two.
    """

    pool: BufferPool
    knobs: BufReuseConfig
    tokens: int
    """Tokens per rank per microbatch entering a MoE layer (sizes the static bounds)."""
    layers: int = 0
    """MoE layers with at least one ring hooked (a layer whose enabled buffers are all unused is not counted)."""
    num_microbatches: int | None = None
    """Microbatches per step on this rank (with ``pp_rank``, the planner's schedule for ``auto`` rings)."""
    pp_rank: int = 0
    expected_release: dict[str, ReleaseRule] = field(default_factory=dict)
    """Ring name -> where the planner's rule says it is released (:mod:`bufreuse.plan.rules`)."""
    auto_start: dict[str, int] = field(default_factory=dict)
    """Ring name -> the depth an ``auto`` ring was registered at (the planner's figure, or the default)."""
    unused: dict[str, str] = field(default_factory=dict)
    """Ring name -> why an enabled buffer is left alone (nothing to replace), logged once."""
    _mixed: set[str] = field(default_factory=set)
    _checked: bool = False
    _undo: list[Callable[[], None]] = field(default_factory=list)
    _owners: dict[tuple[int, str], str] = field(default_factory=dict)
    _configs: dict[int, Any] = field(default_factory=dict)

    def use_config(self, layer: Any, cfg: Any) -> None:
        """Decide ``layer``'s rules and bounds on ``cfg`` instead of ``layer.config`` (``install`` passes the
        config with the EP / expert-TP sizes the layer's dispatcher really uses, where they differ)."""
        self._configs[id(layer)] = cfg

    def config_of(self, layer: Any) -> Any:
        """The config the rings' rule, bounds, refusals and release rules read for ``layer`` (:meth:`use_config`)."""
        return self._configs.get(id(layer), layer.config)

    def claim(self, layer: Any, buffer: str, adapter: str) -> None:
        """Record that ``adapter`` hooks ``buffer`` of ``layer`` (``install`` decides, adapters ask)."""
        self._owners[(id(layer), buffer)] = adapter

    def unclaim(self, layer: Any, buffer: str, why: str) -> None:
        """Leave ``buffer`` of ``layer`` unhooked (it replaces nothing there): no adapter hooks it; noted once."""
        if self._owners.pop((id(layer), buffer), None) is not None:
            self.note_unused(ring_name(buffer), why)

    def hooks_any(self, layer: Any) -> bool:
        """Whether any adapter hooks any enabled buffer of ``layer`` (False when all are unused there)."""
        enabled = self.knobs.enabled()
        return any(lid == id(layer) and b in enabled for lid, b in self._owners)

    def hooks(self, adapter: str, layer: Any, buffer: str) -> bool:
        """Whether ``buffer`` is enabled and ``adapter`` hooks it on ``layer``."""
        return buffer in self.knobs.enabled() and self._owners.get((id(layer), buffer)) == adapter

    def hooks_buffer(self, layer: Any, buffer: str) -> bool:
        """Whether ``buffer`` is enabled and some adapter hooks it on ``layer``."""
        return buffer in self.knobs.enabled() and (id(layer), buffer) in self._owners

    def note_unused(self, name: str, why: str) -> None:
        """Record (and log once, at info) that the enabled buffer ``name`` is not hooked, and why."""
        if name not in self.unused:
            self.unused[name] = why
            _log.info("bufreuse: ring '%s' not used: %s", name, why)

    def activate(self) -> None:
        """Count this installation as alive (shared patches stay while it is)."""
        if self not in _ACTIVE:
            _ACTIVE.append(self)

    def original(self, obj: Any, attr: str) -> Any:
        """``getattr(obj, attr)``: what a hook calls through (taken at install, before :meth:`override`).

        Hooks take every megatron / TE callable they wrap from here, so what they call is fixed at install.
        """
        return getattr(obj, attr)

    def override(self, obj: Any, attr: str, value: Any) -> None:
        """Shadow ``obj.attr`` with an instance attribute; uninstall deletes it (the class method shows again)."""
        had = attr in vars(obj)
        old = vars(obj).get(attr)
        setattr(obj, attr, value)

        def undo() -> None:
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)

        self._undo.append(undo)

    def on_uninstall(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` at ``uninstall()`` (last registered, first run)."""
        self._undo.append(undo)

    def register(self, buffer: str, bound: BufferBound, dtype: Any, cfg: Any = None) -> None:
        """Register one enabled buffer's ring on the pool at its static bound.

        ``num_slots='auto'``: the ring starts at the planner's minimum for ``cfg``'s schedule
        (``bufreuse.plan.initial_slots``, with ``num_microbatches`` / ``pp_rank``) when it can be
        planned, else at :data:`AUTO_START`, and grows up to ``moe_bufreuse_auto_max_mib`` (no cap: 0).

        Raises:
            ConfigError: the memory cap holds not even one slot.
        """
        name, slots = ring_name(buffer), self.knobs.slots(buffer)
        auto: dict[str, int] = {}
        if slots == "auto":
            auto = self._auto_args(buffer, bound, dtype, cfg)
        self.pool.register(
            name,
            policy=self.knobs.enabled()[buffer],
            num_slots=slots,
            max_shape=(bound.rows, bound.hidden),
            dtype=dtype,
            **auto,
        )
        if auto:
            self.auto_start[name] = auto["initial_slots"]

    def _auto_args(self, buffer: str, bound: BufferBound, dtype: Any, cfg: Any) -> dict[str, int]:
        import torch

        from bufreuse.pool import SLOT_ALIGN_BYTES

        name = ring_name(buffer)
        if name in self.auto_start:  # another layer of this installation: the same registration
            return {"initial_slots": self.auto_start[name], "max_bytes": self._max_bytes()}
        planned = None
        if cfg is not None and self.num_microbatches:
            planned = initial_slots(
                effective_config(cfg), buffer, num_microbatches=self.num_microbatches, pp_rank=self.pp_rank
            )
        start = planned if planned is not None else AUTO_START
        cap = self.knobs.auto_max_bytes
        raw = bound.rows * bound.hidden * torch.empty((), dtype=dtype).element_size()
        slot_bytes = -(-max(raw, 1) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
        if cap is not None:
            fit = cap // slot_bytes
            if fit < 1:
                need = -(-slot_bytes // 2**20)
                raise ConfigError(
                    f"moe_bufreuse_auto_max_mib={self.knobs.moe_bufreuse_auto_max_mib} holds no '{name}' slot "
                    f"({slot_bytes} bytes each): raise it to >= {need}"
                )
            if start > fit:
                _log.warning(
                    "bufreuse: ring '%s' (num_slots='auto'): the cap moe_bufreuse_auto_max_mib=%d holds %d slot(s), "
                    "below the %s depth %d; starting at %d (acquiring past it raises EarlyReuseError naming max_bytes)",
                    name, self.knobs.moe_bufreuse_auto_max_mib, fit, "planned" if planned else "default", start, fit,
                )  # fmt: skip
                start = fit
        _log.info(
            "bufreuse: ring '%s' (num_slots='auto') starts at %d slot(s) (%s), cap %s",
            name, start, f"planned for {self.num_microbatches} microbatches, PP rank {self.pp_rank}"
            if planned is not None else "no plan: default", f"{cap} bytes" if cap is not None else "none",
        )  # fmt: skip
        return {"initial_slots": start, "max_bytes": self._max_bytes()}

    def _max_bytes(self) -> int:
        cap = self.knobs.auto_max_bytes
        return cap if cap is not None else sys.maxsize  # no cap: the pool needs a number

    def expect(self, layer: Any, path: str, cfg: Any = None) -> None:
        """Record the release rule of each buffer hooked on ``layer`` (``install`` calls it per layer).

        ``cfg``: the config the rules read (default: :meth:`config_of` as :func:`effective_config` sees it).
        """
        cfg = effective_config(self.config_of(layer)) if cfg is None else cfg
        for buffer in ("dispatch", "expert"):
            if buffer not in self.knobs.enabled() or (id(layer), buffer) not in self._owners:
                continue
            name, rule = ring_name(buffer), release_rule(cfg, buffer, path=path)
            old = self.expected_release.setdefault(name, rule)
            if old != rule:
                self._mixed.add(name)  # layers with different rules share the ring: its counts mix them

    def log_rules(self) -> None:
        """One debug line per ring: where the planner's rule says it is released."""
        for name, rule in self.expected_release.items():
            mixed = " (layers disagree: not checked)" if name in self._mixed else ""
            _log.debug(
                "bufreuse: ring '%s' expected release at %s%s: %s%s",
                name, rule.point.value, " (MoE recompute)" if rule.recompute else "", rule.reason, mixed,
            )  # fmt: skip

    def release_check(self) -> list[ReleaseDisagreement]:
        """The ring-policy rings whose observed deferred releases contradict the rule.

        Call it at a step boundary (every acquisition released); a ring with acquisitions still held,
        none yet, or layers of different rules is not judged. Empty (zero-row) acquisitions are never
        deferred (``RingStats.empty_acquisitions``) and are left out; of the rest, forward rule: no release
        deferred past the forward; backward / wgrad: every one (the recomputed half under MoE recompute),
        exactly, or at most that many when the rule is ``data_dependent``.
        """
        out = []
        stats = self.pool.stats()
        for name, rule in self.expected_release.items():
            if name in self._mixed or name not in stats or self.pool.policy(name).value != "ring":
                continue
            s = stats[name]
            if s.acquisitions == 0 or self.pool.get(name).held:
                continue
            want = expected_deferred(rule, s.acquisitions - s.empty_acquisitions)
            # A data-dependent rule is an upper bound: fewer deferrals (an earlier copy) agree with it.
            if s.deferred_releases > want or (s.deferred_releases != want and not rule.data_dependent):
                out.append(
                    ReleaseDisagreement(name, rule, s.acquisitions, s.deferred_releases, want, s.empty_acquisitions)
                )
        return out

    def warn_release_disagreements(self) -> list[ReleaseDisagreement]:
        """:meth:`release_check`, each disagreement also a :class:`ReleaseRuleWarning` (and a log warning)."""
        found = self.release_check()
        for d in found:
            _log.warning("%s", d)
            warnings.warn(str(d), ReleaseRuleWarning, stacklevel=3)
        return found

    def uninstall(self) -> None:
        """Restore everything this installation replaced; the last one alive also drops the shared patches.

        In debug mode (``pool.debug``, ``BUFREUSE_DEBUG=1``) it first reports release-rule disagreements
        (:meth:`warn_release_disagreements`). The last installation on its pool logs the depth each
        ``auto`` ring settled on (``BufferPool.settle``).
        """
        if not self._checked and self in _ACTIVE:
            self._checked = True
            if self.expected_release and self.pool.debug:
                self.warn_release_disagreements()
            if self.auto_start and not any(i.pool is self.pool for i in _ACTIVE if i is not self):
                self.pool.settle()
        while self._undo:
            self._undo.pop()()
        if self in _ACTIVE:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                while _SHARED_UNDO:
                    _SHARED_UNDO.pop()()

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


class PathAdapter(Protocol):
    """One way a MoE layer's buffers are hooked; adding a dispatcher backend = one more of these.

    ``install()`` asks every registered adapter, in order, whether it ``supports`` a layer; for each
    enabled buffer the first supporting adapter that lists it in ``buffers`` hooks it. ``check`` runs
    for every chosen adapter before any ``hook`` replaces anything, and their problems are raised
    together. ``requirements()`` are the rows ``check-config`` / ``validate`` evaluate for ``path``.
    """

    name: str
    """Short name (``alltoall``, ``hybridep``, ``te``)."""
    path: str
    """The dispatch path its rows apply to (``alltoall`` or ``hybridep``; see ``requirements.dispatch_path``)."""
    buffers: frozenset[str]
    """Buffer keys it can hook (``dispatch``, ``expert``)."""
    dispatcher: bool
    """Whether it owns the layer's dispatcher (a layer needs one such adapter to be hooked at all)."""
    label: str
    """How refusal messages name the layer (``HybridEP``)."""

    def supports(self, layer: Any) -> bool:
        """Whether this adapter can hook ``layer`` (a megatron-core ``MoELayer``)."""
        ...

    def requirements(self) -> tuple[Requirement, ...]:
        """The requirement rows this adapter's hooks need (its share of the matrix)."""
        ...

    def check(self, installation: Installation, layer: Any) -> list[str]:
        """Unmet requirements of hooking ``layer`` (nothing is replaced yet); empty when it can."""
        ...

    def hook(self, installation: Installation, layer: Any) -> None:
        """Register this adapter's enabled buffers and replace what it hooks, recorded on ``installation``."""
        ...
