"""What ``bufreuse sweep`` needs for ``--launcher slurm``, ``--status DIR`` and ``--cancel DIR``.

Kept apart from ``cli/sweep.py`` so that command stays one library call plus rendering: this
module builds the SLURM launcher from the ``--slurm-*`` options, prints ``--dry-run`` scripts,
shows the live job table (rich, on stderr) while jobs run, and answers ``--status`` and
``--cancel`` for a sweep folder with whatever launcher its manifest names.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.live import Live
from rich.markup import escape
from rich.table import Table

from bufreuse.cli._common import console, err_console
from bufreuse.errors import InputError
from bufreuse.sweepdir import SweepDir

if TYPE_CHECKING:
    from bufreuse.launch.slurm import JobRow, SlurmLauncher

__all__ = ["build_slurm_launcher", "cancel_sweep", "job_table", "print_dry_run", "show_status", "watch_jobs"]

_STYLE = {"ok": "green", "failed": "red", "timeout": "red", "hung": "red", "cancelled": "yellow",
          "running": "cyan", "queued": "blue", "pending": "dim"}  # fmt: skip


def build_slurm_launcher(
    *,
    site_file: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    time_limit: str | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    cpus_per_task: int | None = None,
    exclusive: bool | None = None,
    container_image: str | None = None,
    container_mounts: str | None = None,
    venv: str | None = None,
    python: str | None = None,
    extra: list[str] | None = None,
    env: list[str] | None = None,
    template: str | None = None,
    megatron_args: str | None = None,
    dry_run: bool = False,
) -> SlurmLauncher:
    """The SLURM launcher for these options (flags override ``--slurm-site FILE``)."""
    from bufreuse.launch.site import load_site
    from bufreuse.launch.slurm import SlurmLauncher

    env_map: dict[str, str] | None = None
    if env:
        env_map = {}
        for item in env:
            key, sep, value = item.partition("=")
            if not sep:
                raise InputError(f"--slurm-env {item!r}: expected NAME=VALUE")
            env_map[key] = value
    site = load_site(
        site_file, partition=partition, account=account, qos=qos, time=time_limit, nodes=nodes,
        gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task, exclusive=exclusive or None,
        container_image=container_image, container_mounts=container_mounts, venv=venv, python=python,
        extra_sbatch=list(extra) if extra else None, env=env_map,
    )  # fmt: skip
    try:
        margs = shlex.split(megatron_args) if megatron_args else []
    except ValueError as e:
        raise InputError(f"--megatron-args: {e}") from None
    return SlurmLauncher(site=site, template=template, megatron_args=margs, dry_run=dry_run)


def print_dry_run(launcher: SlurmLauncher) -> None:
    """Print each script the dry run wrote (path, then its text) on stdout."""
    if not launcher.rendered:
        err_console.print("dry run: nothing to submit (every configuration has finished)")
    for cid, path in launcher.rendered.items():
        console.rule(escape(f"{cid}: {path}"))
        console.out(path.read_text(), highlight=False, end="")  # raw: no wrapping, no markup


def job_table(rows: list[JobRow], *, title: str) -> Table:
    """One row per configuration: job id, state, SLURM state and reason, nodes, elapsed."""
    table = Table(title=title, title_justify="left")
    for col in ("config", "job", "state", "SLURM state", "reason", "nodes", "elapsed"):
        table.add_column(col, overflow="fold")
    for r in rows:
        style = _STYLE.get(r.state, "")
        state = escape(r.state)
        table.add_row(
            escape(r.config_id), escape(r.job_id or "-"), f"[{style}]{state}[/]" if style else state,
            escape(r.slurm_state or "-"), escape((r.reason or "-")[:80]), escape(r.nodes or "-"),
            escape(r.elapsed or "-"),
        )  # fmt: skip
    return table


def watch_jobs(
    launcher: SlurmLauncher, folder: str | Path, *, poll_s: float = 10.0, timeout_s: float | None = None
) -> dict[str, str]:
    """Track the sweep's jobs in a live table on stderr until none is queued or running."""
    sweep = SweepDir(folder)
    title = escape(f"SLURM jobs of {sweep.folder}")
    started = time.monotonic()
    with Live(job_table([], title=title), console=err_console, refresh_per_second=2, transient=False) as live:

        def update(rows: list[JobRow]) -> None:
            live.update(job_table(rows, title=f"{title} ({time.monotonic() - started:.0f} s)"))

        states = launcher.wait(sweep, poll_s=poll_s, timeout_s=timeout_s, on_update=update)
    for warning in dict.fromkeys(launcher.warnings):
        err_console.print(f"[yellow]warning:[/] {escape(str(warning))}")
    return states


def _launcher_for(sweep: SweepDir) -> Any:
    from bufreuse.launch.base import get_launcher

    return get_launcher(str(sweep.read_manifest().get("launcher", "local")))


def show_status(folder: str | Path, *, json_out: bool = False) -> dict[str, str]:
    """Print the state of every configuration of the sweep in ``folder`` (SLURM: with job ids)."""
    sweep = SweepDir(folder)
    launcher = _launcher_for(sweep)
    rows = launcher.poll(sweep) if hasattr(launcher, "poll") else None
    states = {r.config_id: r.state for r in rows} if rows is not None else launcher.status(sweep)
    if json_out:
        from bufreuse.analysis.render.export import json_text

        payload: dict[str, Any] = {"folder": str(sweep.folder), "launcher": launcher.name, "states": states}
        if rows is not None:
            payload["jobs"] = [asdict(r) for r in rows]
        console.print_json(json_text(payload))
    elif rows is not None:
        console.print(job_table(rows, title=escape(f"sweep {sweep.folder} (SLURM)")))
    else:
        table = Table(title=escape(f"sweep {sweep.folder} ({launcher.name})"), title_justify="left")
        table.add_column("config")
        table.add_column("state")
        for cid, state in states.items():
            table.add_row(escape(cid), f"[{_STYLE.get(state, '')}]{state}[/]" if state in _STYLE else escape(state))
        console.print(table)
    for warning in dict.fromkeys(getattr(launcher, "warnings", [])):
        err_console.print(f"[yellow]warning:[/] {escape(str(warning))}")
    return states


def cancel_sweep(folder: str | Path, *, json_out: bool = False) -> list[str]:
    """Cancel what is in flight in the sweep in ``folder``; print what was cancelled."""
    sweep = SweepDir(folder)
    launcher = _launcher_for(sweep)
    cancelled = launcher.cancel(sweep)
    if json_out:
        from bufreuse.analysis.render.export import json_text

        console.print_json(json_text({"folder": str(sweep.folder), "cancelled": cancelled}))
    elif cancelled:
        console.print(escape(f"cancelled {len(cancelled)} configuration(s): {', '.join(cancelled)}"))
    else:
        console.print(escape(f"nothing in flight in {sweep.folder}"))
    return cancelled
