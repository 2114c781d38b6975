"""Site options of a SLURM submission, validated before anything reaches a script.

Every value here ends up in an sbatch script: in an ``#SBATCH`` line (parsed by sbatch, never by a
shell, but a newline there would start a new script line) or in the script body (run by bash).
So names (partition, account, qos) must be plain SLURM names, the time limit must be a SLURM time,
free-form values (extra ``#SBATCH`` arguments, paths, environment values) may not contain newlines
or control characters, and the templates shell-quote every value they print (see
:mod:`bufreuse.launch.render`). A value that breaks a rule raises :class:`InputError` naming the
option the user set.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bufreuse.errors import InputError

__all__ = ["SlurmSite", "check_single_line", "check_slurm_name", "load_site"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")
_TIME_RE = re.compile(r"^(\d+-\d{1,2}(:\d{2}(:\d{2})?)?|\d+(:\d{2}(:\d{2})?)?|UNLIMITED|INFINITE)$")
_EXTRA_RE = re.compile(r"^--?[A-Za-z][A-Za-z0-9-]*(=.*)?$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def check_single_line(option: str, value: str) -> str:
    """Refuse newlines, carriage returns, NUL and other control characters in ``value``."""
    if not isinstance(value, str):
        raise InputError(f"{option} must be a string, got {type(value).__name__}")
    if _CONTROL_RE.search(value):
        raise InputError(f"{option} {value!r} contains a newline or control character")
    return value


def check_slurm_name(option: str, value: str, *, allow_list: bool = False) -> str:
    """A partition/account/qos name: letters, digits, ``_ . + -`` (comma-separated if ``allow_list``)."""
    check_single_line(option, value)
    parts = value.split(",") if allow_list else [value]
    for part in parts:
        if not _NAME_RE.match(part):
            raise InputError(
                f"{option} {value!r} is not a SLURM name (letters, digits, '_', '.', '+', '-'"
                f"{', comma-separated' if allow_list else ''})"
            )
    return value


@dataclass(kw_only=True, slots=True)
class SlurmSite:
    """Where and how jobs run on one cluster; every field maps to a ``bufreuse sweep --slurm-*`` option."""

    partition: str | None = None
    """``#SBATCH --partition`` (comma-separated list allowed); None: the cluster's default."""
    account: str | None = None
    """``#SBATCH --account``; None: the user's default account."""
    qos: str | None = None
    """``#SBATCH --qos``; None: the default QOS."""
    time: str | None = None
    """``#SBATCH --time`` in SLURM syntax (``MM``, ``HH:MM:SS``, ``D-HH:MM``); None: partition default."""
    nodes: int = 1
    """Nodes per job (one job per configuration)."""
    gpus_per_node: int = 0
    """GPUs per node; one rank per GPU. 0 requests no GPU (``cpu-smoke``)."""
    cpus_per_task: int | None = None
    """``#SBATCH --cpus-per-task``; None: the cluster's default."""
    exclusive: bool = False
    """``#SBATCH --exclusive``: no other job shares the nodes (recommended for memory figures)."""
    container_image: str | None = None
    """Run the ranks in this container through pyxis (``srun --container-image``)."""
    container_mounts: str | None = None
    """``srun --container-mounts`` (pyxis syntax); the sweep folder must be visible inside."""
    venv: str | None = None
    """A virtualenv folder to activate (``source VENV/bin/activate``) before running."""
    python: str | None = None
    """Interpreter the job runs; None: this one (on shared storage), or ``python`` from the venv/container."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Further ``#SBATCH`` arguments, each ``--name`` or ``--name=value`` (e.g. ``--constraint=h200``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables exported in the script before the run (values are shell-quoted)."""
    master_port: int = 29500
    """Rendezvous port for multi-node torchrun."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> SlurmSite:
        """Check every field; raises :class:`InputError` naming the first bad option."""
        if self.partition is not None:
            check_slurm_name("--slurm-partition", self.partition, allow_list=True)
        if self.account is not None:
            check_slurm_name("--slurm-account", self.account)
        if self.qos is not None:
            check_slurm_name("--slurm-qos", self.qos)
        if self.time is not None and not _TIME_RE.match(check_single_line("--slurm-time", self.time)):
            raise InputError(f"--slurm-time {self.time!r} is not a SLURM time (MM, HH:MM:SS, D-HH[:MM[:SS]])")
        for name, lo, hi in (("nodes", 1, 100_000), ("gpus_per_node", 0, 64), ("master_port", 1024, 65535)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise InputError(f"--slurm-{name.replace('_', '-')} must be an integer in [{lo}, {hi}], got {value!r}")
        if self.cpus_per_task is not None and (
            isinstance(self.cpus_per_task, bool) or not isinstance(self.cpus_per_task, int) or self.cpus_per_task < 1
        ):
            raise InputError(f"--slurm-cpus-per-task must be a positive integer, got {self.cpus_per_task!r}")
        for name in ("container_image", "container_mounts", "venv", "python"):
            value = getattr(self, name)
            if value is not None:
                check_single_line(f"--slurm-{name.replace('_', '-')}", value)
                if not value:
                    raise InputError(f"--slurm-{name.replace('_', '-')} must not be empty")
        if not isinstance(self.extra_sbatch, list):
            raise InputError(f"--slurm-extra must be a list of arguments, got {self.extra_sbatch!r}")
        if not isinstance(self.env, dict) or not all(isinstance(v, str) for v in self.env.values()):
            raise InputError(f"--slurm-env must map names to string values, got {self.env!r}")
        if not isinstance(self.exclusive, bool):
            raise InputError(f"--slurm-exclusive must be true or false, got {self.exclusive!r}")
        for arg in self.extra_sbatch:
            check_single_line("--slurm-extra", arg)
            if not _EXTRA_RE.match(arg):
                raise InputError(f"--slurm-extra {arg!r} must look like --name or --name=value")
        for key, value in self.env.items():
            if not _ENV_KEY_RE.match(key):
                raise InputError(f"--slurm-env name {key!r} is not a shell variable name")
            check_single_line(f"--slurm-env {key}", value)
        return self

    @property
    def interpreter(self) -> str:
        """The Python the job runs (see :attr:`python`)."""
        if self.python:
            return self.python
        return "python" if self.container_image or self.venv else sys.executable

    @property
    def ranks_per_node(self) -> int:
        """Processes per node: one per GPU, or one when no GPU is requested."""
        return max(1, self.gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (recorded in ``job.json`` so a resume can tell what was submitted)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def load_site(path: str | os.PathLike[str] | None = None, **overrides: Any) -> SlurmSite:
    """A :class:`SlurmSite` from a YAML/JSON file of its fields (``--slurm-site``), then ``overrides``.

    Overrides that are None are ignored, so CLI flags left unset keep the file's values.
    """
    values: dict[str, Any] = {}
    if path is not None:
        import yaml

        try:
            text = Path(path).read_text(encoding="utf-8")
            _check_yaml_aliases(text, str(path))
            data = yaml.safe_load(text)
        except UnicodeDecodeError:
            raise InputError(f"--slurm-site {path}: not UTF-8 text; a YAML/JSON file expected") from None
        except OSError as e:
            raise InputError(f"--slurm-site {path}: cannot read ({e.strerror or e})") from None
        except yaml.YAMLError as e:
            raise InputError(f"--slurm-site {path}: not YAML/JSON ({e})") from None
        if not isinstance(data, dict):
            raise InputError(f"--slurm-site {path}: expected a mapping of site options")
        values.update(data)
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(SlurmSite)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise InputError(f"unknown SLURM site option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return SlurmSite(**values)
    except TypeError as e:
        raise InputError(f"SLURM site options: {e}") from None


def _check_yaml_aliases(text: str, where: str) -> None:
    """Count YAML aliases before building anything: a 'billion laughs' file is refused, not expanded."""
    import yaml

    from bufreuse import limits

    budget = limits.current().max_yaml_aliases
    aliases = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > budget:
                limits.check("max_yaml_aliases", aliases, what=f"--slurm-site {where}: YAML aliases (at least)")
