"""The megatron-core private APIs bufreuse relies on (``bufreuse.integrations._compat_megatron.CONTRACT``).

Checked against the installed megatron-core (0.19.x) and, in a subprocess, against 0.16.1 (the
``.venv-megatron016`` target folder CI installs): a failure names the symbol, the version and the
bufreuse code that depends on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from bufreuse.integrations._compat_megatron import (
    CONTRACT,
    Assumption,
    contract_problems,
    megatron_core_version,
)

ROOT = Path(__file__).parents[1]
MC016 = Path(os.environ.get("BUFREUSE_MEGATRON_016", ROOT / ".venv-megatron016"))


def test_contract_holds_on_installed_megatron_core() -> None:
    problems = contract_problems()
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not (MC016 / "megatron" / "core").is_dir(), reason="megatron-core 0.16.x target folder absent")
def test_contract_holds_on_megatron_core_016() -> None:
    code = textwrap.dedent(
        """
        import json, warnings
        warnings.simplefilter("ignore")
        import megatron.core
        from bufreuse.integrations._compat_megatron import contract_problems, megatron_core_version
        print(json.dumps({"file": megatron.core.__file__, "version": megatron_core_version(),
                          "problems": contract_problems()}))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(MC016), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["file"].startswith(str(MC016))
    assert res["version"].startswith("0.16.")
    assert not res["problems"], "\n".join(res["problems"])


def test_contract_problem_names_missing_symbol_and_version() -> None:
    missing = Assumption(module="megatron.core.pipeline_parallel.utils", attr="ScheduleNode._gone", used_by="x")
    (line,) = contract_problems((missing,))
    assert "megatron.core.pipeline_parallel.utils.ScheduleNode._gone" in line
    assert f"megatron-core {megatron_core_version()}" in line
    assert "is missing" in line


def test_contract_problem_names_changed_signature() -> None:
    changed = Assumption(
        module="megatron.core.full_cuda_graph",
        attr="FullCudaGraphWrapper.curr_iter",
        params=("self", "phase"),
        used_by="graphs",
    )
    (line,) = contract_problems((changed,))
    assert "FullCudaGraphWrapper.curr_iter" in line and "expected it to start with ('self', 'phase')" in line


def test_contract_optional_symbol_absent_is_not_a_problem() -> None:
    optional = Assumption(module="megatron.core.full_cuda_graph", attr="not_there", optional=True, used_by="x")
    assert contract_problems((optional,)) == []


def test_contract_covers_every_private_name_the_integrations_use() -> None:
    """Every ``._name`` megatron attribute the compat module reaches appears in CONTRACT."""
    src = (ROOT / "bufreuse" / "integrations" / "_compat_megatron.py").read_text()
    used = {"_HybridEPManager", "_maybe_dtoh_and_synchronize", "_pad_tensor_for_quantization", "_hybrid_ep_buffer",
            "_coalescing_manager"}
    declared = {part for a in CONTRACT for part in a.attr.split(".")}
    assert used <= declared
    assert all(name in src for name in used)
