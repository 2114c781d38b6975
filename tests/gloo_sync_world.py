"""Test helper: megatron-core's DDP grad sync through ``bufreuse.integrations.gloo_grad_sync`` in real gloo processes.

The parent (:func:`run_world`) spawns ``world`` processes on 127.0.0.1 running *scenarios* (functions below) in
order; each writes its JSON reports (``rank<r>.json``) the tests assert on. A scenario patches megatron's
``param_and_grad_buffer._coalescing_manager`` with :func:`patch_megatron_grad_sync` and drives it on CPU tensors.
``BUFREUSE_TEST_NOOP_HANDLE=1`` swaps ``WaitAll.wait`` for a no-op (the mutation the wait checks must catch).

One shim, CPU only: ``_ParamAndGradBucketGroup.start_grad_sync`` (megatron-core 0.19.2,
``param_and_grad_buffer.py`` "current_stream = torch.cuda.current_stream()") reads the current CUDA stream and uses
it only for params carrying ``_cudagraph_wgrad_ready_event`` (none here): :func:`_cpu_current_stream` stands in.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LATE_S = 2.0
"""How long the late rank waits before it joins the collectives of a ``late`` check."""


def _values(tensors: list[Any]) -> list[list[float]]:
    return [t.float().tolist() for t in tensors]


def _buckets(rank: int) -> list[Any]:
    """Three buckets of mixed dtypes (gloo's ``allreduce_coalesced`` refuses mixed types on CPU too)."""
    import torch

    return [torch.full((n,), float((rank + 1) * (k + 1)), dtype=dt)
            for k, (n, dt) in enumerate(((5, torch.float32), (3, torch.bfloat16), (7, torch.float32)))]  # fmt: skip


def _summed(world: int) -> list[list[float]]:
    """What every bucket holds after a SUM all-reduce: sum over ranks of (rank + 1) x (k + 1)."""
    total = world * (world + 1) // 2
    return [[float(total * (k + 1))] * n for k, n in enumerate((5, 3, 7))]


def scenario_buckets(rank: int, world: int, rep: dict[str, Any]) -> None:
    """megatron's patched manager: async and sync all-reduces, reduce-scatter, all-gather; torch's for contrast."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from bufreuse.integrations.gloo_grad_sync import WaitAll, is_gloo, patch_megatron_grad_sync

    rep["is_gloo"] = is_gloo(None)
    try:
        with dist._coalescing_manager(None, async_ops=True) as cm:  # torch's, unpatched
            for t in _buckets(rank):
                dist.all_reduce(t, async_op=True)
        cm.wait()
        rep["torch_mixed"] = "ok"
    except RuntimeError as e:
        rep["torch_mixed"] = str(e)
    undo = patch_megatron_grad_sync()
    rep["patched"] = pgb._coalescing_manager is not dist._coalescing_manager
    first = pgb._coalescing_manager
    patch_megatron_grad_sync()
    rep["patched_twice_is_noop"] = pgb._coalescing_manager is first
    buckets = _buckets(rank)
    with pgb._coalescing_manager(None, async_ops=True) as cm:
        for t in buckets:
            dist.all_reduce(t, async_op=True)
    rep["async_handle"] = type(cm).__name__ if isinstance(cm, WaitAll) else repr(cm)
    rep["async_works"] = len(cm.works)
    cm.wait()
    rep["async_values"] = _values(buckets)
    buckets = _buckets(rank)
    with pgb._coalescing_manager(None, async_ops=False):
        for t in buckets:
            dist.all_reduce(t, async_op=False)
    rep["sync_values"] = _values(buckets)  # no wait: a synchronous block ends with its collectives done
    shard, full = torch.full((2,), float(rank + 1)), torch.arange(2.0 * world) + 10 * rank
    gathered, scattered = torch.zeros(2 * world), torch.zeros(2)
    with pgb._coalescing_manager(None, async_ops=True) as cm:
        dist.all_gather_into_tensor(gathered, shard, async_op=True)
        dist.reduce_scatter_tensor(scattered, full, async_op=True)
    cm.wait()
    rep["gathered"], rep["scattered"] = gathered.tolist(), scattered.tolist()
    try:
        with pgb._coalescing_manager(None, async_ops=True):
            raise KeyError("inside the block")
    except KeyError:
        pass
    from torch.distributed import distributed_c10d as c10d

    rep["state_clean_after_raise"] = dist.group.WORLD not in c10d._world.pg_coalesce_state
    undo()
    rep["undone"] = pgb._coalescing_manager is dist._coalescing_manager


def scenario_late(rank: int, world: int, rep: dict[str, Any]) -> None:
    """The last rank joins ``LATE_S`` late; rank 0 reads its buckets right after ``cm.wait()`` returns."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from bufreuse.integrations.gloo_grad_sync import patch_megatron_grad_sync

    patch_megatron_grad_sync()
    dist.barrier()
    if rank == world - 1:
        time.sleep(LATE_S)
    buckets = _buckets(rank)
    with pgb._coalescing_manager(None, async_ops=True) as cm:
        for t in buckets:
            dist.all_reduce(t, async_op=True)
    t0 = time.perf_counter()
    cm.wait()
    rep["wait_s"] = time.perf_counter() - t0
    rep["values_after_wait"] = _values(buckets)
    for w in cm.works:  # the mutated handle waited nothing: finish before the group goes away
        w.wait()


def _cpu_current_stream() -> Any:
    class _Stream:
        def wait_event(self, event: Any) -> None:
            raise AssertionError("no param here carries _cudagraph_wgrad_ready_event")

    return _Stream()


def _bucket_group(rank: int, world: int, **ddp: Any) -> tuple[Any, list[Any]]:
    """A real ``_ParamAndGradBucketGroup`` of three buckets (one param each) over the world group."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucket, _ParamAndGradBucketGroup

    buckets, grads = [], []
    for k, n in enumerate((4 * world, 2 * world, 6 * world)):  # divisible by the world: distopt shards
        p = torch.nn.Parameter(torch.zeros(n))
        grad = torch.full((n,), float((rank + 1) * (k + 1)))
        param = torch.full((n,), -1.0)
        param[rank * n // world : (rank + 1) * n // world] = float(rank)  # this rank's shard
        buckets.append(_ParamAndGradBucket([p], param, grad, 0, n, 1.0, k, {p: (0, n, k)}, []))
        grads.append(grad)
    group = _ParamAndGradBucketGroup(buckets, DistributedDataParallelConfig(**ddp), dist.group.WORLD, world)
    return group, grads


def scenario_megatron(rank: int, world: int, rep: dict[str, Any]) -> None:
    """megatron-core's own ``start_grad_sync`` / ``finish_grad_sync`` (and the distributed optimizer's param
    all-gather) through the patched manager; in the overlapped run the last rank starts ``LATE_S`` late."""
    import torch
    import torch.distributed as dist

    from bufreuse.integrations.gloo_grad_sync import WaitAll, patch_megatron_grad_sync

    if not torch.cuda.is_available():
        torch.cuda.current_stream = _cpu_current_stream  # the shim named in the module docstring
    patch_megatron_grad_sync()
    group, grads = _bucket_group(rank, world, overlap_grad_reduce=True)
    dist.barrier()
    if rank == world - 1:
        time.sleep(LATE_S)
    group.start_grad_sync()
    handle = group.grad_reduce_handle
    rep["overlap_handle"] = type(handle).__name__ if isinstance(handle, WaitAll) else repr(handle)
    rep["overlap_works"] = len(handle.works)
    group.finish_grad_sync()
    rep["overlap_values"] = [g.tolist() for g in grads]
    for w in handle.works:  # a mutated handle waited nothing
        w.wait()
    group, grads = _bucket_group(rank, world, overlap_grad_reduce=False)
    group.finish_grad_sync()  # not overlapped: start and finish in one synchronous call
    rep["sync_values"] = [g.tolist() for g in grads]
    rep["sync_handle"] = repr(group.grad_reduce_handle)
    group, grads = _bucket_group(rank, world, use_distributed_optimizer=True, overlap_grad_reduce=True,
                                 overlap_param_gather=True)  # fmt: skip
    group.start_grad_sync()
    group.finish_grad_sync()
    rep["distopt_grad_shards"] = [g[rank * g.numel() // world : (rank + 1) * g.numel() // world].tolist()
                                  for g in grads]  # fmt: skip
    group.start_param_sync()
    group.param_gather_handle.wait()  # finish_param_sync also dispatches the next group's, which has none
    rep["distopt_params"] = [b.param_data.tolist() for b in group.buckets]


def scenario_fake(rank: int, world: int, rep: dict[str, Any]) -> None:
    """A non-gloo group (torch's ``fake`` backend): the patched manager must hand it to torch's, coalesced."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from bufreuse.integrations.gloo_grad_sync import is_gloo, patch_megatron_grad_sync

    patch_megatron_grad_sync()
    rep["backend"], rep["is_gloo"] = str(dist.get_backend()), is_gloo(None)
    with pgb._coalescing_manager(None, async_ops=True) as cm:
        for n in (5, 3, 7):
            dist.all_reduce(torch.ones(n), async_op=True)
    rep["handle"], rep["works"] = type(cm).__name__, len(cm.works)


SCENARIOS = {"buckets": scenario_buckets, "late": scenario_late, "megatron": scenario_megatron, "fake": scenario_fake}


def worker(scenarios: str, rank: int, world: int, port: int, out: str) -> int:
    """Run the comma-separated ``scenarios`` in order in one process group; one report per scenario."""
    import torch.distributed as dist

    if os.environ.get("BUFREUSE_TEST_NOOP_HANDLE") == "1":
        from bufreuse.integrations.gloo_grad_sync import WaitAll

        WaitAll.wait = lambda self: None  # type: ignore[method-assign]  # the mutation
    if scenarios == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
    reps: dict[str, dict[str, Any]] = {}
    for name in scenarios.split(","):
        reps[name] = {"rank": rank}
        SCENARIOS[name](rank, world, reps[name])
        if name != "fake":
            dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(reps))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(scenarios: str, workdir: Path, *, world: int = 2, env: dict[str, str] | None = None,
              timeout_s: float = 240) -> list[dict[str, dict[str, Any]]]:  # fmt: skip
    """Every rank's reports (``[rank][scenario]``) of the comma-separated ``scenarios``, run in order in one world;
    AssertionError with the ranks' logs when one fails or times out."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    penv = dict(os.environ, **(env or {}))
    penv["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [penv.get("PYTHONPATH")])])
    penv.setdefault("OMP_NUM_THREADS", "1")
    penv["PYTHONWARNINGS"] = "ignore"
    logs = [workdir / f"rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        with logs[r].open("w") as log:
            cmd = [sys.executable, str(Path(__file__)), scenarios, str(r), str(world), str(port),
                   str(workdir / f"rank{r}.json")]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=penv, cwd=str(HERE.parent)))
    deadline = time.perf_counter() + timeout_s
    while any(p.poll() is None for p in procs) and time.perf_counter() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    for p in procs:  # only the processes started here
        if p.poll() is None:
            p.kill()
        p.wait()
    if any(p.returncode != 0 for p in procs):
        raise AssertionError("\n".join(f"rank {r} exit {p.returncode}:\n{logs[r].read_text()[-3000:]}"
                                       for r, p in enumerate(procs)))  # fmt: skip
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
