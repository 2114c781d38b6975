"""The hooks' own host time per layer call: time spent in bufreuse's hook code, not in the work it wraps.

A wall or host A/B of a whole layer call cannot resolve microseconds (the call takes milliseconds and
the host drifts by percents between rounds). This measures the hooks directly, in one instrumented
round: while ``install()`` runs, :data:`bufreuse.integrations.core.INSTRUMENT` is a :class:`HookClock`,
so every hook entry the installation puts in place (``Installation.override``, TE's routing shim) is
wrapped as *hook* and every megatron / TE callable a hook calls through (``Installation.original``) as
*original*. The saved-tensor pack/unpack pair, the saved-reference holder's ``__del__`` (run by
autograd in backward) and the autograd Functions' backward are wrapped as hooks for the round.

Time is charged to the hooks while the innermost wrapped frame on the calling thread is a hook: the
hooks' Python, the torch calls they make (event record/wait, views, pointer reads) and the bookkeeping
between them; nothing inside the originals. The clock's own cost inside the intervals is measured in
the same process (:func:`calibrate`) and subtracted per entry and per original call, so the figure is
the hooks' time with the instrumentation taken out (the calibration runs warm, so the clock's cold-cache
cost stays in: the figure errs high). A stand-in round (``HookClock(empty=True)``) measures that cold cost in
place: the same entry points, each an empty frame calling the original; the real figure less the stand-in's
takes out the clock and one empty frame per entry (it errs low by that frame). What the control does instead
of the hooks (the allocator call the ring replaces, inside TE or megatron) is not subtracted: the figure is the
hooks' cost, not the difference of two arms. Hooks that *replace* megatron code instead of wrapping it are
charged in full, that code included: the ``SequentialMLP`` experts' forward (split, per-expert loop, the
concatenation into the slot) and the all-to-all ``token_dispatch`` of the local spec and EP > 1 paths, and the
autograd Functions' backward. There the figure includes work the control does in megatron's code; on the TE module route
(the H200 figures) every hook wraps, and nothing of megatron's or TE's is in it.

:data:`bufreuse.integrations.core.INSTRUMENT` is process-wide while ``arm()`` is open: install nothing
else from another thread during a measurement.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["HookClock", "calibrate", "instrumented", "pool_hook_code_wrapped", "saved_pair_wrapped"]


class _Thread(threading.local):
    def __init__(self) -> None:
        self.stack: list[str | None] = []
        """Innermost last: a hook's name, or None for an original."""
        self.last = 0


