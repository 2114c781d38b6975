"""The ``bufreuse-megatron`` entry's pre-flight checks, from Megatron-LM's command line and the environment only.

HybridEP runs (``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep``, DeepEP ``hybrid-ep``)
whose set-up would segfault or hang inside ``HybridEPBuffer(...)`` stop before Megatron starts, with one line
(:class:`ConfigError`, exit 2) naming the fix:

- no libstdc++ in ``LD_PRELOAD``: the constructor segfaults in ``get_comm_id`` (the extension links parts of
  libstdc++, and load order decides which copy runs). ``BUFREUSE_SKIP_HYBRIDEP_PRELOAD_CHECK=1`` skips this check
  for a DeepEP build that does not need the preload;
- several local processes on one GPU: they need ``USE_MNNVL=0`` (DeepEP allocates with ``cudaMalloc`` and shares
  by CUDA IPC, no fabric memory; the set-up that ran on one GPU, 2026-12-06). Set here (and said) when
  ``LOCAL_WORLD_SIZE`` exceeds the visible GPUs, which every rank sees alike; an error when ``USE_MNNVL`` asks
  for fabric memory there, or when only this rank can tell it was moved to device 0 (``LOCAL_RANK=0`` on a rank
  whose ``RANK`` says otherwise: setting it on some ranks only would mix allocators);
- local experts x ranks per NVLink domain not a multiple of 4 (DeepEP ``csrc/hybrid_ep/config.cuh``
  ``is_valid``): at EP 2, an odd number of local experts.
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping, Sequence

from bufreuse.errors import ConfigError

__all__ = ["SKIP_PRELOAD_ENV", "flag_value", "hybridep_preflight", "libstdcxx_path", "uses_hybridep", "visible_gpus"]

SKIP_PRELOAD_ENV = "BUFREUSE_SKIP_HYBRIDEP_PRELOAD_CHECK"


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` on a command line (``--flag value`` or ``--flag=value``; the last one counts)."""
    value = None
    for i, tok in enumerate(argv):
        if tok == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(name + "="):
            value = tok[len(name) + 1 :]
    return value


def uses_hybridep(argv: Sequence[str]) -> bool:
    """Whether the run dispatches through HybridEP (flex dispatcher, hybridep backend)."""
    return (flag_value(argv, "--moe-token-dispatcher-type") == "flex"
            and flag_value(argv, "--moe-flex-dispatcher-backend") == "hybridep")  # fmt: skip


def libstdcxx_path() -> str:
    """The system libstdc++ to preload (Debian/Ubuntu multiarch path of this machine)."""
    return f"/usr/lib/{platform.machine()}-linux-gnu/libstdc++.so.6"


def visible_gpus(env: MutableMapping[str, str]) -> int:
    """``CUDA_VISIBLE_DEVICES``'s entries when set, else ``torch.cuda.device_count()``."""
    vis = env.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([d for d in vis.split(",") if d.strip() and not d.strip().startswith("-")])
    import torch

    return int(torch.cuda.device_count())


def _int(env: MutableMapping[str, str], key: str) -> int | None:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        return None


def _check_experts(argv: Sequence[str], env: MutableMapping[str, str]) -> None:
    experts, ep = flag_value(argv, "--num-experts"), flag_value(argv, "--expert-model-parallel-size") or "1"
    etp = flag_value(argv, "--expert-tensor-parallel-size") or "1"
    if not (experts and experts.isdigit() and ep.isdigit() and etp.isdigit()) or int(experts) % int(ep):
        return  # absent or malformed: Megatron's own argument checks speak
    local = int(experts) // int(ep)
    per_domain = _int(env, "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN") or int(ep) * int(etp)
    if local * per_domain % 4:
        raise ConfigError(
            f"HybridEP: --num-experts {experts} at --expert-model-parallel-size {ep} gives {local} local expert(s); "
            f"DeepEP hybrid-ep needs local experts x ranks per NVLink domain ({per_domain}) to be a multiple of 4 "
            f"(csrc/hybrid_ep/config.cuh; at EP 2: an even number of local experts), else HybridEPBuffer's "
            f"construction fails: choose --num-experts accordingly"
        )


def _check_preload(env: MutableMapping[str, str]) -> str | None:
    if env.get(SKIP_PRELOAD_ENV) == "1":
        return f"HybridEP: libstdc++ preload check skipped ({SKIP_PRELOAD_ENV}=1)"
    entries = env.get("LD_PRELOAD", "").replace(":", " ").split()
    if not any(os.path.basename(e).startswith("libstdc++.so") for e in entries):
        raise ConfigError(
            f"HybridEP: LD_PRELOAD has no libstdc++, and DeepEP hybrid-ep's HybridEPBuffer constructor then "
            f"segfaults in get_comm_id (its extension links parts of libstdc++; load order decides which copy runs): "
            f"start every rank with LD_PRELOAD={libstdcxx_path()} (or set {SKIP_PRELOAD_ENV}=1 if your DeepEP build "
            f"does not need it)"
        )
    return None


def _check_shared_gpu(env: MutableMapping[str, str], gpus: int) -> str | None:
    local_world, rank, local_rank = _int(env, "LOCAL_WORLD_SIZE") or 1, _int(env, "RANK"), _int(env, "LOCAL_RANK")
    mnnvl = env.get("USE_MNNVL")
    off = mnnvl is not None and mnnvl.strip().lower() in ("0", "false")
    by_count = gpus >= 1 and local_world > gpus
    pinned = local_world > 1 and local_rank == 0 and rank is not None and rank % local_world != 0
    if not (by_count or pinned) or off:
        return None
    if mnnvl is not None:
        raise ConfigError(
            f"HybridEP: USE_MNNVL={mnnvl} asks for fabric memory, but {local_world} local processes share a GPU: "
            f"start every rank with USE_MNNVL=0 (cudaMalloc + CUDA IPC)"
        )
    if by_count:
        env["USE_MNNVL"] = "0"
        return (
            f"HybridEP: {local_world} local processes on {gpus} visible GPU(s): set USE_MNNVL=0 (processes sharing "
            f"a GPU: DeepEP hybrid-ep allocates with cudaMalloc and shares by CUDA IPC, no fabric memory)"
        )
    raise ConfigError(
        f"HybridEP: rank {rank} runs on device 0 (LOCAL_RANK=0, LOCAL_WORLD_SIZE={local_world}), so ranks share a "
        f"GPU and DeepEP hybrid-ep needs USE_MNNVL=0 on every rank, which rank 0 cannot tell here: start every rank "
        f"with USE_MNNVL=0"
    )


def hybridep_preflight(argv: Sequence[str], env: MutableMapping[str, str], *, gpus: int | None = None) -> list[str]:
    """Check a HybridEP run's set-up; the lines to log (``env`` may gain ``USE_MNNVL=0``). Nothing for other runs.

    Raises :class:`ConfigError` (one line, exit 2) for a set-up that would segfault or hang. ``gpus``: the visible
    GPU count (default :func:`visible_gpus`); with none visible the shared-GPU check is skipped.
    """
    if not uses_hybridep(argv):
        return []
    _check_experts(argv, env)
    notes = [_check_preload(env)]
    notes.append(_check_shared_gpu(env, visible_gpus(env) if gpus is None else gpus))
    return [n for n in notes if n]
