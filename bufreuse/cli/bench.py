"""`bufreuse bench ...`: microbenchmarks that print figures (not timed tests).

``bench`` is a Typer sub-app; other modules add their own (``bench proxy``) with
``bench_app.command(...)`` before ``register`` runs, or by importing ``bench_app``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from bufreuse.cli._common import console, handle_errors, json_option, progress_bar
from bufreuse.cli._validate import check_output_file, dim
from bufreuse.errors import InputError

__all__ = ["bench_app", "register"]

bench_app = typer.Typer(
    name="bench",
    help="Microbenchmarks that print figures (pool: CPU cost per acquire+release pair; layer: a real MoE layer, "
    "control vs hooks).",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    """Add the ``bench`` sub-app to ``app``."""
    app.add_typer(bench_app, name="bench")


@bench_app.command("pool")
@handle_errors
def pool(
    device: Annotated[str | None, typer.Option(help="cuda, cuda:N or cpu (default: CUDA when available).")] = None,
    tokens: Annotated[
        int | None,
        typer.Option(
            "--rows", min=1, callback=dim, help="Buffer rows (default 32768 on CUDA, 1024 on CPU; was --tokens)."
        ),
    ] = None,
    hidden: Annotated[
        int | None, typer.Option(min=1, callback=dim, help="Buffer columns (default 4096 on CUDA, 1024 on CPU).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="Element type (torch dtype name).")] = "bfloat16",
    slots: Annotated[int, typer.Option("--ring-slots", min=1, help="Slots of each ring (was --slots).")] = 4,
    iters: Annotated[int, typer.Option(min=1, max=10_000_000, help="Pairs per timed loop.")] = 20000,
    repeats: Annotated[
        int, typer.Option(min=1, max=1000, help="Interleaved rounds per variant (median reported).")
    ] = 5,
    probe_external_events: Annotated[
        bool,
        typer.Option(
            "--probe-external-events",
            help="Also probe eager<->CUDA-graph event waits (plain vs external=True), each in a subprocess.",
        ),
    ] = False,
    json_out: Annotated[bool, json_option()] = False,
    output: Annotated[Path | None, typer.Option(help="Also write the JSON result to this file (atomically).")] = None,
    mkdir: Annotated[bool, typer.Option("--mkdir", help="Create the --output file's missing folders.")] = False,
) -> None:
    """CPU cost of acquire+release (ring, pool policies) vs torch.empty + record_stream + free, same shape."""
    check_output_file(output, suffixes=(".json",), mkdir=mkdir, option="--output")
    _check_memory(device=device, tokens=tokens, hidden=hidden, dtype=dtype, slots=slots)
    from bufreuse.bench.pool_bench import PoolBenchConfig, run_pool_bench
    from bufreuse.bench.pool_bench import probe_external_events as probe

    cfg = PoolBenchConfig(
        device=device, tokens=tokens, hidden=hidden, dtype=dtype, slots=slots, iters=iters, repeats=repeats
    )
    if probe_external_events and (device or "cuda").startswith("cpu"):
        raise InputError("--probe-external-events needs a CUDA device")
    try:
        with progress_bar("timing pairs") as tick:
            result = run_pool_bench(cfg, progress=tick)
    except ValueError as e:
        raise InputError(str(e)) from None
    if probe_external_events:
        if result["cpu_tensors"]:
            raise InputError("--probe-external-events needs a CUDA device")
        with progress_bar("probing events") as tick:
            result["external_events"] = probe(progress=tick)
    if output is not None:
        from bufreuse.analysis.render.export import json_ready
        from bufreuse.fsutil import atomic_write_json

        atomic_write_json(output, json_ready(result))
    if json_out:
        from bufreuse.analysis.render.export import json_text

        typer.echo(json_text(result, indent=2))
    else:
        _render(result)


@bench_app.command("layer")
@handle_errors
def layer(
    preset: Annotated[
        str | None,
        typer.Option(help="Layer shape: tiny, host-bound or gpu-bound (default: tiny on CPU, host-bound on CUDA)."),
    ] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size (overrides the preset).")] = None,
    ffn: Annotated[int | None, typer.Option(help="Expert FFN size (overrides the preset).")] = None,
    experts: Annotated[int | None, typer.Option(help="Experts (overrides the preset).")] = None,
    topk: Annotated[int | None, typer.Option(help="Experts per token (overrides the preset).")] = None,
    tokens: Annotated[int | None, typer.Option(help="Tokens per microbatch (overrides the preset).")] = None,
    microbatches: Annotated[
        int, typer.Option("--num-microbatches", help="Microbatches per schedule (was --microbatches).")
    ] = 4,
    steps: Annotated[int, typer.Option(help="Timed schedules per round (after one untimed).")] = 16,
    rounds: Annotated[
        int, typer.Option(help="Measured rounds per arm, even (A B B A cycles); >= 6 for a verdict.")
    ] = 6,
    warmup: Annotated[
        int, typer.Option("--warmup-rounds", help="Warm-up rounds per arm, dropped (was --warmup).")
    ] = 1,
    spec: Annotated[str, typer.Option(help="local (SequentialMLP) or te (TEGroupedMLP, needs TE and CUDA).")] = "local",
    precision: Annotated[str, typer.Option(help="bf16 or fp8 (TE: hybrid format, delayed scaling).")] = "bf16",
    schedule: Annotated[
        str, typer.Option(help="sequential (F0 B0 F1 B1 ...) or interleaved (F0 F1 B0 F2 B1 ... B3).")
    ] = "interleaved",
    policies: Annotated[
        str,
        typer.Option(
            help="Comma list of arms against the control: ring, stream-ordered, record-stream (the expert ring "
            "exercised at EP = 1), as-installed (install()'s production rule: no ring at EP x ETP = 1)."
        ),
    ] = "ring",
    slots: Annotated[
        int, typer.Option("--ring-slots", help="Slots of the dispatch and expert rings (was --slots).")
    ] = 3,
    pad: Annotated[
        bool,
        typer.Option(
            "--pad",
            help="Pad-to-capacity routing on CUDA too: no per-call host wait for token counts, so host µs is "
            "Python and launches alone (the hooks' cost).",
        ),
    ] = False,
    band_pct: Annotated[float, typer.Option(help="Parity band of the verdicts, percent.")] = 1.0,
    device: Annotated[str | None, typer.Option(help="cuda, cuda:N or cpu (default: CUDA when available).")] = None,
    dispatch_ring: Annotated[
        bool,
        typer.Option(
            "--dispatch-ring",
            help="Also exercise the dispatch buffer at EP = 1 (every policy arm), as where it is used (EP > 1): its "
            "hooks join the figures (at EP = 1 its all-to-all is one copy the control does not make).",
        ),
    ] = False,
    gc_mode: Annotated[
        str,
        typer.Option(
            "--gc",
            help="auto (Python's collector runs when it will) or manual (collected before each round, off during "
            "it: Megatron-LM's --manual-gc, as large MoE recipes run).",
        ),
    ] = "auto",
    json_out: Annotated[bool, json_option()] = False,
    output: Annotated[Path | None, typer.Option(help="Also write the JSON result to this file (atomically).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write the per-round ratios as a PNG to this file.")] = None,
    mkdir: Annotated[bool, typer.Option("--mkdir", help="Create the --output / --plot files' folders.")] = False,
) -> None:
    """A real megatron-core MoELayer: control vs each policy's hooks, per layer call host µs (forward and
    backward), wall ms and GPU ms, rounds in A B B A order, ratios with 95% intervals and verdicts, and the
    control's drift. Needs megatron-core (pip install 'bufreuse\\[megatron]')."""
    check_output_file(output, suffixes=(".json",), mkdir=mkdir, option="--output")
    check_output_file(plot, suffixes=(".png",), mkdir=mkdir, option="--plot")
    from bufreuse.bench.layer_bench import layer_config, run_layer_bench

    cfg = layer_config(
        preset,
        device=device,
        shape={"hidden": hidden, "ffn": ffn, "experts": experts, "topk": topk, "tokens": tokens},
        microbatches=microbatches,
        steps=steps,
        rounds=rounds,
        warmup=warmup,
        spec=spec,
        precision=precision,
        schedule=schedule,
        policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
        slots=slots,
        pad=pad,
        band_pct=band_pct,
        dispatch_ring=dispatch_ring,
        gc=gc_mode,
    )
    with progress_bar("bench layer rounds") as tick:
        result = run_layer_bench(cfg, progress=tick)
    if output is not None:
        from bufreuse.analysis.render.export import json_ready
        from bufreuse.fsutil import atomic_write_json

        atomic_write_json(output, json_ready(result))
    if plot is not None:
        from bufreuse.analysis.render.plots import layer_bench_figure
        from bufreuse.cli._common import write_figure

        write_figure(plot, layer_bench_figure(result))
    if json_out:
        from bufreuse.analysis.render.export import json_text

        typer.echo(json_text(result, indent=2))
    else:
        from bufreuse.analysis.render.bench_tables import layer_bench_renderable

        console.print(layer_bench_renderable(result))
        for path in (output, plot):
            if path is not None:
                console.print(f"wrote {path}")