class HookClock:
    """Exclusive host time of hook frames (see the module docstring); one per measured round.

    ``empty=True`` makes it a stand-in round: an installation puts :meth:`stand_in` (a frame that only calls
    the original) at every entry point instead of the real hook, so the clock charges its own cost and one
    Python frame per entry, in place, between the same megatron / TE calls and with the same cold caches. The
    warm :func:`calibrate` cannot see that cost; the difference of a real and a stand-in round leaves it out.
    """

    def __init__(self, *, empty: bool = False) -> None:
        self._t = _Thread()
        self._lock = threading.Lock()
        self.empty = empty
        self.reset()

    def reset(self) -> None:
        """Forget what was charged (after a warm-up; call it with no hook running)."""
        self.hook_ns = 0
        self.entries = 0
        """Hook entries (outermost or nested) seen."""
        self.originals = 0
        """Original calls made while a hook was the innermost frame."""
        self.by_hook: dict[str, list[int]] = {}
        """Hook name -> [ns charged, entries]."""

    def _charge(self, name: str, ns: int, entered: int = 0, original: int = 0) -> None:
        with self._lock:  # hooks also run on autograd's device thread (unpack, __del__, Function.backward)
            self.hook_ns += ns
            self.entries += entered
            self.originals += original
            row = self.by_hook.get(name)
            if row is None:
                row = self.by_hook[name] = [0, 0]
            row[0] += ns
            row[1] += entered

    def hook(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as a hook: its time (less the originals it calls) is charged."""
        clock, t = time.perf_counter_ns, self._t
        name = _name(fn)

        @functools.wraps(fn)
        def timed_hook(*args: Any, **kwargs: Any) -> Any:
            now = clock()
            stack = t.stack
            if stack and stack[-1] is not None:
                self._charge(stack[-1], now - t.last)  # a hook calling a hook: the outer one's time so far
            stack.append(name)
            t.last = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._charge(name, clock() - t.last, 1)
                stack.pop()
                t.last = clock()

        return timed_hook

    def stand_in(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """An empty hook: one frame that calls ``original`` (already wrapped by :meth:`original`), charged as a hook."""

        @functools.wraps(original)
        def empty_hook(*args: Any, **kwargs: Any) -> Any:
            return original(*args, **kwargs)

        return self.hook(empty_hook)

    def original(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as work a hook calls: its time is not charged."""
        clock, t = time.perf_counter_ns, self._t

        @functools.wraps(fn)
        def timed_original(*args: Any, **kwargs: Any) -> Any:
            now = clock()
            stack = t.stack
            if stack and stack[-1] is not None:
                self._charge(stack[-1], now - t.last, original=1)
            stack.append(None)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
                t.last = clock()

        return timed_original


def _name(fn: Any) -> str:
    """The hook's own module and qualified name (its code's, not what ``functools.wraps`` copied onto it), and
    for a wrapper, ``(wraps X)`` with what it wraps: a generic wrapper then says which stage it is."""
    code, glb = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if type(fn).__module__ == "bufreuse.native._hotpath":  # the C hot path's callables: named by their type
        name = f"{type(fn).__module__}.{type(fn).__qualname__}"
    elif code is None or glb is None:  # a C function, or a slot of a C type (the saved reference's finalizer)
        module = getattr(fn, "__module__", None) or getattr(getattr(fn, "__objclass__", None), "__module__", "?")
        return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"
    else:
        name = f"{glb.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None:
        name += f" (wraps {getattr(inner, '__qualname__', repr(inner))})"
    return name


def calibrate(repeats: int = 20000) -> dict[str, float]:
    """The clock's own cost charged per hook entry and per original call, in ns (median of 5 batches).

    A hook that does nothing is charged ``entry_ns``; each original call inside a hook adds ``original_ns``
    (both include one Python call frame, which real hooks also pay: the correction errs low).
    """

    def noop() -> None:
        return None

    def batch(k: int) -> float:
        clock = HookClock()
        inner = clock.original(noop)

        def body() -> None:
            for _ in range(k):
                inner()

        hooked = clock.hook(body)
        for _ in range(repeats):
            hooked()
        return clock.hook_ns / repeats

    entry = statistics.median(batch(0) for _ in range(5))
    with_one = statistics.median(batch(1) for _ in range(5))
    return {"entry_ns": entry, "original_ns": max(with_one - entry, 0.0)}


@contextlib.contextmanager
def pool_hook_code_wrapped(wrap: Callable[[Callable[..., Any], str], Callable[..., Any]]) -> Iterator[None]:
    """For the block, ``wrap(fn, name)`` replaces the hook code that no override point encloses: the saved-reference
    holder's ``__del__`` (the deferred release, run by autograd) and the autograd Functions' ``backward``."""
    from bufreuse.integrations.alltoall import functions
    from bufreuse.pool import tracking

    undo: list[Callable[[], None]] = []

    def patch(obj: Any, attr: str, value: Any) -> None:
        own = attr in vars(obj)  # else inherited (the C finalizer of the saved reference): deleted again after
        old = vars(obj).get(attr)
        setattr(obj, attr, value)
        undo.append(lambda: setattr(obj, attr, old) if own else delattr(obj, attr))

    try:
        patch(tracking._SavedRef, "__del__", wrap(tracking._SavedRef.__del__, "saved-reference release (__del__)"))
        for fn_cls in (functions.RingAllToAll, functions.CatIntoRing):
            backward = vars(fn_cls)["backward"].__func__
            patch(fn_cls, "backward", staticmethod(wrap(backward, f"{fn_cls.__name__}.backward")))
        yield
    finally:
        while undo:
            undo.pop()()


@contextlib.contextmanager
def saved_pair_wrapped(transform: Callable[[Any, Any], tuple[Any, Any]]) -> Iterator[None]:
    """Pools built inside the block get ``transform(pack, unpack)`` as their saved-tensor hook pair."""
    from bufreuse.pool import tracking

    pack_unpack = tracking._pack_unpack
    tracking._pack_unpack = lambda registry, strict, hotpath=None: transform(*pack_unpack(registry, strict, hotpath))
    try:
        yield
    finally:
        tracking._pack_unpack = pack_unpack


@contextlib.contextmanager
def instrumented(clock: HookClock) -> Iterator[Callable[[], None]]:
    """Wrap the pool's and the Functions' hook code for the block; yields ``arm()``, to call around ``install()``.

    ``arm()`` is a context manager: while it is open :data:`~bufreuse.integrations.core.INSTRUMENT` is
    ``clock`` (the installation wraps its hook entries and originals) and pools built inside get
    hook-wrapped saved-tensor pairs.
    """
    from bufreuse.integrations import core

    @contextlib.contextmanager
    def arm() -> Iterator[None]:
        with saved_pair_wrapped(lambda pack, unpack: (clock.hook(pack), clock.hook(unpack))):
            core.INSTRUMENT = clock
            try:
                yield
            finally:
                core.INSTRUMENT = None

    with pool_hook_code_wrapped(lambda fn, _name: clock.hook(fn)):  # the clock names hooks by their code
        yield arm
