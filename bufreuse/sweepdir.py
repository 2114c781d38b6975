"""The sweep directory: one folder per configuration, shared by every launcher and by ``compare``.

Layout (``JobPaths``-style: this class owns every file name)::

    <sweeps root>/<sweep name>/manifest.json        sweep parameters and configuration ids
    <sweeps root>/<sweep name>/<config id>/config.json      what to run (plain JSON)
                                          /metrics.json     written last, atomically: its presence
                                                            means the configuration finished
                                          /snapshot.pickle.gz
                                          /log.txt
                                          /job.json         launcher state (job id, node list, ...)

The sweeps root is ``./bufreuse-sweeps`` unless ``--root`` or ``$BUFREUSE_SWEEPS`` says otherwise.
``metrics.json["status"]`` is one of :data:`STATUSES`; ``ok`` is the only successful one.
This module imports no torch: ``analysis`` and ``cli`` read sweeps without a GPU.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bufreuse.errors import InputError
from bufreuse.fsutil import atomic_write_json, read_json

__all__ = [
    "DEFAULT_SWEEPS_ROOT",
    "METRIC_FIGURES",
    "STATUSES",
    "SWEEPS_ENV",
    "ConfigPaths",
    "SweepDir",
    "blank_metrics",
    "check_config_id",
    "latest_sweep",
    "metrics_problem",
    "sweeps_root",
    "utc_now",
]

SWEEPS_ENV = "BUFREUSE_SWEEPS"
DEFAULT_SWEEPS_ROOT = Path("bufreuse-sweeps")
STATUSES = ("ok", "failed", "hung", "timeout", "cancelled")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")

METRIC_FIGURES: dict[str, Any] = {
    "max_reserved_bytes": None,
    "max_allocated_bytes": None,
    "device_used_bytes": None,
    "step_ms": None,
    "tflops": None,
    "pending_free_at_max_active_bytes": None,
    "pending_free_by_category_at_max_active": None,
    "ring_bytes": {},
    "ring_slot_bytes": {},
    "checksum": None,
}
"""The measured figures of ``metrics.json`` and their value when nothing was measured.

Besides these, every ``metrics.json`` has ``status``, ``error``, ``config``, ``env``,
``started_at`` and ``finished_at`` (see :func:`blank_metrics`).
"""


_SIZE_FIELDS = ("max_reserved_bytes", "max_allocated_bytes", "device_used_bytes", "pending_free_at_max_active_bytes")
_STEP_FIELDS = ("median", "mean", "p10", "p90", "min", "max")


_MAX_SLOTS = 1 << 20  # far above any ring (limits.max_ring_slots is 1024): a figure, not a measurement, past it


def metrics_problem(m: dict[str, Any]) -> str | None:
    """What makes ``m``'s figures no measurement (a size that is negative, NaN or not a whole number,
    a negative or non-finite step time or TFLOP/s, step statistics out of order, ``error`` not text, a
    slot count or world size not a whole number); None when every figure is absent or plausible. A
    field of the wrong shape (``env`` a string, say) is the reader's error: it names the field."""

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    def whole(v: Any, top: int) -> bool:
        return number(v) and float(v).is_integer() and v <= top

    if m.get("error") is not None and not isinstance(m["error"], str):
        return f"error is {_shown(m['error'])}, not text"
    config, env = (m.get(k) if isinstance(m.get(k), dict) else {} for k in ("config", "env"))  # other shapes: the
    slots = config.get("slots")  # reader's error, naming the field
    if slots is not None and not whole(slots, _MAX_SLOTS):
        return f"config.slots is {_shown(slots)}, not a slot count (a whole number 0..{_MAX_SLOTS:,})"
    for key in ("world_size", "rank"):
        v = env.get(key)
        if v is not None and not whole(v, 1 << 31):
            return f"env.{key} is {_shown(v)}, not a whole number >= 0"
    check = m.get("checksum")  # the output's digest: a hex string, or a number in older files
    finite = isinstance(check, (int, float)) and not isinstance(check, bool) and math.isfinite(check)
    if check is not None and not (isinstance(check, str) or finite):
        return f"checksum is {_shown(check)}, not a digest (text) or a finite number"

    for key in _SIZE_FIELDS:
        v = m.get(key)
        if v is not None and not (number(v) and float(v).is_integer()):
            return f"{key} is {_shown(v)}, not a size in bytes (a whole number >= 0)"
    if m.get("tflops") is not None and not number(m["tflops"]):
        return f"tflops is {_shown(m['tflops'])}, not a number >= 0"
    step = m.get("step_ms")
    if step is not None:
        if not isinstance(step, dict):
            return None  # a wrong shape is the reader's error (it names the field), not a value refused here
        for key in _STEP_FIELDS:
            if step.get(key) is not None and not number(step[key]):
                return f"step_ms.{key} is {_shown(step[key])}, not a time in ms >= 0"
        present = [(k, step[k]) for k in ("min", "p10", "median", "p90", "max") if step.get(k) is not None]
        for (k1, v1), (k2, v2) in itertools.pairwise(present):
            if v1 > v2:
                return f"step_ms.{k1} ({_shown(v1)}) is above step_ms.{k2} ({_shown(v2)}): not statistics of one sample"
        values = step.get("values")
        if isinstance(values, list) and not all(number(v) for v in values):
            return "step_ms.values is not a list of times in ms >= 0"
    for key in ("ring_bytes", "ring_slot_bytes"):
        table = m.get(key)
        if not isinstance(table, dict):
            continue
        bad = next((k for k, v in table.items() if not (number(v) and float(v).is_integer())), None)
        if bad is not None:
            return f"{key}[{_shown(bad)}] is {_shown(table[bad])}, not a size in bytes"
    return None


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:39] + "…"


