"""One real megatron-core ``MoELayer``, control vs the hooks' policies, interleaved rounds in one process.

``run_layer_bench`` builds the layer once (all-to-all dispatcher, EP = 1, world of one), then runs
rounds in A B B A order (control first: C P P C C P P C ...), each round installing the arm's hooks
on a fresh production-mode pool (``install()``), running one untimed schedule (ring slots, caches)
and ``steps`` timed ones, and uninstalling. Per layer call it measures the host time of the forward
and of the backward apart (``perf_counter`` around the Python calls, nothing synchronised inside),
the wall time of the round (a device synchronise only at the round's ends) and, on CUDA, the
CUDA-event span of each call. Warm-up rounds are dropped.

Each arm round is paired with its neighbouring control round (A B B A: the arm's first round of a cycle
with the cycle's first control round, its second with the second), so slow drift cancels; the arm's
figure is the geometric mean of its paired ratios with a 95% t interval
(:func:`bufreuse.analysis.runs.stats.mean_diff_interval` on the logs) and the project's verdict rule
(:func:`bufreuse.analysis.runs.verdicts.judge`, band ``band_pct``). The unpaired ratio (geometric means
over all rounds, Welch) is kept beside it, and the control's own drift (its second half of rounds
against its first) is judged the unpaired way.

At EP = 1 the rings replace nothing and ``install()`` leaves them alone (no hooks, no cost); the bench
rings the expert FC2 output anyway (``ring_single_rank_expert``), so it measures the expert ring's hooks as
they run where they are used (EP > 1), without the dispatch copy an EP = 1 dispatch ring would add.

On CUDA the layer is called as a module (``layer(x)``; FP8 in megatron's ``get_fp8_context``). On CPU
megatron's router moves its weight to CUDA and the dropless dispatcher copies counts on a CUDA
stream, so the CPU layer runs pad-to-capacity and its stages are called in the module's order with
the router's own ``routing`` over CPU logits: the host figure is then the figure, and there is no GPU
figure.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import math
import platform
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bufreuse.analysis.runs.stats import mean_diff_interval
from bufreuse.analysis.runs.verdicts import Bands, MetricDelta, judge
from bufreuse.config import POLICIES, BufReuseConfig
from bufreuse.errors import InputError

__all__ = [
    "METRICS",
    "PRESETS",
    "SCHEDULES",
    "LayerBenchConfig",
    "round_order",
    "run_layer_bench",
    "schedule_steps",
]

_FLAG = {"microbatches": "--num-microbatches", "slots": "--ring-slots", "warmup": "--warmup-rounds"}
"""The ``bench layer`` option of a config field, where the two names differ (the messages name the option)."""

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 32, "ffn": 64, "experts": 8, "topk": 2, "tokens": 64},
    "host-bound": {"hidden": 1024, "ffn": 1024, "experts": 8, "topk": 2, "tokens": 2048},
    "gpu-bound": {"hidden": 4096, "ffn": 4096, "experts": 16, "topk": 4, "tokens": 4096},
}
"""Layer shapes by name (``tiny`` is the CPU default)."""

SCHEDULES = ("sequential", "interleaved")
GC_MODES = ("auto", "manual")
METRICS = {
    "host_us": ("host µs / call (fwd + bwd)", "µs"),
    "fwd_host_us": ("host µs / forward", "µs"),
    "bwd_host_us": ("host µs / backward", "µs"),
    "wall_ms": ("wall ms / call", "ms"),
    "gpu_ms": ("GPU ms / call (CUDA events)", "ms"),
}
"""Per-round figures: key -> (title, unit). ``gpu_ms`` is None on CPU."""

Progress = Callable[[int, int], None]


@dataclass(kw_only=True, slots=True)
class LayerBenchConfig:
    """What ``bufreuse bench layer`` measures."""

    hidden: int = 32
    ffn: int = 64
    experts: int = 8
    topk: int = 2
    tokens: int = 64
    """Tokens per microbatch entering the layer (the input is ``[tokens, 1, hidden]``)."""
    microbatches: int = 4
    """Microbatches per schedule."""
    steps: int = 16
    """Timed schedules per round (after one untimed schedule)."""
    rounds: int = 6
    """Measured rounds per arm (even: A B B A cycles)."""
    warmup: int = 1
    """Warm-up rounds per arm (run in arm order before the measured rounds, dropped)."""
    spec: str = "local"
    """``local`` (SequentialMLP) or ``te`` (TEGroupedMLP over TE GroupedLinear)."""
    precision: str = "bf16"
    """``bf16`` or ``fp8`` (TE, hybrid format, delayed scaling)."""
    schedule: str = "interleaved"
    """``sequential`` (F0 B0 F1 B1 ...) or ``interleaved`` (F0 F1 B0 F2 B1 ... : two in flight)."""
    policies: tuple[str, ...] = ("ring",)
    """Arms against the control: the pool policies (the expert ring exercised at EP = 1, as where it is used),
    and ``as-installed``: the ring policy under ``install()``'s production rule, which uses no ring at EP x ETP
    = 1 (what a user's EP = 1 run gets)."""
    slots: int = 3
    """Ring slots of the dispatch and expert rings (``ring`` policy)."""
    band_pct: float = 1.0
    """Parity band of the verdicts, percent."""
    device: str | None = None
    """``cuda``/``cuda:N`` or ``cpu``; default: CUDA when available."""
    seed: int = 1234
    pad: bool = False
    """Pad-to-capacity routing (capacity factor 1.0) on CUDA too: megatron's dropless path makes the host
    wait for the per-expert counts every call, which hides the hooks' host time; pad mode does not wait,
    so host µs is Python and launches alone. CPU always runs pad mode."""
    preset: str | None = None
    """The preset the shape came from (recorded; :func:`layer_config` applies it)."""
    dispatch_ring: bool = False
    """Also exercise the dispatch buffer at EP = 1 (``install(ring_identity_dispatch=True)``, every policy arm), as
    where it is used (EP > 1): its hooks' host time joins the expert buffer's. At EP = 1 the ring's all-to-all is
    one copy into the slot that the control does not make (the upstream all-to-all returns its input); at EP > 1
    both arms write the all-to-all's output, the control into a fresh allocation."""
    gc: str = "auto"
    """``auto`` (Python's cyclic collector runs when its thresholds say, inside whatever code is running) or
    ``manual`` (as Megatron-LM's ``--manual-gc``, which large MoE recipes use: collected before each round, disabled
    during it), so a collection does not land inside one arm's figures."""


def layer_config(
    preset: str | None, *, device: str | None, shape: dict[str, int | None], **rest: Any
) -> LayerBenchConfig:
    """The config of ``preset`` (default: ``tiny`` without CUDA, ``host-bound`` with it), ``shape``'s given
    entries overriding the preset's."""
    if preset is None:
        cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        preset = "host-bound" if cuda else "tiny"
    if preset not in PRESETS:
        raise InputError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    merged = {**PRESETS[preset], **{k: v for k, v in shape.items() if v is not None}}
    return LayerBenchConfig(**merged, device=device, preset=preset, **rest)


# -- orders ----------------------------------------------------------------------------------------


def schedule_steps(schedule: str, microbatches: int) -> list[tuple[str, int]]:
    """``[("F", 0), ("B", 0), ...]``: sequential, or 1F1B-like with two microbatches in flight."""
    if schedule == "sequential":
        return [(s, i) for i in range(microbatches) for s in ("F", "B")]
    ahead = min(2, microbatches)
    steps = [("F", i) for i in range(ahead)]
    for i in range(microbatches):
        steps.append(("B", i))
        if i + ahead < microbatches:
            steps.append(("F", i + ahead))
    return steps  # F0 F1 B0 F2 B1 F3 B2 B3: each backward makes room for the next forward


def in_flight(steps: list[tuple[str, int]]) -> int:
    """The most microbatches whose forward ran and backward did not."""
    live = peak = 0
    for kind, _ in steps:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def round_order(arms: list[str], rounds: int, warmup: int) -> list[dict[str, Any]]:
    """Every round: ``{"arm", "warmup", "cycle"}``; warm-up passes in arm order, then A B B A cycles."""
    order = [{"arm": a, "warmup": True, "cycle": None} for _ in range(warmup) for a in arms]
    for cycle in range(rounds // 2):
        order += [{"arm": a, "warmup": False, "cycle": cycle} for a in arms + arms[::-1]]
    return order


# -- validation ------------------------------------------------------------------------------------


def check_config(cfg: LayerBenchConfig) -> torch.device:
    """Refuse bad input before anything is built (InputError names the option); the device to use."""
    if cfg.spec not in ("local", "te"):
        raise InputError(f"--spec must be local or te, got {cfg.spec!r}")
    if cfg.gc not in GC_MODES:
        raise InputError(f"--gc must be one of {', '.join(GC_MODES)}, got {cfg.gc!r}")
    if cfg.precision not in ("bf16", "fp8"):
        raise InputError(f"--precision must be bf16 or fp8, got {cfg.precision!r}")
    if cfg.schedule not in SCHEDULES:
        raise InputError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    bad = [p for p in cfg.policies if p not in ARMS]
    if bad or not cfg.policies or len(set(cfg.policies)) != len(cfg.policies):
        raise InputError(f"--policies: a comma list of distinct {', '.join(ARMS)}, got {','.join(cfg.policies)!r}")
    for name in ("hidden", "ffn", "experts", "topk", "tokens", "microbatches", "steps", "slots"):
        if getattr(cfg, name) < 1:
            raise InputError(f"{_FLAG.get(name, '--' + name)} must be >= 1, got {getattr(cfg, name)}")
    if cfg.rounds < 2 or cfg.rounds % 2:
        raise InputError(f"--rounds must be even and >= 2 (A B B A cycles), got {cfg.rounds}")
    if cfg.warmup < 0:
        raise InputError(f"--warmup-rounds must be >= 0, got {cfg.warmup}")
    if cfg.topk > cfg.experts:
        raise InputError(f"--topk {cfg.topk} is more than --experts {cfg.experts}")
    if not (math.isfinite(cfg.band_pct) and cfg.band_pct >= 0):
        raise InputError(f"--band-pct must be a finite number >= 0, got {cfg.band_pct}")
    depth = in_flight(schedule_steps(cfg.schedule, cfg.microbatches))
    if "ring" in cfg.policies and cfg.slots < depth:
        raise InputError(
            f"--ring-slots {cfg.slots} is fewer than the {depth} microbatches the {cfg.schedule} schedule keeps in "
            "flight"
        )
    device = _device(cfg.device)
    if device.type == "cpu" and cfg.spec == "te":
        raise InputError("--spec te needs a CUDA device (Transformer Engine runs on GPUs); use --spec local on CPU")
    if cfg.precision == "fp8" and cfg.spec != "te":
        raise InputError("--precision fp8 needs --spec te (megatron's FP8 GEMMs are Transformer Engine's)")
    _check_megatron()
    if cfg.spec == "te":
        _check_te(cfg)
    return device


MEGATRON_MISSING = (
    "bench layer runs a real megatron-core MoELayer, and megatron-core is not installed: "
    "pip install 'bufreuse[megatron]' (on Python 3.11: bash scripts/ci/install-megatron.sh)"
)


def _check_megatron() -> None:
    """Refuse in one line, naming the extra to install, where megatron-core is missing or does not import."""
    try:
        import megatron.core  # noqa: F401
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "megatron":  # installed, but a dependency of it is missing
            raise InputError(f"bench layer needs megatron-core, and importing it failed ({e})") from None
        raise InputError(MEGATRON_MISSING) from None
    except Exception as e:  # an installed megatron-core that fails to import
        raise InputError(f"bench layer needs megatron-core, and importing it failed ({e})") from None


def _check_te(cfg: LayerBenchConfig) -> None:
    try:
        import transformer_engine.pytorch as te
    except Exception as e:  # ImportError, or a TE build that fails to load its library
        raise InputError(f"--spec te needs Transformer Engine: importing it failed ({e})") from None
    if cfg.precision == "fp8":
        ok, why = te.is_fp8_available(return_reason=True)
        if not ok:
            raise InputError(f"--precision fp8: FP8 is not available on this GPU ({why})")
        bad = [f"--{n} {getattr(cfg, n)}" for n in ("hidden", "ffn") if getattr(cfg, n) % 16]
        if bad:
            raise InputError(f"--precision fp8 needs --hidden and --ffn multiples of 16 (FP8 GEMMs): {', '.join(bad)}")


def _device(name: str | None) -> torch.device:
    from bufreuse.bench.pool_bench import _resolve_device

    try:
        return _resolve_device(name)
    except ValueError as e:
        raise InputError(f"--{e}") from None


# -- the layer -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _world_of_one(device: torch.device) -> Iterator[None]:
    """A world-size-1 process group (gloo on CPU, nccl on CUDA) and TP = PP = EP = 1 model-parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if device.type == "cuda":
        torch.cuda.set_device(device)
    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    owned = not ps.model_parallel_is_initialized()
    if owned:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        if owned:
            ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def _build_layer(cfg: LayerBenchConfig, device: torch.device) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = device.type == "cuda"
    kw: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=cfg.hidden,
        ffn_hidden_size=cfg.ffn,
        num_attention_heads=1,
        num_moe_experts=cfg.experts,
        moe_router_topk=cfg.topk,
        moe_router_pre_softmax=cfg.topk == 1,  # megatron-core refuses top-1 routing without it
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=cfg.spec == "te",
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    if cfg.precision == "fp8":
        kw.update(fp8="hybrid", fp8_recipe="delayed")
    if not cuda or cfg.pad:
        # Dropless routing copies the per-expert counts to the host on a CUDA stream; pad mode does not.
        kw.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    if not cuda:
        kw.update(use_cpu_initialization=True)
    torch.manual_seed(cfg.seed)
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(cfg.seed)
    try:
        tcfg = TransformerConfig(**kw)
    except (ValueError, AssertionError) as e:  # the shape flags: a user's input, said in one line
        raise InputError(f"megatron-core refuses this layer: {e}") from e
    if cfg.spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=cfg.experts, moe_grouped_gemm=True)
    else:
        spec = get_gpt_layer_local_spec(num_experts=cfg.experts, moe_grouped_gemm=False)
    with _cpu_dispatcher_stream(cuda):
        layer = spec.submodules.mlp(config=tcfg)
    # CUDA: parameters are made there in bf16 (a dtype cast would also cast TE's FP8 scaling state). CPU: the
    # router's weight is cast too (its routing runs here, on bf16 logits).
    return layer.cuda(device) if cuda else layer.to(dtype=torch.bfloat16)


@contextlib.contextmanager
def _cpu_dispatcher_stream(cuda: bool) -> Iterator[None]:
    """On CPU, a stand-in for the CUDA stream the all-to-all dispatcher makes at construction (unused in pad mode)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    if cuda or D.cuda_dtoh_stream is not None:
        yield
        return
    D.cuda_dtoh_stream = object()
    try:
        yield
    finally:
        D.cuda_dtoh_stream = None


def _forward_fn(layer: Any, cfg: LayerBenchConfig, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer call: the module on CUDA (FP8 in megatron's context); its stages in order on CPU."""
    if device.type == "cuda":
        if cfg.precision == "fp8":
            from megatron.core.fp8_utils import get_fp8_context

            def fp8_forward(x: torch.Tensor) -> torch.Tensor:
                with get_fp8_context(layer.config):
                    return layer(x)[0]

            return fp8_forward
        return lambda x: layer(x)[0]
    router = layer.router

    def cpu_forward(x: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(x.view(-1, x.shape[-1]), router.weight)
        probs, routing_map = router.routing(logits)
        h, p = layer.preprocess(x, probs, routing_map)
        d, p = layer.dispatch(h, p)
        out, _ = layer.routed_experts_compute(d, p)
        return layer.postprocess(layer.combine(out), None)

    return cpu_forward


AS_INSTALLED = "as-installed"
"""The arm running ``install()`` as production does at EP = 1 (no validation knob): the ring policy, unused there."""
ARMS = (*POLICIES, AS_INSTALLED)


def _knobs(policy: str, slots: int) -> BufReuseConfig:
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=slots,
        moe_hybridep_num_expert_output_buffers=slots,
        moe_bufreuse_dispatch_policy=policy,
        moe_bufreuse_expert_policy=policy,
    )


# -- rounds ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _installed(layer: Any, arm: str, cfg: LayerBenchConfig, device: torch.device) -> Iterator[Any]:
    """``arm``'s hooks on a fresh production-mode pool for the block (None and nothing for ``control``)."""
    if arm == "control":
        yield None
        return
    from bufreuse.integrations.megatron import install
    from bufreuse.pool import BufferPool

    inst = install(
        layer,
        BufferPool(device, debug=False),
        _knobs("ring" if arm == AS_INSTALLED else arm, cfg.slots),
        tokens=cfg.tokens,
        num_microbatches=cfg.microbatches,
        # EP x ETP = 1 leaves the expert ring unused: measure it as where it is used, but as-installed
        ring_single_rank_expert=arm != AS_INSTALLED,
        ring_identity_dispatch=cfg.dispatch_ring and arm != AS_INSTALLED,
    )
    try:
        yield inst
    finally:
        inst.uninstall()


@dataclass(frozen=True, slots=True)
class _Prepared:
    """The built layer, its call and its inputs: what every round of every arm runs."""

    layer: Any
    forward: Callable[[torch.Tensor], torch.Tensor]
    cfg: LayerBenchConfig
    device: torch.device
    xs: list[torch.Tensor]
    grads: list[torch.Tensor]
    steps: list[tuple[str, int]]
    """The schedule (:func:`schedule_steps`)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def schedule(self, timing: dict[str, list] | None = None) -> None:
        """One schedule of the layer (:func:`_schedule`)."""
        _schedule(self.forward, self.steps, self.xs, self.grads, timing)


@contextlib.contextmanager
def prepared(cfg: LayerBenchConfig, device: torch.device) -> Iterator[_Prepared]:
    """A world of one, the layer built in training mode and its seeded inputs, for the block."""
    with _world_of_one(device), _one_cpu_thread(device):
        layer = _build_layer(cfg, device)
        layer.train()
        g = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
        shape = (cfg.tokens, 1, cfg.hidden)
        xs = [torch.randn(shape, generator=g).to(device, torch.bfloat16) for _ in range(cfg.microbatches)]
        grads = [torch.randn(shape, generator=g).to(device, torch.bfloat16) for _ in range(cfg.microbatches)]
        steps = schedule_steps(cfg.schedule, cfg.microbatches)
        yield _Prepared(layer, _forward_fn(layer, cfg, device), cfg, device, xs, grads, steps)


def _run_round(p: _Prepared, arm: str) -> dict[str, Any]:
    """Install ``arm`` (nothing for ``control``), one untimed schedule, ``steps`` timed ones, uninstall."""
    cfg, cuda = p.cfg, p.cuda
    with _installed(p.layer, arm, cfg, p.device) as inst, _collector(cfg):
        p.layer.zero_grad(set_to_none=True)
        p.schedule()
        _sync(cuda)
        timing: dict[str, list] = {"F": [], "B": [], "events": []}
        start = time.perf_counter()
        for _ in range(cfg.steps):
            p.schedule(timing)
        _sync(cuda)
        wall = time.perf_counter() - start
        # Evidence that the arm ran hooked: each hooked buffer's acquisitions this round (none for the control), and
        # its releases deferred behind a saved reference (the saved-tensor tracking at work).
        stats = inst.pool.stats() if inst is not None else {}
        acquired = {name: s.acquisitions for name, s in stats.items()}
        deferred = {name: s.deferred_releases for name, s in stats.items()}
        unused = dict(getattr(inst, "unused", {})) if inst is not None else {}
    calls = cfg.steps * cfg.microbatches
    fwd, bwd = sum(timing["F"]) / calls * 1e6, sum(timing["B"]) / calls * 1e6
    gpu = sum(a.elapsed_time(b) for a, b in timing["events"]) / calls if cuda else None
    return {
        "fwd_host_us": fwd,
        "bwd_host_us": bwd,
        "host_us": fwd + bwd,
        "wall_ms": wall / calls * 1e3,
        "gpu_ms": gpu,
        "acquisitions": acquired,
        "deferred_releases": deferred,
        "unused": unused,
    }


def _schedule(
    forward: Callable[[torch.Tensor], torch.Tensor],
    steps: list[tuple[str, int]],
    xs: list[torch.Tensor],
    grads: list[torch.Tensor],
    timing: dict[str, list] | None,
) -> None:
    """Run one schedule; with ``timing``, the host seconds of every forward / backward call and CUDA event pairs."""
    outs: dict[int, torch.Tensor] = {}
    cuda = xs[0].is_cuda
    clock = time.perf_counter
    for kind, i in steps:
        if kind == "F":
            x = xs[i].detach().requires_grad_(True)
        if timing is not None and cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        t0 = clock()
        if kind == "F":
            outs[i] = forward(x)
        else:
            outs.pop(i).backward(grads[i])
        t1 = clock()
        if timing is not None:
            timing[kind].append(t1 - t0)
            if cuda:
                end.record()
                timing["events"].append((begin, end))


@contextlib.contextmanager
def _collector(cfg: LayerBenchConfig) -> Iterator[None]:
    """``cfg.gc == "manual"``: collect now and keep the cyclic collector off for the block (Megatron's
    ``--manual-gc``); ``auto``: nothing."""
    if cfg.gc != "manual":
        yield
        return
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# -- the benchmark ---------------------------------------------------------------------------------


def run_layer_bench(cfg: LayerBenchConfig, *, progress: Progress | None = None) -> dict[str, Any]:
    """Build the layer, run every round, judge each arm against the control; a JSON-ready dict."""
    device = check_config(cfg)
    arms = ["control", *cfg.policies]
    order = round_order(arms, cfg.rounds, cfg.warmup)
    with prepared(cfg, device) as p:
        rounds = []
        for k, entry in enumerate(order):
            figures = _run_round(p, entry["arm"])
            rounds.append({"index": k, **entry, **figures})
            if progress is not None:
                progress(k + 1, len(order))
    return _summarise(cfg, device, arms, rounds)


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """On CPU, one intra-op thread: a tiny layer gains nothing from more, and on a shared host they add noise."""
    if device.type != "cpu":
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _summarise(cfg: LayerBenchConfig, device: torch.device, arms: list[str], rounds: list[dict]) -> dict[str, Any]:
    cuda = device.type == "cuda"
    measured = [r for r in rounds if not r["warmup"]]
    metrics = [m for m in METRICS if cuda or m != "gpu_ms"]
    headline = "wall_ms" if cuda else "host_us"
    for r in rounds:
        r["ratio"], r["paired_with"] = None, None
    for arm in arms[1:]:
        for ctl, mine in _pairs(measured, arm):
            mine["paired_with"] = ctl["index"]
            mine["ratio"] = {m: mine[m] / ctl[m] for m in metrics}
    bands = Bands(throughput_pct=cfg.band_pct)
    summary: dict[str, Any] = {}
    for arm in arms:
        mine = [r for r in measured if r["arm"] == arm]
        entry: dict[str, Any] = {}
        for m in metrics:
            values = [r[m] for r in mine]
            med = statistics.median(values)
            fig: dict[str, Any] = {
                "median": med,
                "min": min(values),
                "max": max(values),
                "spread_pct": (max(values) - min(values)) / med * 100 if med else None,
            }
            if arm != "control":
                ratios = [r["ratio"][m] for r in mine]
                fig["vs_control"] = _judged_paired(ratios, bands, f"{arm} / control, {m}")
                control = [r[m] for r in measured if r["arm"] == "control"]
                fig["unpaired"] = _judged(control, values, bands, f"{arm} / control, {m}, unpaired")
                fig["round_ratios"] = ratios
                fig["median_round_ratio"] = statistics.median(ratios)
            entry[m] = fig
        summary[arm] = entry
    control = [r for r in measured if r["arm"] == "control"]
    half = len(control) // 2
    drift = {
        m: _judged([r[m] for r in control[:half]], [r[m] for r in control[half:]], bands, f"control drift, {m}")
        for m in metrics
    }
    return {
        "config": {**asdict(cfg), "policies": list(cfg.policies)},
        "device": str(device),
        "gpu_figures": cuda,
        "note": None
        if cuda
        else "CPU (one thread): the layer's stages with CPU routing, pad-to-capacity; "
        "host time is the figure, there is no GPU figure",
        "headline": headline,
        "metrics": {m: {"title": METRICS[m][0], "unit": METRICS[m][1]} for m in metrics},
        "arms": arms,
        "order": [r["arm"] for r in rounds],
        "rounds": rounds,
        "summary": summary,
        "drift": drift,
        "band_pct": cfg.band_pct,
        "env": _env(device),
    }


def _pairs(measured: list[dict], arm: str) -> list[tuple[dict, dict]]:
    """``(control round, arm round)`` pairs: in each A B B A cycle the arm's first round with the cycle's first
    control round, its second with the second (each arm round's neighbouring control round; disjoint pairs)."""
    pairs: list[tuple[dict, dict]] = []
    for cycle in sorted({r["cycle"] for r in measured}):
        ctl = [r for r in measured if r["cycle"] == cycle and r["arm"] == "control"]
        mine = [r for r in measured if r["cycle"] == cycle and r["arm"] == arm]
        pairs += zip(ctl, mine, strict=True)
    return pairs


def _judged_paired(ratios: list[float], bands: Bands, what: str) -> dict[str, Any]:
    """Geometric mean of paired round ratios, its 95% t interval and the verdict.

    The one-sample interval of the log ratios is Welch's against a constant side (zero variance: the
    degrees of freedom are n - 1), so ``mean_diff_interval`` gives it exactly.
    """
    logs = [math.log(v) for v in ratios]
    return _verdict(math.exp(statistics.fmean(logs)), mean_diff_interval([0.0] * len(logs), logs), len(logs),
                    len(logs), bands, what)  # fmt: skip


def _judged(base: list[float], other: list[float], bands: Bands, what: str) -> dict[str, Any]:
    """Ratio of geometric means other / base, its Welch 95% interval (unpaired, over rounds) and the verdict."""
    lb, lo = [math.log(v) for v in base], [math.log(v) for v in other]
    ratio = math.exp(statistics.fmean(lo) - statistics.fmean(lb))
    return _verdict(ratio, mean_diff_interval(lb, lo), len(base), len(other), bands, what)


def _verdict(
    ratio: float, ci: tuple[float, float] | None, n_base: int, n_other: int, bands: Bands, what: str
) -> dict[str, Any]:
    """The project's verdict rule (``verdicts.judge``) on a ratio whose log interval is ``ci``."""
    m = MetricDelta(
        metric=what,
        title=what,
        unit="ratio",
        better="lower",
        baseline=1.0,
        value=ratio,
        ci_low=math.exp(ci[0]) - 1 if ci else None,
        ci_high=math.exp(ci[1]) - 1 if ci else None,
        n_baseline=n_base,
        n_value=n_other,
    )
    judge(m, bands, differ=False)
    return {
        "ratio": ratio,
        "ci_low": 1 + m.ci_low if m.ci_low is not None else None,
        "ci_high": 1 + m.ci_high if m.ci_high is not None else None,
        "verdict": m.verdict,
        "note": m.note,
        "n": [n_base, n_other],
    }


def _env(device: torch.device) -> dict[str, Any]:
    import megatron.core

    cuda = device.type == "cuda"
    te = None
    with contextlib.suppress(Exception):
        import transformer_engine

        te = transformer_engine.__version__
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", None),
        "transformer_engine": te,
        "python": platform.python_version(),
        "hostname": platform.node(),
        "cpu": platform.processor() or platform.machine(),
    }
