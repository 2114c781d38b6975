"""`bufreuse plan FILE`: the minimum safe slots of each ring for a Megatron config, before the run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from bufreuse.cli._common import console, handle_errors, json_option, torch_version_option, unknown_flags_text
from bufreuse.errors import CheckFailedError, InputError

__all__ = ["planned_minimum", "register"]


def _fields(file: Path | str) -> dict[str, Any]:
    from bufreuse.config import load_megatron_file
    from bufreuse.integrations.check_file import megatron_fields

    return megatron_fields(load_megatron_file(file))


def planned_minimum(file: Path | str) -> int:
    """The largest planned minimum over the ring buffers of ``file`` (what ``sweep --slots plan`` means)."""
    from bufreuse.plan import plan_config
    from bufreuse.plan.report import batch_microbatches

    fields = _fields(file)
    m = batch_microbatches(
        fields.get("num_microbatches"), global_batch=fields.get("global_batch_size"),
        micro_batch=fields.get("micro_batch_size"), data_parallel=fields.get("data_parallel_size"),
    )  # fmt: skip
    if m is None:  # plan_config's own message names plan's options, which sweep does not take
        raise InputError(
            f"{file}: the number of microbatches is unknown; set num_microbatches, or global_batch_size, "
            "micro_batch_size and data_parallel_size, in the file"
        )
    report = plan_config(fields, assume_enabled=True)
    refused = [b for b in report.buffers if b.minimum is None]
    if refused:
        raise InputError(f"{file}: {refused[0].buffer} cannot be a ring ({refused[0].rule.reason})")
    return max((b.minimum or 0 for b in report.buffers), default=1)


@handle_errors
def plan(
    file: Annotated[Path, typer.Argument(help="A Megatron YAML config or a file of command-line arguments.")],
    json_out: Annotated[bool, json_option("the plan")] = False,
    assume_enabled: Annotated[
        bool, typer.Option("--assume-enabled", help="Plan both buffers as if switched on (for a baseline config).")
    ] = False,
    seq_length: Annotated[int | None, typer.Option(min=1, help="Tokens per sequence (sizes the slots).")] = None,
    micro_batch_size: Annotated[int | None, typer.Option(min=1, help="Micro-batch size (sizes the slots).")] = None,
    num_microbatches: Annotated[int | None, typer.Option(min=1, help="Microbatches per iteration.")] = None,
    global_batch_size: Annotated[
        int | None, typer.Option(min=1, help="Global batch (microbatches = global / (micro x data-parallel)).")
    ] = None,
    data_parallel_size: Annotated[int | None, typer.Option(min=1, help="Data-parallel size.")] = None,
    pp_rank: Annotated[int, typer.Option(min=0, help="Pipeline rank to plan (0 has the deepest rings).")] = 0,
    moe_layers_per_chunk: Annotated[
        int | None, typer.Option(min=0, help="MoE layers per model chunk (default: from num_layers, moe_layer_freq).")
    ] = None,
    lag_steps: Annotated[
        int, typer.Option(min=1, help="Control model: schedule steps the GPU trails the host by.")
    ] = 2,
    torch_version: Annotated[str | None, torch_version_option()] = None,
) -> None:
    """Plan every ring: minimum slots, memory, the control's pending-free; exit 1 if a ring is too small."""
    from bufreuse.config import torch_assumption
    from bufreuse.plan import plan_config

    judged = torch_assumption(torch_version)
    fields = _fields(file)
    if unknown := unknown_flags_text(file):  # Megatron would not start this run: nothing to plan
        raise InputError(f"{unknown}; fix or remove them to plan this run")
    if pp_rank >= int(fields.get("pipeline_model_parallel_size") or 1):
        raise InputError(
            f"--pp-rank {pp_rank}: the config has {fields.get('pipeline_model_parallel_size') or 1} stage(s)"
        )
    report = plan_config(
        fields,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        global_batch_size=global_batch_size,
        data_parallel_size=data_parallel_size,
        pp_rank=pp_rank,
        layers_per_chunk=moe_layers_per_chunk,
        lag_steps=lag_steps,
        assume_enabled=assume_enabled,
        torch_version=judged,
    )
    if not report.buffers:
        raise InputError(
            f"{file}: no ring buffer is enabled (set moe_hybridep_reuse_dispatch_output_buffers or a nonzero "
            "moe_hybridep_num_expert_output_buffers with policy ring, or pass --assume-enabled)"
        )
    data = report.to_dict()
    if json_out:
        from bufreuse.analysis.render.export import json_text

        typer.echo(json_text(data))
    else:
        _render(file, data)
    bad = [b for b in data["buffers"] if not b["ok"]]
    if bad:
        parts = [
            f"{b['buffer']}: refused ({b['release']['reason']})"
            if b["minimum"] is None
            else f"{b['buffer']}: {b['configured']} slot(s) < minimum {b['minimum']}"
            for b in bad
        ]
        raise CheckFailedError(f"{file}: " + "; ".join(parts))


