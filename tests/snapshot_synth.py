"""Build synthetic allocator snapshots for the snapshot tests (plain data, as torch writes it).

``simulate`` runs a tiny model of the caching allocator over a list of operations and returns the
full trace plus the final segments, so a test can cut the trace (as the recording ring buffer
does) and compare the replay against the brute-force truth.
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SEG = 2 << 20
USER = {"filename": "/work/model/moe.py", "line": 10, "name": "forward"}
TORCH = {"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}


def frame(filename: str, name: str, line: int = 1) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


def entry(action: str, addr: int, size: int, stream: int = 0, frames: list | None = None, **kw: Any) -> dict:
    e = {"action": action, "addr": addr, "size": size, "stream": stream, "frames": frames or [TORCH, USER]}
    e.update(kw)
    return e


def segment(addr: int, total: int, blocks: list[dict], *, stream: int = 0, device: int = 0, **kw: Any) -> dict:
    s = {
        "device": device,
        "address": addr,
        "total_size": total,
        "stream": stream,
        "segment_type": "large",
        "blocks": blocks,
    }
    s.update(kw)
    return s


def block(addr: int, size: int, state: str, requested: int | None = None) -> dict:
    b = {"address": addr, "size": size, "state": state, "frames": []}
    if requested is not None:
        b["requested_size"] = requested
    return b


def write(path: Path, obj: Any, *, gz: bool = False) -> Path:
    data = pickle.dumps(obj)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@dataclass
class Sim:
    """Brute-force allocator model: one segment per block, addresses never reused while live."""

    trace: list[dict] = field(default_factory=list)
    live: dict[int, int] = field(default_factory=dict)  # addr -> size (allocated)
    pending: dict[int, int] = field(default_factory=dict)  # addr -> size (free requested)
    cached: dict[int, int] = field(default_factory=dict)  # addr -> segment size (inactive)
    reserved: int = 0
    next_addr: int = 1 << 32
    series: list[tuple[int, int, int]] = field(default_factory=list)  # (reserved, allocated, pending)

    def _emit(self, e: dict) -> None:
        self.trace.append(e)
        self.series.append((self.reserved, sum(self.live.values()), sum(self.pending.values())))

    def op(self, kind: int, size: int, stream: int) -> None:
        """kind 0 alloc, 1 plain free, 2 free through the pending queue, 3 complete a pending free, 4 empty_cache."""
        if kind == 0:
            seg = -(-size // SEG) * SEG
            addr = next((a for a, s in self.cached.items() if s == seg), None)
            if addr is None:
                addr, self.next_addr = self.next_addr, self.next_addr + seg
                self.reserved += seg
                self._emit(entry("segment_alloc", addr, seg, stream))
            else:
                del self.cached[addr]
            self.live[addr] = size
            self._emit(entry("alloc", addr, size, stream))
        elif kind in (1, 2) and self.live:
            addr = sorted(self.live)[size % len(self.live)]
            sz = self.live.pop(addr)
            if kind == 1:  # a plain free: requested and completed back to back, never pending
                self._emit(entry("free_requested", addr, sz, stream))
                self.cached[addr] = -(-sz // SEG) * SEG
                self._emit(entry("free_completed", addr, sz, stream))
                return
            self.pending[addr] = sz
            self._emit(entry("free_requested", addr, sz, stream))
        elif kind == 3 and self.pending:
            addr = size if size in self.pending else sorted(self.pending)[size % len(self.pending)]
            if self.trace[-1]["action"] == "free_requested" and self.trace[-1]["addr"] == addr:
                # back to back reads as a plain free; torch always has other entries in between
                self._emit(entry("snapshot", 0, 0, stream))
            sz = self.pending.pop(addr)
            self.cached[addr] = -(-sz // SEG) * SEG
            self._emit(entry("free_completed", addr, sz, stream))
        elif kind == 4:
            for addr, seg in sorted(self.cached.items()):
                self.reserved -= seg
                self._emit(entry("segment_free", addr, seg, stream))
            self.cached.clear()

    def segments(self) -> list[dict]:
        out = []
        for addr, size in self.live.items():
            seg = -(-size // SEG) * SEG
            out.append(segment(addr, seg, [block(addr, seg, "active_allocated", size)]))
        for addr, size in self.pending.items():
            seg = -(-size // SEG) * SEG
            out.append(segment(addr, seg, [block(addr, seg, "active_pending_free", size)]))
        for addr, seg in self.cached.items():
            out.append(segment(addr, seg, [block(addr, seg, "inactive", 0)]))
        return out
