"""megatron-core's DDP grad sync over gloo (``bufreuse.integrations.gloo_grad_sync``), in real gloo processes on CPU.

On the GPU, torch's ``_coalescing_manager`` ends in gloo's ``allreduce_coalesced``, which refuses CUDA tensors. CPU
gloo takes those, so the CPU stand-in for the failure is the same call refusing buckets of mixed dtypes: the
patched manager must pass where torch's fails. The worlds run ``tests/gloo_sync_world.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")

from gloo_sync_world import LATE_S, _summed, run_world  # noqa: E402

from bufreuse.errors import BackendContractError  # noqa: E402
from bufreuse.integrations import gloo_grad_sync as ggs  # noqa: E402

WORLD = 2
REAL = "buckets,late,megatron"


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    """One world runs the unmutated scenarios (megatron's import is most of a world's cost)."""
    return run_world(REAL, tmp_path_factory.mktemp("gloo-sync"))


def test_patched_manager_issues_each_bucket_and_sums_them(real: list[dict[str, dict[str, Any]]]) -> None:
    for rep in (r["buckets"] for r in real):
        assert rep["is_gloo"] and rep["patched"] and rep["patched_twice_is_noop"]
        # torch's own manager: one allreduce_coalesced call, refused (the CPU stand-in for "unsupported device type")
        assert "allreduce_coalesced" in rep["torch_mixed"], rep["torch_mixed"]
        assert rep["async_handle"] == "WaitAll" and rep["async_works"] == 3  # one work per bucket
        assert rep["async_values"] == _summed(WORLD) and rep["sync_values"] == _summed(WORLD)
        # the distributed optimizer's collectives: all-gather of [r+1, r+1], reduce-scatter of arange(4) + 10 r
        assert rep["gathered"] == [1.0, 1.0, 2.0, 2.0]
        full = [sum(i + 10 * r for r in range(WORLD)) for i in range(2 * WORLD)]
        assert rep["scattered"] == full[2 * rep["rank"] : 2 * rep["rank"] + 2]
        assert rep["state_clean_after_raise"] and rep["undone"]


@pytest.mark.parametrize("mutated", [False, True], ids=["handle", "noop-handle-mutation"])
def test_handle_waits_for_a_late_rank(real: list[dict[str, dict[str, Any]]], tmp_path: Path, mutated: bool) -> None:
    """The last rank joins ``LATE_S`` late; rank 0 reads its buckets as soon as ``cm.wait()`` returns. A real handle
    blocks until the sums arrive; a handle that waits nothing (the mutation) leaves rank 0's own values, which this
    check sees (unless rank 0 stalls for ``LATE_S`` between the two lines, a false pass, never a false failure)."""
    env = {"BUFREUSE_TEST_NOOP_HANDLE": "1"} if mutated else {}
    rank0 = run_world("late", tmp_path, env=env)[0]["late"] if mutated else real[0]["late"]
    if mutated:
        assert rank0["values_after_wait"] != _summed(WORLD) and rank0["wait_s"] < LATE_S / 2
    else:
        assert rank0["values_after_wait"] == _summed(WORLD) and rank0["wait_s"] > LATE_S / 2


def test_megatron_bucket_group_grad_sync_through_the_patch(real: list[dict[str, dict[str, Any]]]) -> None:
    """megatron-core's own ``_ParamAndGradBucketGroup``: overlapped (``grad_reduce_handle`` is the per-op handle,
    waited in ``finish_grad_sync`` while the last rank starts late), synchronous, and the distributed optimizer."""
    world_shard = [[3.0] * 4, [6.0] * 2, [9.0] * 6]  # (1 + 2) x (k + 1), each rank's 1/2 of buckets 8, 4, 12 long
    for rep in (r["megatron"] for r in real):
        assert rep["overlap_handle"] == "WaitAll" and rep["overlap_works"] == 3
        expect = [[3.0] * 8, [6.0] * 4, [9.0] * 12]
        assert rep["overlap_values"] == expect and rep["sync_values"] == expect
        assert rep["sync_handle"] == "None"  # megatron drops a synchronous block's handle
        assert rep["distopt_grad_shards"] == world_shard
        # param all-gather: each rank's shard holds its rank number
        assert rep["distopt_params"] == [[0.0] * 4 + [1.0] * 4, [0.0] * 2 + [1.0] * 2, [0.0] * 6 + [1.0] * 6]


def test_non_gloo_group_goes_to_torchs_manager(tmp_path: Path) -> None:
    """Positive control: a ``fake``-backend group (not gloo) gets torch's manager and its one coalesced work."""
    rep = run_world("fake", tmp_path, world=1)[0]["fake"]
    assert rep["backend"] == "fake" and not rep["is_gloo"]
    assert rep["handle"] == "_CoalescingManager" and rep["works"] == 1


@pytest.mark.parametrize(
    ("backend", "gloo"),
    [
        ("gloo", True),
        ("cpu:gloo,cuda:gloo", True),
        ("nccl", False),
        ("cpu:gloo,cuda:nccl", False),
        (ValueError("no group"), False),
    ],
)
def test_is_gloo_reads_every_device_backend(monkeypatch: pytest.MonkeyPatch, backend: Any, gloo: bool) -> None:
    def get_backend(group: Any = None) -> str:
        if isinstance(backend, Exception):
            raise backend
        return backend

    monkeypatch.setattr(torch.distributed, "get_backend", get_backend)
    assert ggs.is_gloo(object()) is gloo


def test_torch_recording_the_manager_relies_on_exists() -> None:
    """The torch private parts ``_per_op`` reads: the per-group recording and ``_CollOp``'s fields."""
    from torch.distributed import distributed_c10d as c10d

    assert isinstance(c10d._world.pg_coalesce_state, dict), f"torch {torch.__version__}"
    t = torch.ones(1)
    op = c10d._CollOp(c10d.all_reduce, t, None, torch.distributed.ReduceOp.SUM)
    assert (op.op, op.tensor, op.dst_tensor, op.redop) == (c10d.all_reduce, t, None, torch.distributed.ReduceOp.SUM)
    names = {"all_reduce"} | {getattr(c10d, n).__name__ for n in ("all_gather_into_tensor", "reduce_scatter_tensor")}
    assert names <= ggs._ALL_REDUCE | ggs._ALL_GATHER | ggs._REDUCE_SCATTER


def test_an_unknown_recorded_collective_is_refused_by_name() -> None:
    class Op:
        op = torch.distributed.broadcast
        tensor = dst_tensor = redop = None

    with pytest.raises(BackendContractError, match="recorded a broadcast collective"):
        ggs._issue(Op(), None)
