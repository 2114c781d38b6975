"""`bufreuse check-config FILE`: can buffer reuse be enabled with this Megatron config, and what it holds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bufreuse.cli._common import console, handle_errors, print_error, torch_version_option, unknown_flags_text
from bufreuse.cli._validate import dim

__all__ = ["register"]


@handle_errors
def check_config(
    file: Annotated[Path, typer.Argument(help="A Megatron YAML config or a file of command-line arguments.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the checklist.")] = False,
    assume_enabled: Annotated[
        bool, typer.Option("--assume-enabled", help="Check both buffers as if switched on (for a baseline config).")
    ] = False,
    seq_length: Annotated[
        int | None,
        typer.Option(
            min=1, callback=dim, help="Tokens per sequence for sizing the slots; overrides the file's seq_length."
        ),
    ] = None,
    micro_batch_size: Annotated[
        int | None,
        typer.Option(
            min=1, callback=dim, help="Micro-batch size for sizing the slots; overrides the file's micro_batch_size."
        ),
    ] = None,
    torch_version: Annotated[str | None, torch_version_option()] = None,
) -> None:
    """Check every requirement of the enabled buffers; exit 1 if the feature cannot be enabled, 2 on bad input."""
    from bufreuse.config import torch_assumption
    from bufreuse.integrations.check_file import check_file

    judged = torch_assumption(torch_version)
    warning = unknown_flags_text(file)
    report = check_file(
        file,
        assume_enabled=assume_enabled,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        torch_version=judged,
    )
    if warning:  # after the file passed: bad input ends in its one error line, not a warning and an error
        print_error(warning, label="warning")
    data = report.to_dict()
    if not data["enabled"]:
        data["ok"] = False
        data["error"] = "no buffer is enabled (set moe_hybridep_reuse_dispatch_output_buffers or a nonzero " + (
            "moe_hybridep_num_expert_output_buffers, or pass --assume-enabled)"
        )
    if json_out:
        from bufreuse.analysis.render.export import json_text

        typer.echo(json_text(data))
    else:
        _render(file, data)
    if not data["ok"]:
        raise typer.Exit(1)


def _render(file: Path, data: dict) -> None:
    from rich.markup import escape as e
    from rich.table import Table

    console.print(
        f"[bold]{e(str(file))}[/]: dispatch path [cyan]{e(str(data['path'] or 'unsupported'))}[/], "
        f"buffers {e(str(data['enabled']))}"
    )
    if "error" in data:
        console.print(f"[red]✗[/] {e(data['error'])}")
        return
    table = Table(show_lines=False, pad_edge=False)
    for col in ("", "buffer/policy", "requirement", "why it is needed / what to change"):
        table.add_column(col, overflow="fold")
    for r in data["requirements"]:
        where = e(f"{r['buffer']}/{r['policy']}")
        if r["ok"]:
            table.add_row("[green]✓[/]", where, e(r["text"]), "")
            continue
        note = f" [dim]({e(r['note'])})[/]" if r["note"] else ""
        table.add_row("[red]✗[/]", where, e(r["text"]), f"{e(r['why'])}{note}; [bold]{e(r['fix'])}[/]")
    console.print(table)
    for buf, ring in data["rings"].items():
        console.print(
            f"{buf}: {ring['slots']} slot(s) x {ring['rows']} rows x {ring['hidden']} x {ring['element_size']} B = "
            f"[bold]{_mib(ring['persistent_bytes'])}[/] persistent ({_mib(ring['slot_bytes'])} per slot; "
            f"bound: {e(str(ring['bound_source']))})"
        )
    stood = "; ".join(f"{b}: {why}" for b, why in data.get("stood_down", {}).items())
    if not data["ok"]:
        verdict = f"[red]cannot be enabled[/] ({sum(not r['ok'] for r in data['requirements'])} unmet)"
    elif data.get("all_stand_down"):
        verdict = f"[yellow]enabled, but every ring stands down[/]: {e(stood)}"
    else:
        verdict = "[green]can be enabled[/]" + (f"; [yellow]stands down[/]: {e(stood)}" if stood else "")
    console.print(f"total persistent ring memory {_mib(data['persistent_bytes_total'])}; {verdict}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def register(app: typer.Typer) -> None:
    """Add ``check-config`` to ``app``."""
    app.command("check-config")(check_config)