_ELEMENT_BYTES = {"float64": 8, "double": 8, "int64": 8, "float32": 4, "float": 4, "int32": 4}


def _check_memory(*, device: str | None, tokens: int | None, hidden: int | None, dtype: str, slots: int) -> None:
    """Refuse, before anything is allocated, a benchmark whose buffers exceed the budget or (CPU) the RAM.

    It holds two rings of ``slots`` buffers plus a few transient ones of the same shape.
    """
    from bufreuse import limits

    limits.check("max_ring_slots", slots, what="--ring-slots")
    cpu = (device or "").startswith("cpu")
    rows, cols = tokens or (1024 if cpu else 32768), hidden or (1024 if cpu else 4096)
    need = (2 * slots + 4) * rows * cols * _ELEMENT_BYTES.get(dtype, 2)
    what = "bench pool buffers, bytes ((2 x --ring-slots + 4) x --rows x --hidden)"
    limits.check("max_buffer_bytes", need, what=what)
    if cpu:
        import os

        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > ram // 2:
            raise InputError(
                f"bench pool on CPU would hold {need / 2**30:,.1f} GiB, more than half of this machine's "
                f"{ram / 2**30:,.1f} GiB; lower --ring-slots, --rows or --hidden"
            )


def _render(result: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    env = result["env"]
    where = env["gpu"] or f"CPU ({env['cpu']})"
    title = f"acquire+release pair, {tuple(result['shape'])} {result['dtype']}, {where}, torch {env['torch']}"
    table = Table(title=title, title_justify="left")
    table.add_column("variant")
    table.add_column("µs / pair", justify="right")
    table.add_column("vs baseline", justify="right")
    table.add_column("min–max µs", justify="right")
    for row in result["rows"]:
        table.add_row(
            escape(row["name"]),
            f"{row['us_per_pair']:.2f}",
            f"{row['ratio']:.2f}",
            f"{row['min_us']:.2f}–{row['max_us']:.2f}",
        )
    console.print(table)
    if result["note"]:
        console.print(f"[yellow]note:[/] {result['note']}")
    verdict = "[green]meets[/]" if result["meets_target"] else "[red]misses[/]"
    console.print(
        f"{escape(result['pool_ratio_row'])} / baseline = {result['pool_ratio']:.2f} "
        f"(BufferRing.acquire + release / baseline = {result['ring_ratio']:.2f}); "
        f"{verdict} the target ≤ {result['target_ratio']}"
    )
    for name, probe in (result.get("external_events") or {}).items():
        console.print(f"  {escape(name)}: {probe['status']} — {escape(probe['detail'])}", soft_wrap=True)
