"""``bufreuse-megatron`` / ``python -m bufreuse.integrations.entry``: Megatron-LM pretraining with the knobs.

Upstream rejects unknown arguments, so this wrapper runs the user's Megatron-LM ``pretrain_gpt.py``
(not shipped in megatron-core's wheel; located with ``--megatron-lm PATH`` or ``MEGATRON_LM_PATH``)
with Megatron-LM's training entry points wrapped for this process only. Two upstream contracts,
chosen by feature (``pretrain``'s signature), never by version:

- classic ``pretrain(..., model_provider, ..., extra_args_provider=...)``: our five arguments are
  chained onto the script's ``extra_args_provider`` and the ``model_provider`` result is hooked;
- config container (``pretrain(cfg_container, ...)``, Megatron-LM core_r0.19 and later, whose
  ``pretrain_gpt.py`` parses with ``parse_and_validate_args(extra_args_provider=...)`` first):
  ``megatron.training.arguments.parse_args`` chains our arguments and
  ``megatron.training.training.setup_model_and_optimizer`` hooks the model chunks it returns.

A megatron-core installed from its wheel ships the dataset helpers prebuilt (``helpers_cpp``) but not
the ``Makefile`` that Megatron-LM's start-up ``make -C megatron/core/datasets`` needs (it exits the
run when make fails); in exactly that case the wrapper skips the rebuild and says so.

Either way the model is validated (:func:`bufreuse.integrations.requirements.validate` against its
``TransformerConfig``,
seq length and micro-batch size from the args) and hooked (:func:`bufreuse.integrations.megatron.install`,
one shared :class:`BufferPool`); everything is restored when the script returns. A config that cannot
be enabled stops the run before training with one error listing every unmet requirement (exit 2).
HybridEP set-ups that would crash in DeepEP stop earlier, with one line (:mod:`bufreuse.integrations.preflight`);
under ``--distributed-backend gloo`` the DDP grad sync goes through :mod:`bufreuse.integrations.gloo_grad_sync`.
"""

from __future__ import annotations

import functools
import inspect
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from bufreuse.config import BufReuseConfig, add_arguments, tokens_per_microbatch
from bufreuse.errors import BufreuseError, ConfigError, InputError, exit_code_for
from bufreuse.integrations.preflight import flag_value, hybridep_preflight
from bufreuse.integrations.requirements import validate

__all__ = ["Session", "help_text", "locate_script", "main"]

USAGE = (
    "usage: bufreuse-megatron [--megatron-lm PATH] [--pretrain-script NAME] <Megatron-LM pretrain arguments> "
    "[--moe-hybridep-reuse-dispatch-output-buffers] [--moe-hybridep-num-dispatch-output-buffers N] "
    "[--moe-hybridep-num-expert-output-buffers N] [--moe-bufreuse-dispatch-policy P] "
    "[--moe-bufreuse-expert-policy P]"
)


def locate_script(checkout: str | None, script: str = "pretrain_gpt.py") -> Path:
    """The pretraining script inside the Megatron-LM checkout; :class:`InputError` naming the fix if absent."""
    root = checkout or os.environ.get("MEGATRON_LM_PATH")
    if not root:
        raise InputError(
            f"no Megatron-LM checkout given: pass --megatron-lm PATH or set MEGATRON_LM_PATH (the directory "
            f"holding {script}; megatron-core's wheel does not ship it)"
        )
    path = Path(root).expanduser() / script
    if not path.is_file():
        raise InputError(f"{path} not found: --megatron-lm / MEGATRON_LM_PATH must point at a Megatron-LM checkout")
    return path


