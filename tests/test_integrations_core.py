"""The integration core: installation undo, shared patches, the adapter registry and the matrix it assembles."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bufreuse.config import BufReuseConfig
from bufreuse.integrations import core
from bufreuse.integrations.adapters import ADAPTERS, adapter
from bufreuse.integrations.core import Installation
from bufreuse.integrations.requirements import REQUIREMENTS

ROOT = Path(__file__).parents[1]

# The report order check-config printed before the rows moved into the adapters.
KEY_ORDER = [
    "dispatcher",
    "static_bound",
    "ep_overlap",
    "quantized_experts",
    "deepep_output_token",
    "te_op_fuser",
    "grouped_gemm",
    "te_grouped_output",
    "no_fused_group_mlp_offload",
    "tokens_known",
    "unfused_permute",
    "sequential_mlp",
    "no_shared_expert_overlap",
    "no_moe_recompute",
    "no_cuda_graphs",
    "dispatch_slots",
]


class _Thing:
    def method(self) -> str:
        return "class"


def _installation() -> Installation:
    return Installation(pool=None, knobs=BufReuseConfig(), tokens=8)  # type: ignore[arg-type]


def test_matrix_keeps_report_order_and_unique_keys() -> None:
    assert [r.key for r in REQUIREMENTS] == KEY_ORDER


def test_every_adapter_row_is_in_the_matrix_and_applies_to_its_path_only() -> None:
    keys = {r.key for r in REQUIREMENTS}
    for a in ADAPTERS:
        rows = a.requirements()
        assert rows, f"adapter {a.name} owns no requirement rows"
        assert {r.key for r in rows} <= keys
        assert all(r.paths == {a.path} for r in rows), a.name
        assert all(r.buffers <= core.BOTH for r in rows)


def test_registry_adapters_satisfy_the_protocol() -> None:
    for a in ADAPTERS:
        for name in ("name", "path", "buffers", "dispatcher", "label"):
            assert hasattr(a, name), f"{a.name} lacks {name}"
        for name in ("supports", "requirements", "check", "hook"):
            assert callable(getattr(a, name)), f"{a.name}.{name}"
    assert [a.name for a in ADAPTERS] == ["hybridep", "te", "alltoall"]
    assert adapter("te").buffers == {"expert"}
    with pytest.raises(KeyError, match="registered: hybridep, te, alltoall"):
        adapter("deepep")


def test_installation_override_uninstall_restores_instance_and_class_attributes() -> None:
    thing = _Thing()
    thing.own = 1  # type: ignore[attr-defined]
    inst = _installation()
    inst.override(thing, "method", lambda: "hooked")
    inst.override(thing, "own", 2)
    assert thing.method() == "hooked" and thing.own == 2  # type: ignore[attr-defined]
    inst.uninstall()
    assert thing.method() == "class" and thing.own == 1  # type: ignore[attr-defined]
    assert "method" not in vars(thing)
    inst.uninstall()  # idempotent
    assert thing.method() == "class"


def test_shared_patches_stay_until_the_last_installation_uninstalls() -> None:
    undone: list[str] = []
    first, second = _installation(), _installation()
    with first:
        first.activate()
        second.activate()
        core.shared_patch(lambda: undone.append("shared"))
        assert core.shared_patches_applied() and len(core.active_installations()) == 2
    assert undone == [] and core.shared_patches_applied()
    second.uninstall()
    assert undone == ["shared"] and not core.shared_patches_applied() and core.active_installations() == []


def test_adapters_for_gives_each_buffer_to_the_first_supporting_adapter(monkeypatch) -> None:
    from bufreuse.integrations import megatron

    class Fake:
        def __init__(self, name: str, buffers: set[str], ok: bool) -> None:
            self.name, self.buffers, self.ok = name, frozenset(buffers), ok
            self.path, self.dispatcher, self.label = "alltoall", True, name

        def supports(self, layer: object) -> bool:
            return self.ok

    fakes = (Fake("a", {"dispatch"}, True), Fake("b", {"dispatch", "expert"}, True), Fake("c", {"expert"}, True))
    monkeypatch.setattr(megatron, "ADAPTERS", fakes)
    assert [a.name for a in megatron._adapters_for(object())] == ["a", "c"]
    fakes[0].ok = False
    assert [a.name for a in megatron._adapters_for(object())] == ["b"]


def test_core_and_requirements_import_without_torch_or_megatron() -> None:
    code = (
        "import sys, bufreuse.integrations.requirements, bufreuse.integrations.megatron; "
        "bad = [m for m in ('torch', 'megatron') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
