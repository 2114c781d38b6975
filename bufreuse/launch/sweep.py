"""Build a slot sweep's configurations, write its folder, skip what is finished, launch the rest.

Configuration ids: ``slots0`` (control: record-stream), ``slotsN`` (ring with N slots per buffer),
``stream-ordered``; suffix ``-graph`` with ``cuda_graph``. A sweep is resumable: re-running the same
sweep skips every configuration that has a ``metrics.json`` (except ``cancelled`` ones); ``force``
runs them again. The sweep name defaults to a short hash of the parameters that change results,
so the same command finds the same folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bufreuse import limits
from bufreuse.errors import InputError
from bufreuse.launch.base import Launcher, ProgressEvent, ProgressFn, clear_results, get_launcher
from bufreuse.sweepdir import SweepDir, check_config_id, sweeps_root

__all__ = [
    "BUFFERS",
    "DEFAULT_PARAMS",
    "DTYPES",
    "EXTRA_MODES",
    "SweepResult",
    "SweepSpec",
    "build_configs",
    "config_problem",
    "default_name",
    "parse_int_list",
    "parse_slot_list",
    "parse_str_list",
    "run_sweep",
]

DEFAULT_PARAMS: dict[str, Any] = {
    "workload": "proxy",
    "hidden": 4096,
    "ffn": 2048,
    "tokens": 32768,
    "local_experts": 8,
    "topk": 2,
    "dtype": "bf16",
    "microbatches": 12,
    "steps": 20,
    "warmup_steps": 3,
    "record_steps": 2,
    "comm_ms": 0.5,
    "attn_gemms": 2,
    "seed": 1234,
    "device": "cuda",
}
"""Workload parameters of a sweep (the reference proxy, docs/facts.md); every ``config.json`` holds all of them."""

OPTIONAL_PARAMS: dict[str, tuple[str, ...]] = {"dist_backend": ("nccl", "gloo")}
"""Parameters a ``config.json`` holds only when given (older sweeps keep their names and configs): name -> choices.
``dist_backend``: the proxy's process group at world size > 1; ``gloo`` lets several processes share one GPU
(or run on CPU), its all-to-all staged through host memory on its own stream (so its times are not NCCL's)."""

EXTRA_MODES = ("control", "stream-ordered")
BUFFERS = ("dispatch", "expert")
DTYPES = ("bf16", "fp16", "fp32", "bfloat16", "float16", "float32")
_NOT_RESULT_KEYS = ("timeout_s", "stall_s")  # changing these does not change what a finished run measured


@dataclass(kw_only=True, slots=True)
class SweepSpec:
    """What to sweep (``bufreuse sweep`` options)."""

    slots: list[int] = field(default_factory=lambda: [0, 4, 10])
    """Ring slots per buffer; 0 is the control (record-stream)."""
    modes: list[str] = field(default_factory=list)
    """Modes added to the slot configurations: ``stream-ordered`` and/or ``control``."""
    buffers: list[str] = field(default_factory=lambda: list(BUFFERS))
    """Buffers that take the ring / stream-ordered policy (others stay record-stream)."""
    cuda_graph: bool = False
    """Capture the whole step as a CUDA graph after warm-up and time replays."""
    params: dict[str, Any] = field(default_factory=dict)
    """Overrides of :data:`DEFAULT_PARAMS` (hidden, tokens, comm_ms, ...)."""
    world_size: int | None = None
    """Processes per configuration; None lets the launcher choose (local: every visible GPU)."""
    timeout_s: float = 600.0
    """Per-configuration limit; a run past it is killed and recorded as ``timeout``."""
    name: str | None = None
    """Sweep folder name; default ``proxy-<hash of the parameters>``."""
    root: str | None = None
    """Folder holding sweeps (default ``$BUFREUSE_SWEEPS`` or ``./bufreuse-sweeps``)."""
    force: bool = False
    """Run every configuration again, finished or not."""

    def validate(self) -> None:
        if not self.slots and not self.modes:
            raise InputError("--slots: give at least one slot count (0 is the control)")
        if any(s < 0 for s in self.slots):
            raise InputError(f"--slots {self.slots}: slot counts must be >= 0")
        if self.slots:
            limits.check("max_ring_slots", max(self.slots), what="--slots")
        bad = [m for m in self.modes if m not in EXTRA_MODES]
        if bad:
            raise InputError(f"--modes {','.join(bad)}: choose from {', '.join(EXTRA_MODES)}")
        bad = [b for b in self.buffers if b not in BUFFERS]
        if bad or not self.buffers:
            raise InputError(f"--buffers {','.join(self.buffers)}: choose one or both of {', '.join(BUFFERS)}")
        unknown = sorted(set(self.params) - set(DEFAULT_PARAMS) - set(OPTIONAL_PARAMS))
        if unknown:
            known = ", ".join([*DEFAULT_PARAMS, *OPTIONAL_PARAMS])
            raise InputError(f"unknown sweep parameter(s) {', '.join(unknown)}; known: {known}")
        for key, choices in OPTIONAL_PARAMS.items():
            if key in self.params and self.params[key] not in choices:
                raise InputError(f"--{key.replace('_', '-')} {self.params[key]}: choose from {', '.join(choices)}")
        p = {**DEFAULT_PARAMS, **self.params}
        for key in ("hidden", "ffn", "tokens", "local_experts", "topk", "microbatches", "steps"):
            if int(p[key]) < 1:
                raise InputError(f"--{key.replace('_', '-')} {p[key]}: must be >= 1")
        for key in ("warmup_steps", "record_steps"):
            if int(p[key]) < 0:
                raise InputError(f"--{key.replace('_', '-')} {p[key]}: must be >= 0")
        for key in ("hidden", "ffn", "tokens", "local_experts", "topk", "microbatches", "steps", "warmup_steps",
                    "record_steps"):  # fmt: skip
            limits.check("max_dim", int(p[key]), what=f"--{key.replace('_', '-')}")
        if p["dtype"] not in DTYPES:
            raise InputError(f"--dtype {p['dtype']}: choose from {', '.join(DTYPES)}")
        if self.name is not None:
            try:
                check_config_id(self.name)
            except InputError:
                raise InputError(
                    f"--name {self.name!r}: use letters, digits, '.', '_' or '-' (no '/'; it names a folder "
                    "inside the sweeps root)"
                ) from None
        if not math.isfinite(float(p["comm_ms"])) or float(p["comm_ms"]) < 0:
            raise InputError(f"--comm-ms {p['comm_ms']}: must be a finite number >= 0")
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise InputError(f"--timeout {self.timeout_s}: must be a finite number > 0")
        if self.world_size is not None and self.world_size < 1:
            raise InputError(f"--world-size {self.world_size}: must be >= 1")


@dataclass(kw_only=True, slots=True)
class SweepResult:
    """What a launch did; the results themselves are in the folder (``analysis.runs.sweep_rows``)."""

    folder: str
    """The sweep folder."""
    config_ids: list[str]
    """This sweep's configurations, in table order."""
    ran: list[str]
    """Configurations launched this time."""
    skipped: list[str]
    """Configurations already finished and not rerun."""
    statuses: dict[str, str]
    """State of each configuration after the launch (``ok``, ``failed``, ..., ``pending`` if in flight)."""
    launcher: str
    """Launcher name."""


def build_configs(spec: SweepSpec, *, world_size: int = 1) -> dict[str, dict[str, Any]]:
    """``config.json`` contents by configuration id, in table order (control, rings, stream-ordered)."""
    params = {**DEFAULT_PARAMS, **spec.params}
    suffix = "-graph" if spec.cuda_graph else ""
    entries: list[tuple[str, str, int]] = []
    slot_set = sorted(set(spec.slots) | ({0} if "control" in spec.modes else set()))
    for s in slot_set:
        entries.append((f"slots{s}", "control" if s == 0 else "ring", s))
    if "stream-ordered" in spec.modes:
        entries.append(("stream-ordered", "stream-ordered", 0))
    out: dict[str, dict[str, Any]] = {}
    for cid, mode, slots in entries:
        out[cid + suffix] = {
            **params,
            "mode": mode,
            "slots": slots,
            "buffers": list(spec.buffers),
            "cuda_graph": spec.cuda_graph,
            "world_size": world_size,
            "timeout_s": spec.timeout_s,
        }
    return out


def config_problem(config: dict[str, Any]) -> str | None:
    """The first rule of the proxy workload that ``config`` breaks, in option words; None if it runs.

    The proxy checks the same rules when it starts (``bufreuse.bench.proxy.ProxyConfig.validate``,
    which needs torch); checking them here refuses a sweep before any process starts.
    """
    if config.get("workload", "proxy") != "proxy":
        return None
    tokens, topk, experts = int(config["tokens"]), int(config["topk"]), int(config["local_experts"])
    world = int(config.get("world_size", 1))
    if tokens % (topk * experts * world):
        return (
            f"--tokens {tokens} must be a multiple of topk x local experts x world size = "
            f"{topk} x {experts} x {world} = {topk * experts * world}"
        )
    gloo = config.get("dist_backend") == "gloo"
    if config.get("device", "cuda") == "cpu" and (
        float(config["comm_ms"]) > 0 or config.get("cuda_graph") or (world > 1 and not gloo)
    ):
        return "a CPU run needs --comm-ms 0, no --cuda-graph and world size 1 (or --dist-backend gloo)"
    if config.get("cuda_graph") and int(config["warmup_steps"]) < 1:
        return "--cuda-graph needs --warmup-steps >= 1 (the capture follows an eager step)"
    return None


def default_name(spec: SweepSpec, world_size: int) -> str:
    key = {**DEFAULT_PARAMS, **spec.params, "buffers": sorted(spec.buffers), "world_size": world_size}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    return f"{key['workload']}-{digest}"


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    keys = (set(old) | set(new)) - set(_NOT_RESULT_KEYS)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(keys) if old.get(k) != new.get(k)]


