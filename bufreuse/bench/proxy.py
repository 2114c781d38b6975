"""The MoE-layer proxy workload: configuration, pool set-up and one configuration's run.

``run_configuration(config, paths)`` is the ``"proxy"`` workload of ``bufreuse.bench.workloads``:
it builds the layer (:class:`~bufreuse.bench.schedule.MoEProxy`), runs a timing pass (warm-up,
then ``steps`` timed steps, or a captured CUDA graph replayed ``steps`` times), then a separate
untimed recording pass that writes ``snapshot.pickle.gz``, and returns the metrics.

The proxy is **forward-only** (``torch.no_grad``): no autograd graph saves a view of a ring slot,
so releasing the dispatch output after the experts is safe in bf16. (A training step would have
to keep the dispatch slot until backward, or quantize the saved input; see docs/sweep.md.)

On CPU (``device: "cpu"``, tiny shapes, ``comm_ms: 0``) the same code runs with no streams, so the
schedule, the pool policies and the checksums are exercised without a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from bufreuse.bench import measure
from bufreuse.bench.schedule import DISPATCH, EXPERT, MoEProxy
from bufreuse.errors import BufreuseError, InputError
from bufreuse.sweepdir import ConfigPaths

__all__ = ["MODES", "ProxyConfig", "build_pool", "run_configuration", "warm_up"]

log = logging.getLogger(__name__)

MODES = ("control", "stream-ordered", "ring")
_BUFFERS = {"dispatch": DISPATCH, "expert": EXPERT}
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}  # fmt: skip


@dataclass(kw_only=True, slots=True)
class ProxyConfig:
    """One proxy configuration (the keys of ``config.json``); defaults are DESIGN.md's proxy."""

    mode: str = "control"
    """``control`` (record-stream, 0 slots), ``stream-ordered`` or ``ring``."""
    slots: int = 0
    """Ring slots per buffer (``ring`` only; 0 otherwise)."""
    buffers: list[str] = field(default_factory=lambda: ["dispatch", "expert"])
    """Buffers that take the mode's policy: ``dispatch`` and/or ``expert``; the others stay record-stream."""
    hidden: int = 4096
    """Hidden size."""
    ffn: int = 2048
    """Expert FFN size."""
    tokens: int = 32768
    """Capacity tokens per microbatch after dispatch (rows of each pooled buffer)."""
    local_experts: int = 8
    """Experts on this rank."""
    topk: int = 2
    """Copies of each token; the layer input has ``tokens / topk`` rows."""
    dtype: str = "bf16"
    """Activation and weight dtype: bf16, fp16 or fp32."""
    microbatches: int = 12
    """Microbatches issued per step (pipeline-depth proxy)."""
    steps: int = 20
    """Timed steps (or graph replays)."""
    warmup_steps: int = 3
    """Untimed eager steps first (also the CUDA-graph warm-up)."""
    warmup_s: float = 2.0
    """Least seconds of eager warm-up on a GPU: steps continue past ``warmup_steps`` until this much
    GPU time has run, so the GPU's clock and power settling under sustained load falls inside the warm-up,
    not the timed steps (measured: docs/benchmarks.md). Costs up to this many seconds per configuration;
    ignored on CPU."""
    record_steps: int = 2
    """Steps of the untimed snapshot-recording pass (0: no snapshot)."""
    comm_ms: float = 0.5
    """Emulated communication per dispatch and per combine on one GPU (``torch.cuda._sleep``)."""
    attn_gemms: int = 2
    """Independent [tokens/topk, hidden] x [hidden, hidden] GEMMs per microbatch on the compute stream."""
    cuda_graph: bool = False
    """Capture the whole step once after warm-up and replay it."""
    seed: int = 1234
    """Seed of inputs, weights and permutations (same in every mode: checksums must match)."""
    world_size: int = 1
    """Processes; > 1 runs real ``all_to_all_single`` between them under torchrun."""
    dist_backend: str = "nccl"
    """Process group at world size > 1: ``nccl`` (one GPU per process) or ``gloo`` (processes may share a GPU,
    or run on CPU; the all-to-all is staged through host memory on gloo's own stream: not NCCL's times)."""
    device: str = "cuda"
    """``cuda`` or ``cpu`` (tiny CPU runs for tests; no streams, no snapshot)."""
    rank: int = 0
    """This process's rank (from the environment, not from config.json)."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ProxyConfig:
        """Read the proxy's keys from a ``config.json`` dict (others ignored) and validate them."""
        names = {f.name for f in fields(cls)} - {"rank"}
        cfg = cls(**{k: v for k, v in config.items() if k in names and v is not None})
        cfg.rank = int(os.environ.get("RANK", "0"))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(name: str, why: str) -> InputError:
            return InputError(f"config.{name} = {getattr(self, name)!r}: {why}")

        if self.mode not in MODES:
            raise bad("mode", f"must be one of {', '.join(MODES)}")
        if self.mode == "ring" and self.slots < 1:
            raise bad("slots", "ring mode needs at least 1 slot per buffer")
        if self.mode != "ring" and self.slots != 0:
            raise bad("slots", f"must be 0 in {self.mode} mode")
        if not self.buffers or any(b not in _BUFFERS for b in self.buffers):
            raise bad("buffers", f"must be a non-empty list of {', '.join(_BUFFERS)}")
        for name in ("hidden", "ffn", "tokens", "local_experts", "topk", "microbatches", "steps", "world_size"):
            if int(getattr(self, name)) < 1:
                raise bad(name, "must be >= 1")
        for name in ("warmup_steps", "record_steps", "attn_gemms", "seed"):
            if int(getattr(self, name)) < 0:
                raise bad(name, "must be >= 0")
        if self.dtype not in _DTYPES:
            raise bad("dtype", f"must be one of {', '.join(_DTYPES)}")
        if self.tokens % (self.topk * self.local_experts * self.world_size):
            raise bad("tokens", "must be a multiple of topk * local_experts * world_size")
        if self.comm_ms < 0:
            raise bad("comm_ms", "must be >= 0")
        if not 0 <= self.warmup_s <= 600:
            raise bad("warmup_s", "must be between 0 and 600 seconds")
        if self.device not in ("cuda", "cpu"):
            raise bad("device", "must be cuda or cpu")
        if self.dist_backend not in ("nccl", "gloo"):
            raise bad("dist_backend", "must be nccl or gloo")
        if self.device == "cpu" and (
            self.comm_ms > 0 or self.cuda_graph or (self.world_size > 1 and self.dist_backend != "gloo")
        ):
            raise bad("device", "cpu runs need comm_ms 0, no cuda_graph and world_size 1 (or dist_backend gloo)")
        if self.cuda_graph and self.world_size > 1 and self.dist_backend == "gloo":
            raise bad("cuda_graph", "gloo collectives cannot be captured in a CUDA graph")
        if self.cuda_graph and self.warmup_steps < 1:
            raise bad("warmup_steps", "CUDA-graph capture needs at least 1 eager warm-up step")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("rank")
        return d


