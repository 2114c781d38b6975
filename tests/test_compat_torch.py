"""The private torch APIs the pool's hot path uses (``bufreuse/pool/_device.py``) exist and behave.

CPU-checkable parts: the attributes exist and are callable with the arity ``DeviceOps`` calls them
with; the parts that need a CUDA build are ``gpu``-marked (run by ``scripts/gpu-tests.sh``), and the CUDA
behaviour (record/wait ordering, raw stream pointer equality) runs in ``tests/test_pool_gpu.py`` and the
last test below.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from bufreuse.pool._device import DeviceOps  # noqa: E402


def _version() -> str:
    return f"torch {torch.__version__}"


def test_cuda_event_base_exists_and_is_the_event_base() -> None:
    base = getattr(torch._C, "_CudaEventBase", None)
    assert base is not None, f"{_version()}: torch._C._CudaEventBase missing (DeviceOps binds its methods)"
    assert issubclass(torch.cuda.Event, base), f"{_version()}: torch.cuda.Event no longer derives _CudaEventBase"


@pytest.mark.gpu
def test_cuda_event_base_has_record_and_wait_on_cuda_builds() -> None:
    assert torch.version.cuda is not None, f"{_version()} is a CPU build on a machine with a GPU"
    base = torch._C._CudaEventBase
    for name in ("record", "wait"):
        assert callable(getattr(base, name, None)), f"{_version()}: torch._C._CudaEventBase.{name} missing"
    assert issubclass(torch.cuda.Event, base), f"{_version()}: torch.cuda.Event no longer derives _CudaEventBase"


@pytest.mark.gpu
def test_current_raw_stream_lookup_exists_on_cuda_builds() -> None:
    assert torch.version.cuda is not None, f"{_version()} is a CPU build on a machine with a GPU"
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    assert callable(raw), f"{_version()}: torch._C._cuda_getCurrentRawStream missing (DeviceOps falls back, slower)"


def test_public_apis_device_ops_uses_exist() -> None:
    for name in ("current_stream", "is_current_stream_capturing", "Event", "Stream"):
        assert hasattr(torch.cuda, name), f"{_version()}: torch.cuda.{name} missing"
    assert hasattr(torch.Tensor, "untyped_storage")


def test_device_ops_on_cpu_does_nothing() -> None:
    ops = DeviceOps(torch.device("cpu"))
    assert ops.current_stream() is None and ops.new_event() is None
    assert ops.stream_is_current(None)
    ops.record(None, None)
    ops.wait(None, None)


@pytest.mark.gpu
def test_device_ops_raw_stream_and_event_order_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", torch.cuda.current_device())
    ops = DeviceOps(dev)
    main = ops.current_stream()
    assert main is ops.current_stream(), "the raw-pointer cache must return the same Stream object"
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert ops.stream_is_current(side) and not ops.stream_is_current(main)
    x = torch.zeros(1 << 20, device=dev)
    ev = ops.new_event()
    with torch.cuda.stream(side):
        x.add_(1)
        ops.record(ev, side)
    ops.wait(ev, main)
    assert float(x.sum()) == float(1 << 20)