def run_sweep(
    spec: SweepSpec,
    *,
    launcher: str | Launcher = "local",
    launcher_options: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
) -> SweepResult:
    """Write the sweep folder, skip finished configurations, run the rest with ``launcher``."""
    spec.validate()
    runner = get_launcher(launcher, **(launcher_options or {})) if isinstance(launcher, str) else launcher
    world = spec.world_size
    if world is None:
        pick = getattr(runner, "default_world_size", None)
        world = int(pick()) if callable(pick) and spec.params.get("device", "cuda") == "cuda" else 1
    configs = build_configs(spec, world_size=world)
    for cid, config in configs.items():  # refused here, before a folder is made or a process started
        problem = config_problem(config)
        if problem:
            raise InputError(f"configuration {cid}: {problem}")
    sweep = SweepDir(sweeps_root(spec.root) / (spec.name or default_name(spec, world)))
    known: list[str] = []
    created = not sweep.folder.exists()
    if sweep.exists():
        manifest = sweep.read_manifest()
        known = [str(c) for c in manifest["configs"]]
        if not spec.force:
            for cid, config in configs.items():
                if cid in known and sweep.paths(cid).config.is_file():
                    diff = _differences(sweep.read_config(cid), config)
                    if diff:
                        raise InputError(
                            f"sweep {sweep.folder} already has {cid} with other parameters ({'; '.join(diff[:3])}); "
                            "use another --name, or --force to replace it"
                        )
    else:
        manifest = {"name": sweep.folder.name}
    ids = list(configs)
    manifest.update(
        name=sweep.folder.name,
        launcher=runner.name,
        configs=known + [c for c in ids if c not in known],
        params={**DEFAULT_PARAMS, **spec.params, "buffers": list(spec.buffers), "world_size": world},
    )
    sweep.folder.mkdir(parents=True, exist_ok=True)
    for cid, config in configs.items():
        sweep.write_config(cid, config)
    sweep.write_manifest(manifest)

    skipped, to_run = [], []
    # A configuration still queued or running (a SLURM job, or a local run of another process) is
    # left alone: its files stay and it is not started twice; its launcher reports it when it ends.
    in_flight = {cid for cid, state in runner.status(sweep).items() if state in ("queued", "running")}
    for cid in ids:
        m = sweep.paths(cid).read_metrics()
        rerun = spec.force or m is None or m["status"] == "cancelled"
        (to_run if rerun and cid not in in_flight else skipped).append(cid)
    for n, cid in enumerate(skipped):
        if progress:
            message = "already in flight" if cid in in_flight else "finished"
            progress(ProgressEvent(config_id=cid, state="skipped", done=n + 1, total=len(ids), message=message))
    if to_run:
        try:
            runner.prepare(sweep, to_run)
        except BaseException:
            if created:  # leave no empty sweep behind when nothing could run
                shutil.rmtree(sweep.folder, ignore_errors=True)
            raise
        for cid in to_run:
            clear_results(sweep.paths(cid))
        offset = len(skipped)

        def shifted(ev: ProgressEvent) -> None:
            if progress:
                progress(ProgressEvent(**{**asdict(ev), "done": ev.done + offset, "total": len(ids)}))

        runner.launch(sweep, to_run, progress=shifted)
    states = runner.status(sweep)
    return SweepResult(
        folder=str(sweep.folder),
        config_ids=ids,
        ran=to_run,
        skipped=skipped,
        statuses={cid: states.get(cid, "pending") for cid in ids},
        launcher=runner.name,
    )


def parse_int_list(text: str, option: str) -> list[int]:
    """``"0,4,10"`` → ``[0, 4, 10]``; the error names the option."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{option} {text!r}: expected comma-separated integers like 0,4,10") from None


def parse_slot_list(
    text: str, *, params: dict[str, Any], buffers: list[str], plan_minimum: Callable[[], int] | None = None
) -> list[int]:
    """``"0,plan,plan+2"`` -> slot counts; ``plan`` is the planner's minimum for the sweep's workload.

    The minimum comes from ``plan_minimum`` (``--plan-config``) or, by default, from the proxy's own
    schedule with the sweep's microbatches and buffers (:func:`bufreuse.plan.slots.proxy_minimum`).
    """
    from bufreuse.plan.slots import proxy_minimum, resolve_slot_spec

    def minimum() -> int:
        if plan_minimum is not None:
            return plan_minimum()
        return proxy_minimum(int({**DEFAULT_PARAMS, **params}["microbatches"]), buffers)

    return [resolve_slot_spec(x, minimum, option="--slots") for x in text.split(",") if x.strip()]


def parse_str_list(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]