def build_pool(cfg: ProxyConfig, device: torch.device) -> Any:
    """A ``BufferPool`` with both proxy buffers registered under the configuration's policies."""
    from bufreuse.pool import BufferPool, Policy

    pool = BufferPool(device)
    policy = {"control": Policy.RECORD_STREAM, "stream-ordered": Policy.STREAM_ORDERED, "ring": Policy.RING}[cfg.mode]
    for short, name in _BUFFERS.items():
        chosen = policy if short in cfg.buffers else Policy.RECORD_STREAM
        slots = cfg.slots if chosen == Policy.RING else 0
        pool.register(name, policy=chosen, num_slots=slots, max_shape=(cfg.tokens, cfg.hidden), dtype=cfg.torch_dtype)
    return pool


def warm_up(proxy: MoEProxy, pool: Any, cfg: ProxyConfig) -> tuple[Callable[[], None], list[float]]:
    """Run the eager warm-up steps; with ``cuda_graph``, capture one step.

    Returns what one step runs and the warm-up step times (ms; kept in ``metrics.json`` as
    ``warmup_step_ms`` so a clock transient shows up there, not in ``step_ms``). The capture goes
    through the pool's phase API (``prepare_capture`` / ``finish_capture``), so ring events
    recorded eagerly are never waited on inside the capture.
    """
    compute = proxy.streams.compute
    min_ms = cfg.warmup_s * 1e3 if cfg.device == "cuda" else 0.0
    warm = measure.time_steps(proxy.step, cfg.warmup_steps, stream=compute, label="warm-up step", min_total_ms=min_ms)
    if not cfg.cuda_graph:
        return proxy.step, warm
    graph = torch.cuda.CUDAGraph()
    pool.prepare_capture(compute)
    with torch.cuda.graph(graph, stream=compute):
        proxy.step()
    pool.finish_capture()
    log.info("captured one step as a CUDA graph")
    return graph.replay, warm


