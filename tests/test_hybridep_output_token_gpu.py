"""Real DeepEP HybridEP with bufreuse's ``output_token`` edit, at world sizes 1 and 2 on the one GPU.

DeepEP hybrid-ep is built on the device by ``scripts/hybridep-device.sh`` with
``scripts/deepep_output_token.py`` applied (upstream has no caller-provided output). Each rank is its own
process (``tests/hybridep_ranks.py``) sharing GPU 0 over gloo, as the kernels need: ``USE_MNNVL=0``
(CUDA IPC, no fabric memory) and libstdc++ preloaded (the constructor segfaults otherwise). Elsewhere
the module skips, naming the device run; ``BUFREUSE_REQUIRE_DEEPEP=1`` turns a missing DeepEP into a
failure.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"


def _deepep_with_output_token() -> str:
    """Empty when DeepEP's HybridEPBuffer imports and takes ``output_token``, else why not."""
    try:
        from deep_ep import HybridEPBuffer
    except Exception as e:  # ImportError, or OSError from the extension's libraries
        return f"DeepEP hybrid-ep does not import ({type(e).__name__}: {e})"
    from bufreuse.integrations.features import deepep_output_token

    ok, detail = deepep_output_token(HybridEPBuffer)
    return "" if ok else detail


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deepep() -> None:
    why = _deepep_with_output_token()
    if why:
        if os.environ.get("BUFREUSE_REQUIRE_DEEPEP", "") not in ("", "0"):
            pytest.fail(f"BUFREUSE_REQUIRE_DEEPEP is set: {why}")
        pytest.skip(f"{why}; on the GPU: bash scripts/hybridep-device.sh run")


def _ranks(world: int, tmp_path: Path) -> list[dict]:
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, USE_MNNVL="0", PYTHONPATH=path)
    if LIBSTDCXX not in env.get("LD_PRELOAD", "") and Path(LIBSTDCXX).exists():
        env["LD_PRELOAD"] = ":".join(p for p in (LIBSTDCXX, env.get("LD_PRELOAD", "")) if p)
    port = _free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    script = str(HERE / "hybridep_ranks.py")
    argv = [[sys.executable, script, str(r), str(world), str(port), str(o)] for r, o in enumerate(outs)]
    procs = [subprocess.Popen(a, env=env) for a in argv]
    codes = [p.wait(timeout=240) for p in procs]
    facts = [json.loads(o.read_text()) if o.exists() else {"rank": r, "error": f"exit {c}, no facts"}
             for r, (o, c) in enumerate(zip(outs, codes, strict=True))]  # fmt: skip
    record = Path(os.environ.get("OUT", "out")) / f"hybridep-output-token-ws{world}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(facts, indent=1))
    for f, c in zip(facts, codes, strict=True):
        why = f"rank {f.get('rank')}: exit {c}: {f.get('error')}\n{f.get('traceback', '')}"
        assert c == 0 and "error" not in f, why
    return facts


@pytest.mark.parametrize("world", [1, 2])
def test_output_token_receives_exactly_the_dispatch(deepep, tmp_path, world: int) -> None:
    for f in _ranks(world, tmp_path):
        assert f["same_storage"], f  # the kernels wrote into the caller's slot, not a fresh allocation
        assert f["rows_written"] > 0 and f["rows_equal"] and f["probs_equal"], f
        assert f["nan_rows_inside_splits"] == 0, f  # a reused slot's stale rows never survive inside the splits
        assert f["combine_equal"] and f["combine_nonzero"], f
        assert all(v != "accepted" and "output_token" in v for v in f["refusals"].values()), f["refusals"]
