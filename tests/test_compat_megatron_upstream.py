"""The megatron-core contract against Megatron-LM main and dev, from a recording (CI installs PyPI only).

``tests/data/megatron/contract-upstream.json`` was written by ``scripts/record_megatron_contract.py`` from
the Megatron-LM sources read with ``fetch`` (refs, commits and dates inside). The recorder is checked
against the installed megatron-core 0.19.2 (its reading of ``core_r0.19.0`` must match ``inspect``), then
every assumption is checked on main and dev, and each drift must be refused by name.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import json
import re
import sys
import types
from pathlib import Path

import pytest

from bufreuse.errors import ConfigError
from bufreuse.integrations import _compat_megatron as compat
from bufreuse.integrations._compat_megatron import CONTRACT, EXTRA, recorded_problems

DATA = json.loads((Path(__file__).parent / "data" / "megatron" / "contract-upstream.json").read_text())
OUTPUT_BUFFER = "megatron.core.transformer.moe.experts:TEGroupedMLP.forward"
KNOWN_DRIFT = {"core_r0.19.0": set(), "main": set(), "dev": {OUTPUT_BUFFER}}
"""Per ref: the assumptions that do not hold there, each with a refusal test below."""


def test_recording_names_main_and_dev_by_commit_and_date():
    assert {"main", "dev", "core_r0.19.0"} <= set(DATA["refs"])
    for ref in DATA["refs"].values():
        assert re.fullmatch(r"[0-9a-f]{40}", ref["commit"]) and re.match(r"20\d\d-\d\d-\d\dT", ref["date"])
    wanted = {f"{a.module}:{a.attr}" for a in (*CONTRACT, *EXTRA)}
    for ref, symbols in DATA["symbols"].items():
        assert wanted <= set(symbols), f"{ref}: re-run scripts/record_megatron_contract.py"


def test_recorder_agrees_with_the_installed_megatron_core_0_19():
    pytest.importorskip("megatron.core")
    assert compat.megatron_core_version().startswith("0.19")
    recorded = DATA["symbols"]["core_r0.19.0"]
    needs_deps = set()
    for a in (*CONTRACT, *EXTRA):
        entry = recorded[f"{a.module}:{a.attr}"]
        try:
            obj = compat._resolve(a.module, a.attr)
        except (ImportError, AttributeError):
            if entry["present"]:
                needs_deps.add(a.attr)
            continue
        assert entry["present"], a.attr
        if entry["params"] is not None:
            star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
            names = [star.get(q.kind, "") + q.name for q in inspect.signature(obj).parameters.values()]
            assert names == entry["params"], a.attr
    # defined in the source but importable only with DeepEP / Transformer Engine installed:
    assert needs_deps == {"HybridEPBuffer", "TEGroupedLinear.forward"}


@pytest.mark.parametrize("ref", ["core_r0.19.0", "main", "dev"])
def test_every_assumption_holds_or_is_a_known_drift(ref):
    symbols = DATA["symbols"][ref]
    assert recorded_problems(symbols, CONTRACT, ref) == []  # the private API the adapters call: unchanged
    broken = {f"{a.module}:{a.attr}" for a in EXTRA if recorded_problems(symbols, (a,), ref)}
    assert broken == KNOWN_DRIFT[ref]


def test_recorded_problems_catches_a_changed_signature():
    """Positive control: the same check over an edited recording names the assumption."""
    symbols = json.loads(json.dumps(DATA["symbols"]["main"]))
    key = "megatron.core.pipeline_parallel.utils:ScheduleNode._forward"
    symbols[key]["params"] = ["inputs"]
    (problem,) = recorded_problems(symbols, CONTRACT, "edited")
    assert "ScheduleNode._forward" in problem and "free_input skips ring storage" in problem
    del symbols[key]
    assert "was not recorded" in recorded_problems(symbols, CONTRACT, "edited")[0]


def _experts_with(params: list[str]) -> object:
    """A TEGroupedMLP stand-in whose forward has exactly the recorded parameters."""

    def forward(*args, **kwargs):
        return None

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in params]
    )
    cls = type("TEGroupedMLP", (), {"forward": forward, "_with_fused_impl": True})
    return cls()


def test_dev_op_fuser_route_is_refused_by_name():
    pytest.importorskip("torch")
    from bufreuse.integrations.te.out_route import require_fused_output_buffer

    key = types.SimpleNamespace(OUTPUT_BUFFER_KEY="output_buffer")
    require_fused_output_buffer(_experts_with(DATA["symbols"]["main"][OUTPUT_BUFFER]["params"]), key)  # main: ok
    with pytest.raises(ConfigError, match=r"TEGroupedMLP\.forward\(output_buffer=\)"):
        require_fused_output_buffer(_experts_with(DATA["symbols"]["dev"][OUTPUT_BUFFER]["params"]), key)


def test_free_input_skip_applies_on_main_and_dev():
    """The skip patches ScheduleNode._forward(self, *inputs) and reads self.free_input / self.stream."""
    for ref in ("main", "dev"):
        symbols = DATA["symbols"][ref]
        assert symbols["megatron.core.pipeline_parallel.utils:ScheduleNode._forward"]["params"] == ["self", "*inputs"]
        assert "free_input" in symbols["megatron.core.pipeline_parallel.utils:ScheduleNode.__init__"]["params"]


def test_scheduled_tensor_release_is_detected_and_refused_under_ep_overlap(monkeypatch):
    """Megatron-LM dev's combined-1F1B tensor release (after the recorded dev commit): refused by name."""
    name = compat.SCHEDULED_RELEASE_MODULES[0]
    assert compat.scheduled_tensor_release() is None  # not in megatron-core 0.19.2
    fake = types.ModuleType(name)
    fake.__spec__ = importlib.machinery.ModuleSpec(name, None)
    monkeypatch.setitem(sys.modules, name, fake)
    assert compat.scheduled_tensor_release() == name
    from bufreuse.integrations.megatron import _refuse_scheduled_release

    _refuse_scheduled_release(types.SimpleNamespace(overlap_moe_expert_parallel_comm=False))  # no EP overlap: fine
    with pytest.raises(ConfigError, match=re.escape(name)):
        _refuse_scheduled_release(types.SimpleNamespace(overlap_moe_expert_parallel_comm=True))
