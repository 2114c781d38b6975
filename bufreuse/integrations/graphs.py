"""CUDA graphs on the NCCL all-to-all ring path: the pool's phase API around a full-iteration graph.

A captured iteration bakes the slot addresses into the graph, so every replay must find the rings
exactly as the capture did: cursor at slot 0, nothing held, no eager event still pending. The
pool's phase API (``prepare_capture`` / ``finish_capture`` / ``after_replay``) does that; this
module calls it at the right points, for one or several pools at once:

- :class:`GraphPhases` / :func:`capture_iteration`: for users with their own capture loop::

      phases = GraphPhases(installation)          # or a BufferPool, or a list of them
      with phases.capture(stream), torch.cuda.graph(g, stream=stream):
          step()                                  # one whole iteration; releases every slot it takes
      for _ in range(n):
          phases.replay(g)                        # orders the replay after earlier eager releases
      phases.before_eager()                       # eager producers wait for the replays (GPU side)
      step()

  Warm up on the capture stream, or create the parameters' ``AccumulateGrad`` nodes there as
  Megatron-LM's DDP set-up does: a node kept alive from an eager iteration on the default stream
  makes the captured backward depend on that stream (``cudaErrorStreamCaptureImplicit``; docs/megatron.md).

- :func:`patch_full_iteration`: wraps megatron-core's ``FullCudaGraphWrapper.__call__`` (the
  ``cuda_graph_impl="full_iteration"`` path of Megatron-LM's training loop) so that the capture
  call runs inside :meth:`GraphPhases.capture` on megatron's capture stream, replays are ordered
  after eager releases, and an eager call after replays starts with ``after_replay``. Installed by
  :func:`bufreuse.integrations.megatron.install`, removed by the last ``uninstall()``.

Costs: one event record per ring per phase change;
nothing on the replay itself. No slot may be held across an iteration boundary: a held slot at a
phase change raises :class:`~bufreuse.pool.CaptureStateError` naming it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from bufreuse.pool import BufferPool, CaptureStateError, Phase

__all__ = ["GraphPhases", "capture_iteration", "patch_full_iteration", "pools_of", "wrap_full_iteration_call"]


def pools_of(target: Any) -> list[BufferPool]:
    """The distinct pools behind ``target``: a pool, an ``Installation`` (``.pool``), or an iterable of those."""
    if isinstance(target, BufferPool):
        items: Iterable[Any] = [target]
    elif hasattr(target, "pool") and isinstance(target.pool, BufferPool):
        items = [target.pool]
    elif isinstance(target, Iterable):
        items = [p for t in target for p in pools_of(t)]
    else:
        raise TypeError(f"expected a BufferPool, an Installation or a list of them, got {type(target).__name__}")
    seen: dict[int, BufferPool] = {}
    for pool in items:
        seen.setdefault(id(pool), pool)
    return list(seen.values())


def _current(stream: Any) -> Any:
    if stream is not None:
        return stream
    return torch.cuda.current_stream() if torch.cuda.is_available() else None


class GraphPhases:
    """Drive the capture -> replay -> eager phases of every pool behind ``target`` together."""

    def __init__(self, target: Any) -> None:
        self.pools = pools_of(target)

    def check_boundary(self, where: str) -> None:
        """Raise ``CaptureStateError`` if any slot is still held at an iteration boundary."""
        for pool in self.pools:
            for name in pool.names():
                entry = pool.get(name)
                if entry.held:
                    raise CaptureStateError(
                        f"buffer '{name}': {entry.held} acquisition(s) still held {where}; a graphed iteration "
                        "must release every buffer it acquires (the final reader's backward included)"
                    )

    def before_eager(self, stream: Any = None) -> None:
        """Before eager use after replays: producers wait (GPU side) on ``stream``, where the replays ran."""
        stream = _current(stream)
        for pool in self.pools:
            if pool.phase is Phase.GRAPHED:
                pool.after_replay(stream)

    def before_replay(self, stream: Any = None) -> None:
        """Before replaying on ``stream``: order it after every release made by eager use since the capture.

        The graph writes the slots without waiting on eager release events, so ``stream`` waits on them
        here (``BufferPool.before_replay``); pools already graphed (no eager use since) cost nothing.
        """
        stream = _current(stream)
        for pool in self.pools:
            pool.before_replay(stream)

    def replay(self, graph: Any, stream: Any = None) -> None:
        """``before_replay`` then ``graph.replay()`` on the current stream."""
        self.before_replay(stream)
        graph.replay()

    @contextlib.contextmanager
    def capture(self, stream: Any = None) -> Iterator[GraphPhases]:
        """Enter *outside* ``torch.cuda.graph(g, stream=stream)``; the block captures one whole iteration.

        Before: ordered after earlier replays (``after_replay`` on the current stream), then
        ``prepare_capture(stream)`` (``stream`` waits on outstanding releases, cursors to slot 0). After:
        ``finish_capture()``. If the block raises or leaves a slot held (``CaptureStateError`` naming it),
        the pools drop what the capture held and return to eager.
        """
        self.before_eager()
        with contextlib.ExitStack() as stack:
            for pool in self.pools:
                stack.enter_context(pool.graph_capture(stream))
            yield self
            self.check_boundary("at the end of a captured iteration")


def capture_iteration(target: Any, stream: Any = None) -> contextlib.AbstractContextManager[GraphPhases]:
    """``GraphPhases(target).capture(stream)``: the context manager for a user's own capture loop."""
    return GraphPhases(target).capture(stream)


def patch_full_iteration(undo: list[Callable[[], None]], pools: Callable[[], list[BufferPool]]) -> bool:
    """Wrap ``FullCudaGraphWrapper.__call__``; append its restore to ``undo``. False if megatron-core has none.

    ``pools()`` returns the pools of the live installations at call time (none: the call runs untouched).
    """
    from bufreuse.integrations._compat_megatron import full_cuda_graph_wrapper, shared_capture_stream

    cls = full_cuda_graph_wrapper()
    if cls is None:
        return False
    orig = vars(cls)["__call__"]
    cls.__call__ = wrap_full_iteration_call(orig, pools, shared_capture_stream)
    undo.append(lambda: setattr(cls, "__call__", orig))
    return True


def wrap_full_iteration_call(
    orig: Callable[..., Any], pools: Callable[[], list[BufferPool]], capture_stream: Callable[[], Any]
) -> Callable[..., Any]:
    """The phase logic around one ``FullCudaGraphWrapper.__call__`` (per stage: training / validation).

    The wrapper runs ``cuda_graph_warmup_steps`` eager iterations, captures the next one on its capture
    stream and replays it at once and on every later call. Replay calls: ordered after eager releases.
    The capture call: inside :meth:`GraphPhases.capture`. Eager calls: ``after_replay`` first (the other
    stage's graph may have replayed), and no slot may be left held after them.
    """

    @functools.wraps(orig)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        live = pools()
        if not live:
            return orig(self, *args, **kwargs)
        phases = GraphPhases(live)
        stage = "validation" if kwargs.get("forward_only") else "training"
        if getattr(type(self), "cuda_graph", {}).get(stage) is not None:
            phases.before_replay()
            return orig(self, *args, **kwargs)
        phases.check_boundary("before an iteration")
        if self.curr_iter(stage) == self.cuda_graph_warmup_steps:
            with phases.capture(capture_stream()):  # capture, then megatron's first replay
                return orig(self, *args, **kwargs)
        phases.before_eager()
        result = orig(self, *args, **kwargs)
        phases.check_boundary("after an eager iteration")
        return result

    return __call__