def utc_now() -> str:
    """The current UTC time as ISO 8601 to the second (the stamp every sweep file uses)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def blank_metrics(
    *,
    status: str,
    error: str | None,
    config: dict[str, Any],
    env: dict[str, Any],
    started_at: str | None,
) -> dict[str, Any]:
    """A complete ``metrics.json`` object with every figure unmeasured (None, or ``{}`` for maps).

    Writers fill in what they measured; readers (tables, ``compare``) can then rely on every key
    being present, whichever way the run ended. ``finished_at`` is stamped now.
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    metrics: dict[str, Any] = {"status": status, "error": error, "config": config}
    metrics.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in METRIC_FIGURES.items()})
    metrics.update(env=env, started_at=started_at, finished_at=utc_now())
    return metrics


def sweeps_root(override: str | os.PathLike[str] | None = None) -> Path:
    """The folder that holds sweeps: ``override``, else ``$BUFREUSE_SWEEPS``, else ``./bufreuse-sweeps``."""
    if override:
        return Path(override)
    env = os.environ.get(SWEEPS_ENV)
    return Path(env) if env else DEFAULT_SWEEPS_ROOT


@dataclass(frozen=True, slots=True)
class ConfigPaths:
    """Every file of one configuration's folder."""

    folder: Path

    @property
    def config(self) -> Path:
        return self.folder / "config.json"

    @property
    def metrics(self) -> Path:
        return self.folder / "metrics.json"

    @property
    def snapshot(self) -> Path:
        return self.folder / "snapshot.pickle.gz"

    @property
    def log(self) -> Path:
        return self.folder / "log.txt"

    @property
    def job(self) -> Path:
        return self.folder / "job.json"

    @property
    def config_id(self) -> str:
        return self.folder.name

    def read_metrics(self) -> dict[str, Any] | None:
        """The finished run's metrics, or None if it has not finished (or the file is unreadable).

        A file whose figures are no measurement (a negative or NaN size, say) comes back as a failed
        run whose ``error`` names the file and the field: refused alone, the other runs still reported.
        """
        try:
            data = read_json(self.metrics)
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("status") not in STATUSES:
            return None
        problem = metrics_problem(data)
        if problem:
            return {**data, **METRIC_FIGURES, "status": "failed", "error": f"{self.metrics}: refused: {problem}"}
        return data

    def is_finished(self) -> bool:
        return self.read_metrics() is not None

    def is_ok(self) -> bool:
        m = self.read_metrics()
        return m is not None and m["status"] == "ok"


class SweepDir:
    """One sweep folder: a manifest plus one :class:`ConfigPaths` per configuration id."""

    MANIFEST = "manifest.json"

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)

    @property
    def manifest_path(self) -> Path:
        return self.folder / self.MANIFEST

    def exists(self) -> bool:
        return self.manifest_path.is_file()

    def read_manifest(self) -> dict[str, Any]:
        try:
            data = read_json(self.manifest_path)
        except FileNotFoundError:
            raise InputError(f"{self.folder}: not a sweep folder (no {self.MANIFEST})") from None
        except (OSError, ValueError) as e:
            raise InputError(f"{self.manifest_path}: unreadable manifest ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("configs"), list):
            raise InputError(f"{self.manifest_path}: manifest has no 'configs' list")
        return data

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Write the manifest atomically; stamps ``created_at`` on first write."""
        manifest = dict(manifest)
        manifest.setdefault("created_at", utc_now())
        for cid in manifest.get("configs", []):
            check_config_id(cid)
        atomic_write_json(self.manifest_path, manifest)

    def config_ids(self) -> list[str]:
        return [str(c) for c in self.read_manifest()["configs"]]

    def paths(self, config_id: str) -> ConfigPaths:
        return ConfigPaths(self.folder / check_config_id(config_id))

    def write_config(self, config_id: str, config: dict[str, Any]) -> ConfigPaths:
        p = self.paths(config_id)
        atomic_write_json(p.config, config)
        return p

    def read_config(self, config_id: str) -> dict[str, Any]:
        p = self.paths(config_id)
        try:
            return read_json(p.config)
        except (OSError, ValueError) as e:
            raise InputError(f"{p.config}: cannot read configuration ({e})") from None


def check_config_id(config_id: str) -> str:
    """Refuse ids that could escape the sweep folder or break shell quoting."""
    if not _ID_RE.match(config_id):
        raise InputError(f"configuration id {config_id!r} must match {_ID_RE.pattern}")
    return config_id


def latest_sweep(root: str | os.PathLike[str] | None = None) -> SweepDir:
    """The sweep under ``root`` whose manifest was created last."""
    base = sweeps_root(root)
    best: tuple[str, SweepDir] | None = None
    if base.is_dir():
        for child in base.iterdir():
            sweep = SweepDir(child)
            if not sweep.exists():
                continue
            try:
                manifest = json.loads(sweep.manifest_path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(manifest, dict):
                continue  # no sweep's manifest: a JSON list or number (read_manifest names it if asked for)
            created = str(manifest.get("created_at", ""))
            key = f"{created}|{child.name}"
            if best is None or key > best[0]:
                best = (key, sweep)
    if best is None:
        raise InputError(f"no sweep found under {base} (set --root or ${SWEEPS_ENV}, or run `bufreuse sweep`)")
    return best[1]