def _device(cfg: ProxyConfig) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InputError("the proxy needs a CUDA GPU (config.device = 'cuda'); none is visible")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.dist_backend == "gloo":
        local %= torch.cuda.device_count()  # gloo: several processes may share a GPU (one H200: all on cuda:0)
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _group(cfg: ProxyConfig, device: torch.device) -> Any:
    if cfg.world_size == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        if cfg.dist_backend == "gloo":
            dist.init_process_group("gloo")
        else:
            os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
            dist.init_process_group("nccl", device_id=device)
    if dist.get_world_size() != cfg.world_size:
        raise InputError(f"config.world_size = {cfg.world_size} but torchrun started {dist.get_world_size()}")
    return dist.group.WORLD


@torch.no_grad()
def run_configuration(config: dict[str, Any], paths: ConfigPaths) -> dict[str, Any]:
    """Run one proxy configuration: timing pass, then recording pass; return the workload metrics."""
    cfg = ProxyConfig.from_config(config)
    device = _device(cfg)
    group = _group(cfg, device)
    pool = build_pool(cfg, device)
    proxy = MoEProxy(cfg, pool, device, group=group)
    compute = proxy.streams.compute
    log.info("proxy %s slots=%d buffers=%s graph=%s on %s", cfg.mode, cfg.slots, cfg.buffers, cfg.cuda_graph, device)
    if proxy.sleep_cycles:
        log.info("comm emulation: %d sleep cycles = %.3f ms", proxy.sleep_cycles, cfg.comm_ms)

    run, warm = warm_up(proxy, pool, cfg)
    values = measure.time_steps(run, cfg.steps, stream=compute)
    checksum = proxy.checksum()
    metrics: dict[str, Any] = measure.memory_figures(device)
    step_ms = measure.step_stats(values)
    metrics.update(
        step_ms=step_ms,
        tflops=proxy.flops_per_step() / (step_ms["median"] * 1e-3) / 1e12,
        flops_per_step=proxy.flops_per_step(),
        checksum=checksum,
        comm_sleep_cycles=proxy.sleep_cycles,
        warmup_step_ms=[round(v, 4) for v in warm],
    )
    stats = pool.stats()
    metrics["ring_bytes"] = {n: int(s.persistent_bytes) for n, s in stats.items() if s.persistent_bytes}
    metrics["ring_slot_bytes"] = {
        n: int(s.persistent_bytes) // cfg.slots for n, s in stats.items() if s.persistent_bytes and cfg.slots
    }
    metrics["ring_gpu_waits"] = {n: int(s.gpu_waits) for n, s in stats.items()}

    metrics["pending_free_at_max_active_bytes"] = None
    metrics["pending_free_by_category_at_max_active"] = None
    if device.type == "cuda" and cfg.record_steps and cfg.rank == 0:
        snap = paths.snapshot
        measure.record_snapshot(run, cfg.record_steps, snap, device=device, stream=compute)
        log.info("snapshot written: %s (%d bytes)", snap, snap.stat().st_size)
        try:
            metrics.update(measure.snapshot_figures(snap))
        except (ImportError, BufreuseError) as e:  # the timing figures stand; say why pending-free is missing
            log.warning("snapshot analysis failed: %s", e)
            metrics["snapshot_error"] = f"{type(e).__name__}: {e}"
    if cfg.cuda_graph:
        pool.after_replay(compute)
    if proxy.checksum() != checksum:
        raise RuntimeError("checksum changed between the timing and the recording pass (a ring slot was reused early)")
    return metrics
