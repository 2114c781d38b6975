"""`bufreuse advise SNAPSHOT [--config C | --args FILE]`: should the rings be turned on, and with which flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bufreuse.cli._common import console, handle_errors, json_option, torch_version_option

__all__ = ["register"]


@handle_errors
def advise(
    snapshot: Annotated[Path, typer.Argument(help="A control allocator snapshot (record_stream run), ideally traced.")],
    config: Annotated[Path | None, typer.Option("--config", help="The run's Megatron YAML config.")] = None,
    args: Annotated[Path | None, typer.Option("--args", help="The run's Megatron command-line arguments file.")] = None,
    num_microbatches: Annotated[
        int | None, typer.Option(min=1, help="Microbatches per iteration, for the planner (else from the file).")
    ] = None,
    global_batch_size: Annotated[
        int | None,
        typer.Option(min=1, help="Global batch, for the planner: microbatches = global / (micro x data-parallel)."),
    ] = None,
    micro_batch_size: Annotated[
        int | None, typer.Option(min=1, help="Micro-batch size, for the planner (else from the file).")
    ] = None,
    data_parallel_size: Annotated[
        int | None,
        typer.Option(min=1, help="Data-parallel size, for the planner (torchrun's world size is not in the file)."),
    ] = None,
    json_out: Annotated[bool, json_option("the advice")] = False,
    torch_version: Annotated[str | None, torch_version_option()] = None,
) -> None:
    """One screen: MoE pending-free sites, required slot depth, predicted memory, unmet checks, flags to add."""
    from bufreuse.analysis.advise import advise as run
    from bufreuse.config import torch_assumption
    from bufreuse.errors import InputError

    judged = torch_assumption(torch_version)
    if config is not None and args is not None:
        raise InputError("pass --config or --args, not both")
    file = config or args
    fields = check = None
    if file is not None:
        from bufreuse.config import load_megatron_file
        from bufreuse.integrations.check_file import check_file, megatron_fields

        fields = megatron_fields(load_megatron_file(file))
        check = check_file(file, assume_enabled=True, torch_version=judged).to_dict()
    overrides = {
        "global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size,
        "data_parallel_size": data_parallel_size,
    }  # fmt: skip
    given = {k: v for k, v in overrides.items() if v is not None}
    if given and fields is None:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise InputError(f"{flags}: the planner uses this with a Megatron config; pass --args FILE or --config FILE")
    if given:
        fields = {**fields, **given}
    result = run(snapshot, fields=fields, check=check, num_microbatches=num_microbatches, torch_version=judged)
    if json_out:
        from bufreuse.analysis.render.export import json_text
        typer.echo(json_text(result.to_json()))
    else:
        from bufreuse.analysis.render.advise import advice_renderable

        console.print(advice_renderable(result))


def register(app: typer.Typer) -> None:
    """Add ``advise`` to ``app``."""
    app.command("advise")(advise)
