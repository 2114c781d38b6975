"""Sites and categories from frames as torch really records them (C++ frames first, Windows paths).

Frames here copy the shape of what ``torch.cuda.memory._record_memory_history()`` writes with its
default ``stacks="all"``: native frames (``??``, ``memory_snapshot.cpp``, ``CUDACachingAllocator.cpp``,
empty filenames, line 0) innermost, then Python frames innermost first. The names are made up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from snapshot_synth import block, entry, segment, write

from bufreuse.analysis.snapshot import SiteRules, report_file
from bufreuse.analysis.snapshot.whatif import what_if
from bufreuse.errors import InputError

MiB = 1 << 20


def f(filename: str, name: str, line: int = 0) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


NATIVE = [
    f("??", "torch::unwind::unwind()"),
    f("/pytorch/torch/csrc/profiler/combined_traceback.cpp", "torch::CapturedTraceback::gather(bool, bool, bool)"),
    f("/pytorch/torch/csrc/cuda/memory_snapshot.cpp", "torch::cuda::(anonymous namespace)::gather_with_cpp()"),
    f(
        "/pytorch/c10/cuda/CUDACachingAllocator.cpp",
        "c10::cuda::CUDACachingAllocator::Native::malloc(int, unsigned long)",
    ),
    f("", "at::indexing::dispatch_index(at::Tensor const&, std::vector<at::Tensor>&&)"),
    f("??", "torch::autograd::dispatch_to(at::Tensor const&, c10::Device, bool, bool)"),
    f("/usr/lib/x86_64-linux-gnu/libc.so.6", "start_thread"),
]
SITE_PKG = "/opt/conda/lib/python3.10/site-packages"
CNN = [
    f(f"{SITE_PKG}/torch/nn/modules/conv.py", "_conv_forward", 456),
    f("/home/u/cosmo/net.py", "forward", 88),
    f("/home/u/cosmo/train.py", "step", 12),
]
JUPYTER = [f(f"{SITE_PKG}/ipykernel/kernelbase.py", "dispatch_shell", 409)]
MEGATRON = [
    f(f"{SITE_PKG}/torch/distributed/distributed_c10d.py", "all_to_all_single", 4000),
    f("/w/Megatron-LM/megatron/core/tensor_parallel/mappings.py", "forward", 488),
    f("/w/Megatron-LM/megatron/core/transformer/moe/token_dispatcher.py", "token_dispatch", 301),
    f("/w/Megatron-LM/megatron/core/transformer/moe/moe_layer.py", "forward", 190),
]


def test_native_frames_are_never_the_site() -> None:
    frames = [*NATIVE, *CNN]
    # expected by hand: the first frame that is a .py file outside torch/, with its line
    assert SiteRules().site(frames) == "cosmo/net.py:88:forward"
    assert SiteRules(site_frame=1).site(frames) == "cosmo/train.py:12:step"
    # only native frames: no site at all (positive control above shows the rule does find one)
    assert SiteRules().site(NATIVE) == "<no user frame>"


def test_python_frame_with_line_0_or_not_a_py_file_is_not_a_site() -> None:
    frames = [f("/home/u/cosmo/net.py", "forward", 0), f("/home/u/ext/kernel.cu", "launch", 10), CNN[2]]
    assert SiteRules().site(frames) == "cosmo/train.py:12:step"


def test_windows_paths_are_normalised_and_torch_and_stdlib_skipped() -> None:
    frames = [
        f("C:\\Users\\u\\AppData\\Local\\Programs\\Python\\Python311\\Lib\\site-packages\\torch\\functional.py",
          "einsum", 402),
        f("C:\\Users\\u\\AppData\\Local\\Programs\\Python\\Python311\\Lib\\threading.py", "run", 975),
        f("C:\\Users\\u\\proj\\model.py", "forward", 31),
    ]  # fmt: skip
    assert SiteRules().site(frames) == "proj/model.py:31:forward"
    assert SiteRules().site(frames[2:]) == "proj/model.py:31:forward"
    assert SiteRules().site(frames[:2]) == "<no user frame>"


def test_builtin_categories_ignore_cpp_and_jupyter_dispatch_names() -> None:
    assert SiteRules().category([*NATIVE, *CNN]) == "other"
    assert SiteRules().category([*NATIVE, *JUPYTER, *CNN]) == "other"
    # positive controls: the same native frames above Megatron's dispatcher, and a proxy's `dispatch`
    assert SiteRules().category([*NATIVE, *MEGATRON]) == "dispatch_output"
    assert SiteRules().category([*NATIVE, f("/x/bench/schedule.py", "dispatch", 89)]) == "dispatch_output"
    te = f(f"{SITE_PKG}/transformer_engine/pytorch/module/grouped_linear.py", "forward", 120)
    assert SiteRules().category([*NATIVE, te]) == "expert_output"


def test_builtin_rules_read_python_frames_only() -> None:
    # a native frame whose text a built-in rule would match (a library symbol, a .cu file) is not MoE
    native = [f("/opt/ext/csrc/fused_a2a.cu", "launch_kernel"), f("", "ext::grouped_linear_fwd(at::Tensor)")]
    assert SiteRules().category([*native, *CNN]) == "other"
    # positive control: the same names in Python frames are MoE
    py = [f("/opt/ext/fused_a2a.py", "launch", 3), f("/opt/ext/grouped_linear.py", "fwd", 9)]
    assert SiteRules().category([*py, *CNN]) == "dispatch_output"
    assert SiteRules().category([py[1], *CNN]) == "expert_output"


def test_a_user_rule_may_match_cpp_names() -> None:
    rules = SiteRules(categories={"indexing": r"dispatch_index"})
    assert rules.category([*NATIVE, *CNN]) == "indexing"
    assert SiteRules().category([*NATIVE, *CNN]) == "other"


def _cnn_trace(tmp_path: Path, frames: list[dict[str, Any]]) -> Path:
    """A record_stream-style trace: 3 blocks of 8 MiB freed late, all allocated under ``frames``."""
    base, trace = 1 << 32, []
    for k in range(3):
        a = base + k * 8 * MiB
        trace += [entry("segment_alloc", a, 8 * MiB, frames=frames), entry("alloc", a, 8 * MiB, frames=frames)]
    for k in range(3):
        trace.append(entry("free_requested", base + k * 8 * MiB, 8 * MiB, frames=frames))
    for k in range(3):
        trace.append(entry("free_completed", base + k * 8 * MiB, 8 * MiB, frames=frames))
    final = [segment(base + k * 8 * MiB, 8 * MiB, [block(base + k * 8 * MiB, 8 * MiB, "inactive")]) for k in range(3)]
    return write(tmp_path / "cnn.pickle", {"segments": final, "device_traces": [trace]})


def test_report_on_cpp_framed_trace_names_user_site_and_no_moe_category(tmp_path: Path) -> None:
    rep = report_file(_cnn_trace(tmp_path, [*NATIVE, *CNN]))
    groups = rep["pending_free_groups_at_max_active"]
    assert [(g["site"], g["count"], g["category"]) for g in groups] == [("cosmo/net.py:88:forward", 3, "other")]
    assert rep["pending_free_by_category_at_max_active"]["dispatch_output"] == 0
    assert rep["pending_free_by_category_at_max_active"]["other"] == 3 * 8 * MiB


def test_what_if_refuses_a_category_without_moe_frames(tmp_path: Path) -> None:
    path = _cnn_trace(tmp_path, [*NATIVE, *CNN])
    with pytest.raises(InputError, match="no allocation in the trace matches"):
        what_if(path, [2])  # built-in rules: C++ dispatch_* names are not MoE
    with pytest.raises(InputError, match="has no MoE frame"):
        what_if(path, [2], categories={"indexing": "dispatch_index"})
    # positive control: the same trace under Megatron's dispatcher builds a ring and predicts
    moe = what_if(_cnn_trace(tmp_path, [*NATIVE, *MEGATRON]), [3])
    assert [r.name for r in moe.rings] == ["dispatch_output"] and moe.rings[0].min_slots == 3
    assert moe.predictions[-1].feasible


def test_final_state_only_snapshot_breaks_pending_free_down_by_site(tmp_path: Path) -> None:
    base = 1 << 32
    moe_block = block(base, 16 * MiB, "active_pending_free", 16 * MiB)
    moe_block["frames"] = [*NATIVE, *MEGATRON]
    cnn_block = block(base + 16 * MiB, 4 * MiB, "active_pending_free", 3 * MiB)
    cnn_block["frames"] = [*NATIVE, *CNN]
    old = block(base + 20 * MiB, 2 * MiB, "active_pending_free", 2 * MiB)  # torch 2.0: frames under history
    del old["frames"]
    old["history"] = [{"addr": base + 20 * MiB, "real_size": 2 * MiB, "frames": [*NATIVE, *MEGATRON]}]
    live = block(base + 22 * MiB, 2 * MiB, "active_allocated", 2 * MiB)
    segs = [
        segment(base, 24 * MiB, [moe_block, cnn_block, old, live], stream=7),
    ]
    rep = report_file(write(tmp_path / "final.pickle", {"segments": segs, "device_traces": []}))
    assert rep["recording"] is False
    got = {(g["site"], g["total_bytes"], g["category"]) for g in rep["pending_free_groups_at_max_active"]}
    site = "tensor_parallel/mappings.py:488:forward"  # innermost non-torch Python frame
    assert got == {(site, 16 * MiB, "dispatch_output"), (site, 2 * MiB, "dispatch_output"),
                   ("cosmo/net.py:88:forward", 3 * MiB, "other")}  # fmt: skip
    by_cat = rep["pending_free_by_category_at_max_active"]
    assert by_cat["dispatch_output"] == 18 * MiB and by_cat["other"] == 3 * MiB
    assert rep["streams"]["7"]["pending_free_at_max_active_bytes"] == 21 * MiB
    assert rep["pending_free_at_max_active_bytes"] == sum(by_cat.values())


def _two_device_snapshot(tmp_path: Path) -> Path:
    """Device 0: a 4 MiB record_stream free while a 1 KiB block pending from before the trace still waits;
    device 1: a bigger reserve, so it is the device reported."""
    base = 1 << 32
    t0 = [
        entry("alloc", base + 8 * MiB, 4 * MiB, frames=[*NATIVE, *CNN]),
        entry("free_requested", base + 8 * MiB, 4 * MiB, frames=[*NATIVE, *CNN]),
        entry("free_completed", base, 1024),  # its free_requested predates the trace: pending before it
        entry("alloc", base + 16 * MiB, 4 * MiB, frames=[*NATIVE, *CNN]),
        entry("free_completed", base + 8 * MiB, 4 * MiB, frames=[*NATIVE, *CNN]),
    ]
    t1 = [entry("alloc", base, 64 * MiB, frames=[*NATIVE, *CNN]), entry("free_requested", base, 64 * MiB)]
    segs = [
        segment(base, 24 * MiB, [block(base, 2 * MiB, "inactive"), block(base + 16 * MiB, 4 * MiB, "active_allocated",
                                                                          4 * MiB)], device=0),
        segment(base, 64 * MiB, [block(base, 64 * MiB, "active_pending_free", 64 * MiB)], device=1),
    ]  # fmt: skip
    return write(tmp_path / "two.pickle", {"segments": segs, "device_traces": [t0, t1]})


def test_multi_device_text_names_its_device_and_the_others(tmp_path: Path) -> None:
    from bufreuse.analysis.render.export import renderable_text
    from bufreuse.analysis.render.snapshot_tables import file_renderable

    rep = report_file(_two_device_snapshot(tmp_path))
    assert rep["device"] == 1  # 64 MiB reserved beats 24 MiB
    text = " ".join(renderable_text(file_renderable(rep), width=200).split())  # the title may wrap
    assert "(device 1)" in text and "also in the file: device 0" in text


def test_max_pending_free_excludes_pre_trace_bytes_and_small_figures_print_in_bytes(tmp_path: Path) -> None:
    from bufreuse.analysis.snapshot import load_snapshot
    from bufreuse.analysis.snapshot.report import ReportConfig, analyze

    data = load_snapshot(_two_device_snapshot(tmp_path))
    data.traces.pop(1)  # device 0 alone
    data.final.pop(1)
    rep, _ = analyze(data, ReportConfig(pending_series_points=0))
    assert rep["device"] == 0
    # the trace's own record_stream free: 4 MiB; the 1 KiB pending at trace start is apart
    assert rep["max_pending_free_bytes"] == 4 * MiB
    assert rep["pending_before_trace_bytes"] == 1024
    assert any(w.startswith("1,024 B pending free before the trace began") for w in rep["warnings"])
