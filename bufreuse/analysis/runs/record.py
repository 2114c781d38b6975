"""One run, whatever it came from (sweep metrics, Megatron log, snapshot), and ring slot sizes.

:class:`RunRecord` is what ``compare`` works on; :mod:`.resolve` builds them. Slot sizes given on
the command line (``--slot-bytes`` / ``--slot-mib``) are parsed here, with the buffer names the
pool uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bufreuse.analysis.runs.hostlist import HostSet
from bufreuse.errors import InputError

__all__ = ["BUFFER_ALIASES", "MIB", "RunRecord", "normalise_buffer", "parse_slot_sizes"]

MIB = 1 << 20
BUFFER_ALIASES = {
    "dispatch": "dispatch_output",
    "dispatch_output": "dispatch_output",
    "expert": "expert_fc2_output",
    "expert_output": "expert_fc2_output",
    "expert_fc2_output": "expert_fc2_output",
}


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """One run, normalised: per-iteration samples where known, peaks in bytes, ring sizes."""

    label: str
    source: Path
    kind: str
    """``sweep`` (metrics.json), ``megatron`` (training log) or ``snapshot`` (allocator snapshot)."""
    status: str = "ok"
    tflops: Sequence[float] = field(default_factory=list)
    """Steady-state throughput per GPU, one value per sample (a log window or a measured step); a log's
    series are ``array('d')`` / ``array('q')`` (8 bytes a sample: compare holds every run's at once)."""
    tflops_windows: Sequence[int] = field(default_factory=list)
    """Iterations each ``tflops`` value averages over (empty: one each)."""
    tflops_value: float | None = None
    """A single throughput figure when no per-iteration values exist (``metrics.json["tflops"]``)."""
    step_ms: Sequence[float] = field(default_factory=list)
    step_windows: Sequence[int] = field(default_factory=list)
    """Iterations each ``step_ms`` value averages over (empty: one each)."""
    step_iters: Sequence[int] = field(default_factory=list)
    """A log's only: the iteration that ends each ``step_ms`` window (empty: not known, a sweep's steps)."""
    tflops_iters: Sequence[int] = field(default_factory=list)
    """A log's only: the iteration that ends each ``tflops`` window."""
    max_allocated_bytes: int | None = None
    max_reserved_bytes: int | None = None
    max_active_bytes: int | None = None
    """Snapshots only: peak of allocated plus pending-free blocks (what the allocator could not reuse)."""
    device_used_bytes: int | None = None
    pending_free_bytes: int | None = None
    ring_slots: dict[str, int] = field(default_factory=dict)
    ring_slot_bytes: dict[str, int] = field(default_factory=dict)
    slot_bytes_source: str | None = None
    nodes: HostSet | None = None
    nodes_source: str | None = None
    """Where ``nodes`` came from when not SLURM or ``job.json``: the DeepSpeed launcher's lines, pdsh prefixes."""
    software: dict[str, str] = field(default_factory=dict)
    """Versions the run's log prints (``torch``, ``deepspeed``, ``cuda``)."""
    config: dict[str, str] = field(default_factory=dict)
    """The run's parallel layout, batch, sequence, precision and recompute (:mod:`.comparability`)."""
    job_id: str | None = None
    dropped: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    memory_only: bool = False
    """A log of memory reports with no iteration line: compared on memory alone."""
    oom_events: int = 0
    """Out-of-memory events the run recorded (a snapshot's trace, a log's ``CUDA out of memory`` lines): its
    memory peaks are then lower bounds."""
    named: bool = True
    """The user named this run itself (a file, a configuration folder, a label such as ``slots4``); False for a
    run that came with a group (a whole sweep folder, ``feature``). A named run that yields no comparison is an
    error; a run of a group stays a labelled failed row."""

    @property
    def node_list(self) -> list[str] | None:
        """The node names when the node set is known and small enough to expand."""
        return list(self.nodes.hosts) if self.nodes is not None and self.nodes.hosts is not None else None

    @property
    def ring_bytes(self) -> int | None:
        """Persistent ring storage (slots × slot size summed over buffers), None if a size is unknown."""
        total = 0
        for name, slots in self.ring_slots.items():
            if slots == 0:
                continue
            if name not in self.ring_slot_bytes:
                return None
            total += slots * self.ring_slot_bytes[name]
        return total


def normalise_buffer(name: str) -> str:
    """Map a user-facing buffer name (``dispatch``, ``expert``) to the pool's buffer name."""
    try:
        return BUFFER_ALIASES[name.strip().lower()]
    except KeyError:
        raise InputError(f"unknown buffer {name!r}; use one of {', '.join(sorted(BUFFER_ALIASES))}") from None


def parse_slot_sizes(slot_bytes: list[str] | None = None, slot_mib: list[str] | None = None) -> dict[str, int]:
    """Parse ``BUF=BYTES`` / ``BUF=MIB`` options (a bare number applies to every ring buffer, key ``*``)."""
    sizes: dict[str, int] = {}
    for values, scale, option in ((slot_bytes or [], 1, "--slot-bytes"), (slot_mib or [], MIB, "--slot-mib")):
        for item in values:
            name, sep, number = item.rpartition("=")
            try:
                size = float(number)
            except ValueError:
                size = math.nan
            if not math.isfinite(size) or size <= 0:
                raise InputError(f"{option} {item!r}: expected BUF=SIZE or SIZE with SIZE > 0")
            key = normalise_buffer(name) if sep else "*"
            sizes[key] = round(size * scale)
    return sizes