def _render(file: Path, data: dict) -> None:
    from rich.table import Table

    s = data["schedule"]
    console.print(
        f"[bold]{file}[/]: schedule [cyan]{s['kind']}[/] p={s['pp']} rank={s['rank']} m={s['microbatches']} "
        f"v={s['vpp']} group={s['microbatch_group']} warm-up={s['warmup_forwards']}; MoE layers per chunk "
        f"{data['moe_layers_per_chunk']}; {data['tokens_per_microbatch'] or '?'} tokens/microbatch"
    )
    table = Table(pad_edge=False)
    for col in ("ring", "release", "slots", "minimum", "grows with", "ring memory", "control pending", ""):
        table.add_column(col, overflow="fold")
    for b in data["buffers"]:
        if b["minimum"] is None:
            table.add_row(b["ring"], "refused", str(b["configured"]), "-", "-", "-", "-", "[red]✗[/]")
            continue
        per_chunk = f" (chunks {', '.join(map(str, b['per_chunk'].values()))})" if len(b["per_chunk"]) > 1 else ""
        sized = bool(b["slot_bytes"])
        pending = f"{b['control_pending_count']} = {_mib(b['control_pending_bytes'])}" if sized else ""
        pending = pending or str(b["control_pending_count"])
        if b.get("unused"):  # the model's queue (every buffer record_stream'ed) beside the rule's verdict
            pending += " modelled; rule: none waits (stands down)"
        table.add_row(
            b["ring"],
            b["release"]["point"],
            str(b["configured"]),
            f"{b['minimum']}{per_chunk}",
            "constant" if b["constant"] else (b["formula"] or "simulated"),
            "not used" if b.get("unused") else (_mib(b["persistent_bytes"]) if sized else "?"),
            pending,
            "[green]✓[/]" if b["ok"] else "[red]✗[/]",
        )
    console.print(table)
    for b in data["buffers"]:
        console.print(f"[bold]{b['ring']}[/]: release after {b['release']['point']}: {b['release']['reason']}")
        if b.get("unused"):
            console.print(f"  [yellow]stands down[/] (install() hooks nothing): {escape(b['unused'])}")
        if b["cycle"] is not None:
            console.print(f"  [red]stuck at {b['configured']} slot(s):[/] {b['cycle']['text']}")
        elif not b["ok"] and b["minimum"] is not None:
            console.print(
                f"  [red]too small at {b['configured']} slot(s):[/] the pool raises EarlyReuseError on the host "
                "(no GPU-side cycle: a ring that waited on the GPU would stall, not hang)"
            )
    if data.get("ring_storage"):
        console.print(escape(data["ring_storage"]))
    if not any(b["slot_bytes"] for b in data["buffers"]):
        console.print("[dim]memory columns need the tokens per microbatch (--seq-length, --micro-batch-size)[/]")
    console.print(
        "[dim]ring memory = minimum x slot bytes (one ring per buffer, shared by the rank's model chunks); "
        "control pending = modelled: the bound-sized buffers the record-stream control holds pending-free at its "
        "max-active point if the GPU trails the host by --lag-steps steps, an upper bound where it trails by less "
        "(docs/benchmarks.md); snapshot-report on a control snapshot measures it[/]"
    )
    console.print("[dim]assumptions: " + "; ".join(data["assumptions"]) + "[/]")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def register(app: typer.Typer) -> None:
    """Add ``plan`` to ``app``."""
    app.command("plan")(plan)
