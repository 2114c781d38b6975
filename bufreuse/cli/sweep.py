"""`bufreuse sweep`: run control / ring / stream-ordered configurations of the MoE proxy and compare them."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.markup import escape

from bufreuse.cli._common import console, err_console, handle_errors, json_option, root_option, write_figures
from bufreuse.cli._validate import check_sweeps_root, dim, finite, text_file, text_file_or
from bufreuse.errors import CheckFailedError, InputError, JobFailedError
from bufreuse.launch.sweep import DEFAULT_PARAMS as _D
from bufreuse.sweepdir import SWEEPS_ENV

__all__ = ["register"]

_SHAPE_HELP = "Hidden size of the proxy MoE layer (the proxy: docs/facts.md)."
_TEMPLATES = ("proxy", "megatron")  # bufreuse.launch.render.BUILTIN_TEMPLATES (not imported: jinja2 is slow)


def register(app: typer.Typer) -> None:
    """Add ``sweep`` to ``app``."""

    @app.command("sweep")
    @handle_errors
    def sweep(
        slots: Annotated[
            str,
            typer.Option(help="Ring slots per buffer, comma-separated; 0 is the control; plan, plan+N: the planner's."),
        ] = "0,4,10",
        plan_config: Annotated[
            str | None, typer.Option(help="Megatron config whose planned minimum 'plan' means (default: the proxy's).")
        ] = None,
        modes: Annotated[
            str, typer.Option(help="Extra modes to add: stream-ordered and/or control (comma-separated).")
        ] = "",
        buffers: Annotated[
            str, typer.Option(help="Buffers that take the ring / stream-ordered policy: dispatch, expert.")
        ] = "dispatch,expert",
        comm_ms: Annotated[
            float | None,
            typer.Option(
                help=f"Emulated communication per dispatch and combine, ms (one GPU; default {_D['comm_ms']}).",
                callback=finite(lo=0, hi=60_000),
            ),
        ] = None,
        cuda_graph: Annotated[bool, typer.Option("--cuda-graph", help="Capture the step and time replays.")] = False,
        name: Annotated[str | None, typer.Option(help="Sweep name (default: a hash of the parameters).")] = None,
        root: Annotated[str | None, root_option()] = None,
        mkdir: Annotated[
            bool, typer.Option("--mkdir", help="Create the sweeps root's missing parent folders.")
        ] = False,
        force: Annotated[bool, typer.Option("--force", help="Rerun configurations that already finished.")] = False,
        timeout: Annotated[
            float,
            typer.Option(
                help="Seconds per configuration before it is killed (timeout).",
                callback=finite(lo=0, lo_open=True, hi=30 * 86400),
            ),
        ] = 600.0,
        json_out: Annotated[bool, json_option("the result rows")] = False,
        launcher: Annotated[
            str, typer.Option(help="Where configurations run: local (this machine) or slurm.")
        ] = "local",
        world_size: Annotated[
            int | None, typer.Option(help="Processes per configuration (default: every visible GPU).")
        ] = None,
        dist_backend: Annotated[
            str | None,
            typer.Option(
                help="Process group at --world-size > 1: nccl (default; a GPU per process) or gloo (processes may "
                "share one GPU; all-to-all staged through host memory, so not NCCL's times)."
            ),
        ] = None,
        hidden: Annotated[int | None, _shape(_SHAPE_HELP, "hidden")] = None,
        ffn: Annotated[int | None, _shape("Expert FFN size.", "ffn")] = None,
        tokens: Annotated[int | None, _shape("Tokens per microbatch (the capacity).", "tokens")] = None,
        local_experts: Annotated[int | None, _shape("Experts per GPU.", "local_experts")] = None,
        topk: Annotated[int | None, _shape("Copies per token.", "topk")] = None,
        dtype: Annotated[
            str | None, typer.Option(help=f"bf16, fp16 or fp32 (default {_D['dtype']}).", rich_help_panel="Shape")
        ] = None,
        microbatches: Annotated[
            int | None, _shape("Microbatches per step (was --microbatches).", "microbatches", name="--num-microbatches")
        ] = None,
        steps: Annotated[int | None, _shape("Timed steps (>= 20 advised).", "steps")] = None,
        warmup_steps: Annotated[int | None, _shape("Untimed warm-up steps.", "warmup_steps", lo=0)] = None,
        record_steps: Annotated[
            int | None, _shape("Steps recorded into snapshot.pickle.gz (0: none).", "record_steps", lo=0)
        ] = None,
        seed: Annotated[
            int | None, typer.Option(help=f"Data seed (default {_D['seed']}).", rich_help_panel="Shape")
        ] = None,
        # --- SLURM launcher options (bufreuse/cli/_slurm.py, docs/slurm.md) ---
        workload: Annotated[
            str | None, typer.Option(help="proxy (default), cpu-smoke (CPU-only launcher check) or megatron (SLURM).")
        ] = None,
        status_dir: Annotated[
            str | None, typer.Option("--status", help="Show the state of the sweep in DIR (SLURM: job ids, reasons).")
        ] = None,
        cancel_dir: Annotated[
            str | None, typer.Option("--cancel", help="Cancel what is queued or running in the sweep in DIR.")
        ] = None,
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="SLURM: write and print the sbatch scripts, submit nothing.")
        ] = False,
        no_wait: Annotated[
            bool, typer.Option("--no-wait", help="SLURM: return after submitting (check with --status DIR).")
        ] = False,
        template: Annotated[
            str | None,
            typer.Option(
                help="SLURM: sbatch template, proxy | megatron | FILE.j2.",
                rich_help_panel="SLURM",
                callback=text_file_or(_TEMPLATES),
            ),
        ] = None,
        slurm_site: Annotated[
            str | None,
            typer.Option(
                help="YAML/JSON of site options; flags override.", rich_help_panel="SLURM", callback=text_file
            ),
        ] = None,
        slurm_partition: Annotated[
            str | None, typer.Option(help="#SBATCH --partition.", rich_help_panel="SLURM")
        ] = None,
        slurm_account: Annotated[str | None, typer.Option(help="#SBATCH --account.", rich_help_panel="SLURM")] = None,
        slurm_qos: Annotated[str | None, typer.Option(help="#SBATCH --qos.", rich_help_panel="SLURM")] = None,
        slurm_time: Annotated[
            str | None, typer.Option(help="#SBATCH --time (HH:MM:SS, D-HH:MM).", rich_help_panel="SLURM")
        ] = None,
        slurm_nodes: Annotated[int | None, typer.Option(help="Nodes per job.", rich_help_panel="SLURM")] = None,
        slurm_gpus_per_node: Annotated[
            int | None, typer.Option(help="GPUs per node (one rank each).", rich_help_panel="SLURM")
        ] = None,
        slurm_cpus_per_task: Annotated[
            int | None, typer.Option(help="#SBATCH --cpus-per-task.", rich_help_panel="SLURM")
        ] = None,
        slurm_exclusive: Annotated[
            bool, typer.Option("--slurm-exclusive", help="#SBATCH --exclusive.", rich_help_panel="SLURM")
        ] = False,
        slurm_container_image: Annotated[
            str | None, typer.Option(help="srun --container-image (pyxis).", rich_help_panel="SLURM")
        ] = None,
        slurm_container_mounts: Annotated[
            str | None, typer.Option(help="srun --container-mounts (pyxis).", rich_help_panel="SLURM")
        ] = None,
        slurm_venv: Annotated[
            str | None, typer.Option(help="Virtualenv to activate in the job.", rich_help_panel="SLURM")
        ] = None,
        slurm_python: Annotated[
            str | None, typer.Option(help="Interpreter the job runs (default: this one).", rich_help_panel="SLURM")
        ] = None,
        slurm_extra: Annotated[
            list[str] | None, typer.Option(help="Extra #SBATCH argument (repeatable).", rich_help_panel="SLURM")
        ] = None,
        slurm_env: Annotated[
            list[str] | None, typer.Option(help="NAME=VALUE exported in the job (repeatable).", rich_help_panel="SLURM")
        ] = None,
        slurm_poll: Annotated[
            float,
            typer.Option(
                help="Longest seconds between status polls.",
                rich_help_panel="SLURM",
                callback=finite(lo=0, lo_open=True, hi=3600),
            ),
        ] = 10.0,
        megatron_args: Annotated[
            str | None,
            typer.Option(help="Your Megatron-LM pretrain arguments (megatron workload).", rich_help_panel="SLURM"),
        ] = None,
    ) -> None:
        """Run a slot sweep (one fresh process per configuration), print the table, write PNG plots.

        Re-running the same command skips finished configurations (--force reruns them).
        """
        slurm_given = {
            "--slurm-site": slurm_site, "--slurm-partition": slurm_partition, "--slurm-account": slurm_account,
            "--slurm-qos": slurm_qos, "--slurm-time": slurm_time, "--slurm-nodes": slurm_nodes,
            "--slurm-gpus-per-node": slurm_gpus_per_node, "--slurm-cpus-per-task": slurm_cpus_per_task,
            "--slurm-exclusive": slurm_exclusive or None, "--slurm-container-image": slurm_container_image,
            "--slurm-container-mounts": slurm_container_mounts, "--slurm-venv": slurm_venv,
            "--slurm-python": slurm_python, "--slurm-extra": slurm_extra, "--slurm-env": slurm_env,
            "--no-wait": no_wait or None, "--dry-run": dry_run or None, "--template": template,
        }  # fmt: skip
        _check_conflicts(
            status_dir=status_dir, cancel_dir=cancel_dir, launcher=launcher, workload=workload,
            megatron_args=megatron_args, slurm_given=[k for k, v in slurm_given.items() if v is not None],
        )  # fmt: skip
        if status_dir or cancel_dir:  # --status / --cancel DIR: nothing is run
            from bufreuse.cli import _slurm

            if cancel_dir:
                _slurm.cancel_sweep(cancel_dir, json_out=json_out)
            else:
                _slurm.show_status(status_dir, json_out=json_out)
            return
        from bufreuse.analysis.render.sweep_tables import sweep_table
        from bufreuse.analysis.runs.sweep_rows import checksum_mismatches, load_sweep_rows
        from bufreuse.launch.sweep import SweepSpec, parse_slot_list, parse_str_list, run_sweep

        given = {
            "hidden": hidden, "ffn": ffn, "tokens": tokens, "local_experts": local_experts, "topk": topk,
            "dtype": dtype, "microbatches": microbatches, "steps": steps, "warmup_steps": warmup_steps,
            "record_steps": record_steps, "seed": seed, "comm_ms": comm_ms, "workload": workload,
            "dist_backend": dist_backend,
        }  # fmt: skip
        if workload == "cpu-smoke":  # the CPU-only check workload needs no GPU
            given["device"] = "cpu"
        plan_minimum = None
        if plan_config is not None:
            from bufreuse.cli.plan import planned_minimum

            plan_minimum = lambda: planned_minimum(plan_config)  # noqa: E731
        spec = SweepSpec(
            slots=parse_slot_list(
                slots,
                params={k: v for k, v in given.items() if v is not None},
                buffers=parse_str_list(buffers),
                plan_minimum=plan_minimum,
            ),
            modes=parse_str_list(modes),
            buffers=parse_str_list(buffers),
            cuda_graph=cuda_graph,
            params={k: v for k, v in given.items() if v is not None},
            world_size=world_size,
            timeout_s=timeout,
            name=name,
            root=root,
            force=force,
        )
        spec.validate()  # bad options: one error line before any progress bar is drawn
        check_sweeps_root(root, mkdir=mkdir)
        if root is None:  # the variable stands for --root and is checked like it
            check_sweeps_root(os.environ.get(SWEEPS_ENV) or None, option=SWEEPS_ENV, mkdir=mkdir)
        # Launcher-specific options (the SLURM launcher adds its own here).
        launcher_options: dict[str, Any] = {}
        runner: Any = launcher
        if launcher == "slurm":  # build the SLURM launcher from the --slurm-* options
            from bufreuse.cli import _slurm

            runner = _slurm.build_slurm_launcher(
                site_file=slurm_site, partition=slurm_partition, account=slurm_account, qos=slurm_qos,
                time_limit=slurm_time, nodes=slurm_nodes, gpus_per_node=slurm_gpus_per_node,
                cpus_per_task=slurm_cpus_per_task, exclusive=slurm_exclusive,
                container_image=slurm_container_image, container_mounts=slurm_container_mounts, venv=slurm_venv,
                python=slurm_python, extra=slurm_extra, env=slurm_env, template=template,
                megatron_args=megatron_args, dry_run=dry_run,
            )  # fmt: skip
        result = _run_with_progress(run_sweep, spec, runner, launcher_options)
        if launcher == "slurm":
            if dry_run:
                _slurm.print_dry_run(runner)
                return
            if no_wait:
                err_console.print(f"submitted; follow with: bufreuse sweep --status {result.folder}")
            else:
                _slurm.watch_jobs(runner, result.folder, poll_s=slurm_poll)

        rows = load_sweep_rows(result.folder, result.config_ids)
        plots = []
        # cpu-smoke and failed runs measure no memory: write no plot rather than an empty one
        if any(r.status == "ok" and r.max_reserved_bytes is not None for r in rows):
            from bufreuse.analysis.render.plots import sweep_figures

            plots = write_figures(result.folder, sweep_figures(rows))
        mismatched = checksum_mismatches(rows)
        if json_out:
            from bufreuse.analysis.render.export import json_text

            payload = {
                "folder": result.folder,
                "launcher": result.launcher,
                "ran": result.ran,
                "skipped": result.skipped,
                "rows": [r.to_dict() for r in rows],
                "plots": [str(p) for p in plots],
                "checksums_match": not mismatched,
            }
            console.print_json(json_text(payload))
        else:
            console.print(sweep_table(rows, title=f"sweep {escape(str(result.folder))}"))
            for p in plots:
                console.print(f"plot: {escape(str(p))}")
        if mismatched:
            groups = "; ".join(f"{k}: {', '.join(v)}" for k, v in mismatched.items())
            raise CheckFailedError(f"results differ between configurations (checksum: ids): {groups}")
        bad = [r.config_id + f" ({r.status})" for r in rows if r.status not in ("ok", "pending", "queued", "running")]
        if bad:
            raise JobFailedError(
                f"{len(bad)} configuration(s) did not finish ok: {', '.join(bad)}; see log.txt in each folder"
            )


_LAUNCHERS = ("local", "slurm")


def _check_conflicts(
    *,
    status_dir: str | None,
    cancel_dir: str | None,
    launcher: str,
    workload: str | None,
    megatron_args: str | None,
    slurm_given: list[str],
) -> None:
    """Refuse options that cannot go together, before anything is read, run or written.

    Raises:
        InputError: ``--status`` with ``--cancel``; SLURM-only options with another launcher;
            ``--megatron-args`` with a workload other than ``megatron``.
    """
    if status_dir and cancel_dir:
        raise InputError("--status and --cancel: give one (--status shows a sweep, --cancel stops it)")
    if launcher not in _LAUNCHERS:
        return  # the launcher registry names the choices (plugins included)
    if launcher != "slurm" and slurm_given:
        raise InputError(f"{', '.join(slurm_given)}: apply to --launcher slurm only (this sweep runs {launcher})")
    if megatron_args is not None and (workload or "proxy") != "megatron":
        raise InputError(f"--megatron-args applies to --workload megatron only (this sweep runs {workload or 'proxy'})")


def _shape(help_text: str, key: str, *, lo: int = 1, name: str | None = None) -> Any:
    """A shape option: its default in the help, bounded below by ``lo`` and above by ``--limit max-dim``."""
    return typer.Option(
        *([name] if name else []),
        help=f"{help_text.rstrip('.')}; default {_D[key]}.", rich_help_panel="Shape", min=lo, callback=dim,
    )


def _run_with_progress(run_sweep: Any, spec: Any, launcher: str, options: dict[str, Any]) -> Any:
    """Call ``run_sweep`` with a rich progress bar on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console, transient=False, disable=not err_console.is_terminal,
    ) as bar:  # fmt: skip
        task = bar.add_task("sweep", total=None)

        def progress(ev: Any) -> None:
            text = f"{ev.config_id}: {ev.state}" + (f" — {ev.message[:80]}" if ev.message and ev.state != "ok" else "")
            bar.update(task, total=ev.total, completed=ev.done, description=escape(text))

        return run_sweep(spec, launcher=launcher, launcher_options=options, progress=progress)