class Session:
    """What the wrapped ``pretrain`` installed; ``close()`` removes it."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.installations: list[Any] = []

    def chain_args(self, theirs: Any) -> Any:
        """An ``extra_args_provider`` that runs the script's own provider, then adds our knobs."""

        def provider(parser: Any) -> Any:
            return add_arguments(theirs(parser) if theirs is not None else parser)

        return provider

    def wrap_model_provider(self, model_provider: Any) -> Any:
        @functools.wraps(model_provider)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            model = model_provider(*args, **kwargs)
            self.install(model)
            return model

        return wrapped

    def wrap_setup(self, setup: Any) -> Any:
        """``setup_model_and_optimizer`` that hooks the model chunks it returns (config-container contract)."""

        @functools.wraps(setup)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = setup(*args, **kwargs)
            self.install(result[0])
            return result

        return wrapped

    def install(self, model: Any) -> None:
        """Validate the knobs against ``model``'s config and hook its MoE layers."""
        from megatron.training import get_args

        args = get_args()
        knobs = BufReuseConfig.from_args(args)
        if not knobs.enabled():
            print("bufreuse-megatron: knobs off, no hooks installed", flush=True)
            return
        cfg = _transformer_config(model)
        validate(cfg, knobs, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
        from bufreuse.integrations.megatron import install
        from bufreuse.pool import BufferPool

        if self.pool is None:
            self.pool = BufferPool()
        tokens = tokens_per_microbatch(cfg, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
        microbatches, pp_rank = _schedule(args)
        inst = install(model, self.pool, knobs, tokens=tokens, num_microbatches=microbatches, pp_rank=pp_rank)
        self.installations.append(inst)
        rings = ", ".join(f"{k}={v}" for k, v in self.pool.ring_bytes().items()) or "none"
        line = f"bufreuse-megatron: hooked {inst.layers} MoE layer(s); persistent bytes {rings}"
        if inst.unused:
            line += "; not used: " + ", ".join(f"{k} ({why})" for k, why in inst.unused.items())
        if inst.auto_start:
            source = f"planned for {microbatches} microbatch(es), PP rank {pp_rank}" if microbatches else "no plan"
            starts = ", ".join(f"{k}={v}" for k, v in inst.auto_start.items())
            cap = knobs.moe_bufreuse_auto_max_mib or "none"
            line += f"; num_slots='auto' starts at {starts} ({source}), cap {cap} MiB"
        print(line, flush=True)

    def close(self) -> None:
        while self.installations:
            self.installations.pop().uninstall()


def _schedule(args: Any) -> tuple[int | None, int]:
    """Microbatches per step and this rank's pipeline stage, for the planner's ``auto`` depth.

    Megatron's microbatch calculator when it is set up (it is before the model is built), else
    ``global_batch_size // (micro_batch_size x data_parallel_size)``; None when neither is known.
    """
    microbatches = None
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        microbatches = int(get_num_microbatches())
    except (ImportError, AttributeError, AssertionError, TypeError):
        sizes = [getattr(args, k, None) for k in ("global_batch_size", "micro_batch_size", "data_parallel_size")]
        if all(isinstance(v, int) and v > 0 for v in sizes):
            microbatches = sizes[0] // (sizes[1] * sizes[2]) or None
    rank = 0
    try:
        from megatron.core import parallel_state

        rank = int(parallel_state.get_pipeline_model_parallel_rank())
    except (ImportError, AttributeError, AssertionError, RuntimeError, TypeError):
        pass  # model parallelism not initialised: a single stage
    return microbatches, rank


def _transformer_config(model: Any) -> Any:
    chunks = model if isinstance(model, list | tuple) else [model]
    cfg = getattr(chunks[0], "config", None) if chunks else None
    if cfg is not None and hasattr(cfg, "num_moe_experts"):
        return cfg
    for chunk in chunks:
        for m in chunk.modules():
            if getattr(m, "config", None) is not None and hasattr(m.config, "num_moe_experts"):
                return m.config
    raise ConfigError("bufreuse: the model has no TransformerConfig (model.config) to validate against")


def _wrap_pretrain(orig: Any, session: Session) -> Any:
    sig = inspect.signature(orig)
    if "extra_args_provider" not in sig.parameters:
        raise ConfigError(
            "this Megatron-LM's pretrain() takes no extra_args_provider; bufreuse-megatron needs one to register "
            "its arguments (use a Megatron-LM whose pretrain_gpt.py passes extra_args_provider)"
        )

    @functools.wraps(orig)
    def pretrain(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind_partial(*args, **kwargs)
        bound.arguments["extra_args_provider"] = session.chain_args(bound.arguments.get("extra_args_provider"))
        if bound.arguments.get("model_provider") is not None:
            bound.arguments["model_provider"] = session.wrap_model_provider(bound.arguments["model_provider"])
        return orig(*bound.args, **bound.kwargs)

    return pretrain


def _chain_parse_args(orig: Any, session: Session) -> Any:
    @functools.wraps(orig)
    def parse_args(extra_args_provider: Any = None, *args: Any, **kwargs: Any) -> Any:
        return orig(session.chain_args(extra_args_provider), *args, **kwargs)

    return parse_args


def _patch_container_contract(session: Session) -> list[Any]:
    """Patch the config-container entry points; returns the undo callables."""
    import megatron.training.arguments as ma
    import megatron.training.training as mtt

    undo = []
    for mod, name, make in ((ma, "parse_args", _chain_parse_args), (mtt, "setup_model_and_optimizer", None)):
        orig = getattr(mod, name, None)
        if orig is None:
            raise ConfigError(f"this Megatron-LM has no megatron.training.{mod.__name__.rsplit('.', 1)[1]}.{name}")
        setattr(mod, name, make(orig, session) if make is not None else session.wrap_setup(orig))
        undo.append(lambda mod=mod, name=name, orig=orig: setattr(mod, name, orig))
    return undo


def _prebuilt_helpers_patch() -> list[Any]:
    """Skip ``compile_helpers`` when megatron-core has no Makefile but its helpers import (wheel install)."""
    try:
        import megatron.core.datasets.utils as du
    except ImportError:
        return []
    orig = getattr(du, "compile_helpers", None)
    if orig is None or (Path(du.__file__).parent / "Makefile").is_file():
        return []
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401  (the prebuilt extension)
    except ImportError:
        return []  # neither a Makefile nor a built helper: let upstream report its own error

    @functools.wraps(orig)
    def compile_helpers() -> None:
        print(
            "bufreuse-megatron: megatron-core ships its dataset helpers prebuilt (helpers_cpp) and no Makefile "
            "(wheel install); skipping Megatron-LM's make step",
            flush=True,
        )

    du.compile_helpers = compile_helpers
    return [lambda: setattr(du, "compile_helpers", orig)]


def _gloo_grad_sync_patch(argv: list[str]) -> list[Any]:
    """Under ``--distributed-backend gloo``: megatron's DDP bucket collectives one by one (docs/megatron.md)."""
    if flag_value(argv, "--distributed-backend") != "gloo":
        return []
    from bufreuse.integrations.gloo_grad_sync import patch_megatron_grad_sync

    undo = patch_megatron_grad_sync()
    print(
        "bufreuse-megatron: --distributed-backend gloo: megatron's DDP grad sync issues each bucket's collective on "
        "its own (gloo has no allreduce_coalesced for CUDA tensors); gloo stages through the host, so step times "
        "are not NCCL's",
        flush=True,
    )
    return [undo]


def _split_own(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    own: dict[str, str] = {}
    rest: list[str] = []
    it = iter(argv)
    for tok in it:
        name, eq, val = tok.partition("=")
        if name in ("--megatron-lm", "--pretrain-script"):
            value = val if eq else next(it, None)
            if value is None:
                raise InputError(f"{name} needs a value")
            own[name] = value
        else:
            rest.append(tok)
    return own, rest


def run(argv: list[str]) -> None:
    """Run the Megatron-LM pretraining script with the hooks (raises :class:`BufreuseError` on bad input)."""
    own, rest = _split_own(argv)
    for note in hybridep_preflight(rest, os.environ):  # may set USE_MNNVL=0 before DeepEP reads it
        print(f"bufreuse-megatron: {note}", flush=True)
    script = locate_script(own.get("--megatron-lm"), own.get("--pretrain-script", "pretrain_gpt.py"))
    sys.path.insert(0, str(script.parent))
    import megatron.training as mt

    session = Session()
    orig = mt.pretrain
    params = inspect.signature(orig).parameters
    undo: list[Any] = []
    if "extra_args_provider" in params or "cfg_container" not in params:
        mt.pretrain = _wrap_pretrain(orig, session)  # classic contract (refuses a pretrain without the hook)
        undo.append(lambda: setattr(mt, "pretrain", orig))
    else:
        undo += _patch_container_contract(session)
    undo += _prebuilt_helpers_patch()
    undo += _gloo_grad_sync_patch(rest)
    old_argv = sys.argv
    sys.argv = [str(script), *rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = old_argv
        while undo:
            undo.pop()()
        session.close()


def help_text() -> str:
    """``--help``: what the wrapper does, its own options and the knobs it adds (from ``config.add_arguments``)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="bufreuse-megatron",
        usage=USAGE.removeprefix("usage: "),
        description="Run Megatron-LM's pretraining script with bufreuse's buffer rings: every argument that is not "
        "one of the options below goes to the script unchanged; the model is validated and hooked before "
        "training, and restored when the script returns. A configuration the rings cannot serve stops before "
        "training with one error naming every unmet requirement (exit 2).",
        epilog='Example: MEGATRON_LM_PATH=~/Megatron-LM bufreuse-megatron "${PRETRAIN_ARGS[@]}" '
        "--moe-hybridep-reuse-dispatch-output-buffers --moe-hybridep-num-dispatch-output-buffers 2. "
        "Which slot counts your schedule needs: bufreuse plan ARGS_FILE; whether the rings pay: bufreuse advise "
        "SNAPSHOT. Details: docs/megatron.md.",
        add_help=False,
    )
    own = parser.add_argument_group("wrapper")
    own.add_argument("--megatron-lm", metavar="PATH", help="Megatron-LM checkout holding the script (or "
                     "$MEGATRON_LM_PATH); megatron-core's wheel does not ship it.")  # fmt: skip
    own.add_argument("--pretrain-script", metavar="NAME", help="The script in that checkout (default "
                     "pretrain_gpt.py).")  # fmt: skip
    own.add_argument("-h", "--help", action="store_true", help="Show this message and exit.")
    add_arguments(parser)
    return parser.format_help()


def main(argv: list[str] | None = None) -> int:
    """Console-script entry; prints one error line and returns its exit code on bad input."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]) and not any(a.startswith("--megatron-lm") for a in argv):
        print(help_text(), end="")
        return 0
    try:
        run(argv)
    except BufreuseError as e:
        print(f"bufreuse-megatron: error: {' '.join(str(e).split())}", file=sys.stderr)
        return exit_code_for(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
