"""What every dispatch-path adapter shares: buffer names, the installation, the adapter protocol.

An :class:`Installation` records every attribute an adapter replaced and puts it back on
``uninstall()``; a few class-level patches (megatron's own release paths) are shared by all live
installations and stay while any is alive. A :class:`PathAdapter` owns one dispatch path's hooks
and the requirement rows (:class:`Requirement`) that path needs; the registry of adapters is
:data:`bufreuse.integrations.adapters.ADAPTERS`.

Importing this module imports neither torch nor megatron-core (``bufreuse check-config`` reads the
requirement rows without them); :func:`aliases` and :func:`acquire_with_hint` import torch and the
pool when first called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from bufreuse.config import BufferBound, BufReuseConfig

if TYPE_CHECKING:
    import torch

    from bufreuse.integrations.features import Features
    from bufreuse.pool import BufferPool

__all__ = [
    "ALL_POLICIES",
    "BOTH",
    "DISPATCH",
    "EXPERT",
    "KNOBS",
    "PATHS",
    "REUSE",
    "RING",
    "CheckContext",
    "Held",
    "Installation",
    "PathAdapter",
    "Requirement",
    "acquire_with_hint",
    "active_installations",
    "aliases",
    "cfg_get",
    "cfg_has",
    "ring_name",
    "shared_patch",
    "shared_patches_applied",
]

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


@dataclass(slots=True)
class Held:
    """One acquisition and where it is released."""

    pool: BufferPool
    name: str
    tensor: torch.Tensor
    release_in_backward: bool = False
    released: bool = False

    def release(self) -> None:
        """Release on the current stream once (the final reader has been enqueued)."""
        if not self.released:
            self.released = True
            self.pool.release(self.name, self.tensor)


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
        EarlyReuseError: the ring is too shallow; the message names the knob and the minimum depth.
        StaticShapeError: ``dtype`` is not the registered one (a copy would cast silently); nothing
            stays acquired.
    """
    from bufreuse.pool import EarlyReuseError, StaticShapeError

    try:
        tensor = pool.acquire(name, shape)
    except EarlyReuseError as e:
        knob = KNOBS.get(name, "the slot count")
        raise EarlyReuseError(
            f"{e} -> raise {knob} to at least {e.min_depth}",
            ring=e.ring,
            slot=e.slot,
            generation=e.generation,
            min_depth=e.min_depth,
        ) from e
    if dtype is not None and tensor.dtype != dtype:
        pool.release(name, tensor)
        raise StaticShapeError(
            f"buffer '{name}' holds {tensor.dtype} but the layer produces {dtype}; the ring dtype comes from "
            "TransformerConfig.params_dtype (set bf16/params_dtype to the activation dtype)"
        )
    return tensor


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
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def activate(self) -> None:
        """Count this installation as alive (shared patches stay while it is)."""
        if self not in _ACTIVE:
            _ACTIVE.append(self)

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

    def register(self, buffer: str, bound: BufferBound, dtype: Any) -> None:
        """Register one enabled buffer's ring on the pool at its static bound."""
        self.pool.register(
            ring_name(buffer),
            policy=self.knobs.enabled()[buffer],
            num_slots=self.knobs.slots(buffer),
            max_shape=(bound.rows, bound.hidden),
            dtype=dtype,
        )

    def uninstall(self) -> None:
        """Restore everything this installation replaced; the last one alive also drops the shared patches."""
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
