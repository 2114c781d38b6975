"""Thin, fast access to CUDA streams and events; everything is a no-op for CPU tensors.

Why this exists: ``torch.cuda.current_stream()`` costs more than the whole ring bookkeeping of an
acquire+release pair (docs/benchmarks.md) and ``Stream.wait_event`` / ``Event.record`` go through two
or three Python frames each. The hot path therefore looks the current stream up by its raw pointer (one
dict lookup) and calls the C methods of ``torch._C._CudaEventBase`` directly (the CUDA call itself).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DeviceOps", "env_debug", "env_float", "is_capturing", "saved_hooks_push_pop"]


def saved_hooks_push_pop(pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``(push, pop)``: enter and leave torch's default saved-tensor hooks ``(pack, unpack)``.

    What ``torch.autograd.graph.saved_tensors_hooks`` does on enter/exit, without its two Python
    frames per region (the C functions directly, when this torch has them; contract:
    ``tests/test_hot_path.py``).
    """
    autograd = getattr(torch._C, "_autograd", None)
    push = getattr(autograd, "_push_saved_tensors_default_hooks", None)
    pop = getattr(autograd, "_pop_saved_tensors_default_hooks", None)
    if push is None or pop is None:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        return hooks.__enter__, lambda: hooks.__exit__(None, None, None)
    return functools.partial(push, pack, unpack), pop  # a C partial: no Python frame per region


def env_debug() -> bool:
    """``BUFREUSE_DEBUG`` set to anything but ``""``/``"0"`` turns debug mode on."""
    return os.environ.get("BUFREUSE_DEBUG", "") not in ("", "0")


def env_float(name: str, default: float) -> float:
    """A positive float from the environment, or ``default`` when unset or unparsable."""
    raw = os.environ.get(name, "")
    try:
        value = float(raw)
    except ValueError:
        return default
    return value if value > 0 else default


def is_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (False on CPU)."""
    if device.type != "cuda":
        return False
    return bool(torch.cuda.is_current_stream_capturing())


class DeviceOps:
    """Stream lookup and event record/wait for one device; on CPU every operation does nothing.

    ``current_stream()`` caches one ``torch.cuda.Stream`` object per raw stream pointer, so repeated
    calls return the *same* object (the ring compares streams with ``is`` to skip same-stream waits).
    """

    __slots__ = ("_by_ptr", "_index", "_raw", "capturing", "cuda", "device", "record", "wait")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._by_ptr: dict[int, Any] = {}
        self._index = device.index if device.index is not None else 0
        self._raw: Callable[[int], int] | None = None
        self.record: Callable[[Any, Any], None] = _noop2
        self.wait: Callable[[Any, Any], None] = _noop2
        self.capturing: Callable[[], bool] = _false
        """Whether the current stream is capturing a CUDA graph: one C call, no Python frame (production
        mode asks it once per eager acquisition)."""
        if self.cuda:
            base = torch._C._CudaEventBase
            self.record = base.record
            self.wait = base.wait
            self._raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            self.capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)

    def new_event(self) -> Any:
        """One reusable event (no timing, so recording is cheap); ``None`` on CPU."""
        return torch.cuda.Event() if self.cuda else None

    def current_stream(self) -> Any:
        """The current stream of this device as a cached object; ``None`` on CPU."""
        if not self.cuda:
            return None
        raw = self._raw
        if raw is None:
            return torch.cuda.current_stream(self.device)
        ptr = raw(self._index)
        stream = self._by_ptr.get(ptr)
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
            self._by_ptr[ptr] = stream
        return stream

    def stream_is_current(self, stream: Any) -> bool:
        """Whether ``stream`` is the current stream (cheap: compares raw pointers)."""
        if not self.cuda or stream is None:
            return True
        raw = self._raw
        if raw is None:
            return stream == torch.cuda.current_stream(self.device)
        return raw(self._index) == stream.cuda_stream


def _noop2(_a: Any, _b: Any) -> None:
    return None


def _false() -> bool:
    return False
