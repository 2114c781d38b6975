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
    "INSTALL_ROWS",
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
    "install_refusals",
    "ring_name",
    "shared_patch",
    "shared_patches_applied",
    "tracked",
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


def _offloads(c: CheckContext, module: str) -> bool:
    mods = cfg_get(c.cfg, "offload_modules", None) or []
    return bool(cfg_get(c.cfg, "fine_grained_activation_offloading", False)) and module in mods


def _delayed_wgrad(c: CheckContext) -> bool:
    return bool(
        cfg_get(c.cfg, "delay_wgrad_compute", False)
        or cfg_get(c.cfg, "overlap_dispatch_backward_with_experts_wgrad", False)
    )


INSTALL_ROWS: tuple[Requirement, ...] = (
    Requirement(
        key="no_fused_group_mlp_offload",
        buffers=frozenset({"dispatch"}),
        paths=PATHS,
        policies=RING,
        text="no fine-grained fused_group_mlp activation offload",
        fix="remove 'fused_group_mlp' from offload_modules or set fine_grained_activation_offloading=False",
        why="that path force-releases the expert input storage, which is the persistent dispatch slot",
        test=lambda c: not _offloads(c, "fused_group_mlp"),
    ),
    Requirement(
        key="no_expert_input_offload",
        buffers=frozenset({"dispatch"}),
        paths=PATHS,
        policies=RING,
        text="no fine-grained expert_fc1 activation offload",
        fix="remove 'expert_fc1' from offload_modules or set fine_grained_activation_offloading=False",
        why="TEGroupedMLP copies the FC1 input (the dispatch slot) to host on a side stream under its own "
        "saved-tensor hooks and sets save_original_input: a read the ring's saved-reference tracking cannot see",
        test=lambda c: not _offloads(c, "expert_fc1"),
    ),
    Requirement(
        key="no_delayed_wgrad",
        buffers=frozenset({"dispatch"}),
        paths=PATHS,
        policies=RING,
        text="expert weight gradients computed inside backward (no delayed wgrad)",
        fix="set delay_wgrad_compute=False and overlap_dispatch_backward_with_experts_wgrad=False",
        why="backward_dw() reads the FC1 input (the dispatch slot, bf16) from TE's wgrad store after autograd "
        "freed its saved reference; bufreuse holds no slot across backward_dw, so the next acquisition could "
        "overwrite it first (silently wrong weight gradients)",
        test=lambda c: not _delayed_wgrad(c),
    ),
)
"""Rows ``install()`` itself enforces per layer (a hook cannot be made right under them); also in the matrix."""


def install_refusals(cfg: Any, knobs: BufReuseConfig, path: str) -> list[str]:
    """The :data:`INSTALL_ROWS` unmet by ``cfg`` for the enabled buffers, each naming the field to change."""
    ctx = CheckContext(cfg=cfg, knobs=knobs, path=path, tokens=None, features=None)  # type: ignore[arg-type]
    out = []
    for buffer, policy in knobs.enabled().items():
        for row in INSTALL_ROWS:
            if buffer in row.buffers and policy in row.policies and path in row.paths and not row.test(ctx):
                out.append(f"[{buffer}/{policy}] {row.key}: needs {row.text} -> {row.fix} ({row.why})")
    return out


def tracked(pool: BufferPool, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside ``pool.track_saved()``: what it saves for backward from ring storage is counted.

    Every hooked stage between a slot's acquisition and its release runs so; the releases
    (``Held.release``) then wait for exactly those saved references.
    """
    import functools

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with pool.track_saved():
            return fn(*args, **kwargs)

    return run


@dataclass(slots=True)
class Held:
    """One acquisition and where it is released: at its last reader, by fact.

    ``release()`` is called after the forward's final reader; the pool releases at once when no
    autograd-saved reference (counted inside ``pool.track_saved()``) and no ``Hold`` is left, else
    when the last of them is gone (``pool.release_when_unsaved``).
    """

    pool: BufferPool
    name: str
    tensor: torch.Tensor
    released: bool = False
    deferred: bool = False
    """Whether the release waited for a saved reference or a hold (what the planner's rule must predict)."""

    def release(self, stream: Any = None) -> None:
        """The forward's final reader is enqueued on ``stream`` (default: current); release once, by fact."""
        if not self.released:
            self.released = True
            self.deferred = not self.pool.release_when_unsaved(self.name, self.tensor, stream)


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
    _owners: dict[tuple[int, str], str] = field(default_factory=dict)

    def claim(self, layer: Any, buffer: str, adapter: str) -> None:
        """Record that ``adapter`` hooks ``buffer`` of ``layer`` (``install`` decides, adapters ask)."""
        self._owners[(id(layer), buffer)] = adapter

    def hooks(self, adapter: str, layer: Any, buffer: str) -> bool:
        """Whether ``buffer`` is enabled and ``adapter`` hooks it on ``layer``."""
        return buffer in self.knobs.enabled() and self._owners.get((id(layer), buffer)) == adapter

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
