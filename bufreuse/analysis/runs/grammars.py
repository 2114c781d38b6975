"""Every line grammar the log parser knows, in one table: name, example, pattern, what it yields, era.

Megatron-family logs print a handful of line shapes, with variations by era and fork. The
parser (:mod:`.megatron_log`) only dispatches; each shape is a :class:`LineGrammar` here, and
each field of an iteration line a :class:`FieldGrammar`. The tests parse every ``example``.

Lines are cleaned first (:func:`clean_text`): ANSI colour codes and carriage returns go. Line
prefixes are never parsed: every pattern is searched, not anchored, so timestamps,
``[rank-3/8][INFO ] [--------trainer.py:2471] :``, ``[default3]:`` and srun ``host: `` prefixes
pass through.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "FIELDS",
    "GRAMMARS",
    "MEMORY_FIELDS",
    "FieldGrammar",
    "LineGrammar",
    "UnknownLines",
    "clean_text",
    "describe_unknown",
    "grammar",
    "strip_ansi",
]

NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


@dataclass(frozen=True, slots=True)
class LineGrammar:
    """One line shape: how to find it, what it gives, which tools and eras print it."""

    name: str
    era: str
    example: str
    pattern: re.Pattern[str]
    yields: str


@dataclass(frozen=True, slots=True)
class FieldGrammar:
    """One ``label: value |`` field of an iteration line and the record attribute it fills."""

    label: str
    attr: str
    scale: float
    era: str
    unit: str = ""
    """Memory fields only: ``"GiB"`` (a ``GB``/``GiB``/``G`` suffix allowed, first of a ``/`` list read) or
    ``"B"`` (a byte count: a bare number, exponent allowed, no unit)."""


_MEM_TAIL = (
    rf"memory \(MB\)\s*\|\s*allocated:\s*({NUM})\s*\|\s*max allocated:\s*({NUM})"
    rf"\s*\|\s*(?:reserved|cached):\s*({NUM})\s*\|\s*max (?:reserved|cached):\s*({NUM})"
    rf"(?:\s*\|\s*total device memory used:\s*({NUM}))?"
)

GRAMMARS: tuple[LineGrammar, ...] = (
    LineGrammar(
        name="iteration",
        era="Megatron-LM 2019-2026 (ms or s), Megatron-DeepSpeed / BigScience, forks, NeMo / Megatron-Bridge",
        example=(
            " iteration       12/      30 | consumed samples:         1536 | elapsed time per iteration (ms):"
            " 6123.4 | throughput per GPU (TFLOP/s/GPU): 1124.9 | lm loss: 2.345678E+00 |"
            " number of skipped iterations:   0 | number of nan iterations:   0 |"
        ),
        pattern=re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|"),
        yields="iteration, train_iters, the '|'-terminated fields of FIELDS (a field cut before its '|' is not read)",
    ),
    LineGrammar(
        name="nemo-iteration",
        era="NeMo 2 / Lightning progress printer (0-based iterations; the last field has no closing '|')",
        example=(
            "Training epoch 0, iteration 1/99 | lr: 1.961e-07 | global_batch_size: 4 | global_step: 1 |"
            " reduced_train_loss: 15.07 | train_step_timing in s: 2.008 | consumed_samples: 8"
        ),
        pattern=re.compile(r"Training epoch \d+, (iteration\s+\d+\s*/\s*\d+\s*\|)"),
        yields="as 'iteration' (group 1 is that match); the last field is read when the line is complete",
    ),
    LineGrammar(
        name="bridge-step-time",
        era="Megatron-Bridge, printed before the iteration line of its window",
        example="Step Time : 2.34s GPU utilization: 452.1MODEL_TFLOP/s/GPU",
        pattern=re.compile(rf"Step Time\s*:\s*({NUM})s\s+GPU utilization:\s*({NUM})\s*MODEL_TFLOP/s/GPU"),
        yields="step time (s) and model TFLOP/s per GPU for the next iteration line that prints none itself",
    ),
    LineGrammar(
        name="slurm-cancelled",
        era="SLURM (slurmstepd), when a job or step is cancelled or hits its time limit",
        example=(
            "slurmstepd: error: *** JOB 2796012 ON node-0001 CANCELLED AT 2025-01-02T03:04:05 DUE TO TIME LIMIT ***"
        ),
        pattern=re.compile(r"\*\*\* (?:JOB|STEP) (\S+) ON (\S+) CANCELLED AT (\S+)([^*]*)\*\*\*"),
        yields="a warning: the run was cancelled (its last windows may be cut)",
    ),
    LineGrammar(
        name="memory-rank",
        era="Megatron-LM 2021-2026 ('[Rank N]'; 'cached' before torch 1.4 renamed it 'reserved')",
        example=(
            "[Rank 0] (after 2 iterations) memory (MB) | allocated: 152545.00 | max allocated: 152600.00 |"
            " reserved: 170000.00 | max reserved: 175294.00 | total device memory used: 187430.00"
        ),
        pattern=re.compile(r"\[Rank (\d+)\]\s*([^\[\]|]*?)\s*" + _MEM_TAIL),
        yields="rank, label, allocated / max allocated / reserved / max reserved (MiB), device used (MiB) if printed",
    ),
    LineGrammar(
        name="memory-norank",
        era="Megatron-LM 2020 (printed by rank 0, no '[Rank N]')",
        example=(
            "after 10 iterations memory (MB) | allocated: 8123.5 | max allocated: 12001.25 | reserved: 15000.0 |"
            " max reserved: 16384.0"
        ),
        pattern=re.compile(r"(?<![\w\]])(after (\d+) iterations)\s*" + _MEM_TAIL),
        yields="the same figures as memory-rank, rank unknown (None)",
    ),
    LineGrammar(
        name="argument",
        era="Megatron-LM, Megatron-DeepSpeed: the '---- arguments ----' block at start-up",
        example="  pipeline_model_parallel_size .................... 4",
        pattern=re.compile(r"(?:^|[\s:\]])([a-z_][a-z0-9_]*) \.{3,} (.*?)\s*$"),
        yields="args[name] = printed value (raw string)",
    ),
    LineGrammar(
        name="world-size",
        era="Megatron-LM 2020-2026 start-up line (the only parallel layout 2020 logs print besides arguments)",
        example=(
            "using world size: 64, data-parallel size: 8, tensor-model-parallel size: 4,"
            " pipeline-model-parallel size: 2"
        ),
        pattern=re.compile(r"using world size:\s*(\d+)"),
        yields="world_size, data_parallel_size, tensor_model_parallel_size, pipeline_model_parallel_size, ...",
    ),
    LineGrammar(
        name="cuda-graph-capture",
        era="Megatron-LM / Transformer Engine CUDA-graph capture messages",
        example="[rank0]: > capturing cuda graph for 4 layers",
        pattern=re.compile(
            r"capture cuda graph|cuda graph capture|capturing cuda graph|cuda graphs? captured", re.IGNORECASE
        ),
        yields="the next iteration logged includes the capture (dropped from statistics)",
    ),
    LineGrammar(
        name="nodelist",
        era="SLURM environment dumps, scontrol show job",
        example="SLURM_JOB_NODELIST=pool0-[0001-0016,0033-0048]",
        pattern=re.compile(r"\b(?:SLURM_JOB_NODELIST|SLURM_NODELIST|NodeList|nodelist)\s*[=:]\s*(\S+)"),
        yields="the job's node set (compressed host list, expanded only when small)",
    ),
    LineGrammar(
        name="deepspeed-workers",
        era="DeepSpeed launcher (multinode_runner.py, pdsh and other multi-node runners), 2020-2026",
        example=(
            "[2022-09-08 12:02:15,192] [INFO] [multinode_runner.py:65:get_cmd] Running on the following workers:"
            " worker-0,worker-1"
        ),
        pattern=re.compile(r"Running on the following workers:\s*([^\s,]+(?:,[^\s,]+)*)"),
        yields="the job's node set (comma-separated host names)",
    ),
    LineGrammar(
        name="deepspeed-world-info",
        era="DeepSpeed launcher (launch.py on each node), 2020-2026",
        example=(
            "worker-1: [2022-09-08 12:02:16,518] [INFO] [launch.py:136:main] WORLD INFO DICT: "
            "{'worker-0': [0, 1], 'worker-1': [0, 1]}"
        ),
        pattern=re.compile(r"WORLD INFO DICT:\s*\{(.*)\}"),
        yields="the node set (the dict's keys), when no 'Running on the following workers' line is there",
    ),
    LineGrammar(
        name="pdsh-prefix",
        era="pdsh (DeepSpeed's default multi-node runner) prefixes each node's output with 'host: '",
        example="worker-1: [2022-09-08 12:02:16,518] [INFO] [launch.py:142:main] nnodes=2, num_local_procs=1",
        pattern=re.compile(
            r"^((?=[A-Za-z0-9._-]*[A-Za-z.])[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?): "
            r"\[\d{4}-\d\d-\d\d \d"
        ),
        yields="a host that printed DeepSpeed log lines (a name with a letter or a dot: srun's '0: ' labels are "
        "ranks); the node set from these hosts when the log names none otherwise",
    ),
    LineGrammar(
        name="software-version",
        era="DeepSpeed's environment report (ds_report, printed by Megatron-DeepSpeed at start-up), DeepSpeed engine",
        example="torch version .................... 2.1.0a0+fe05266",
        pattern=re.compile(
            r"(?:^|[\s:\]])(torch version|deepspeed info|torch cuda version) \.{3,}\s*\[?'?([^\s,'\]]+)"
            r"|DeepSpeed info: version=([^\s,]+)"
        ),
        yields="software['torch'], software['deepspeed'], software['cuda'] (the version strings as printed)",
    ),
    LineGrammar(
        name="cuda-oom",
        era="torch (RuntimeError before 1.13, torch.cuda.OutOfMemoryError / torch.OutOfMemoryError since), ROCm's HIP",
        example="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.05 GiB. GPU 0 has a total capacity",
        pattern=re.compile(r"(?:CUDA|HIP) out of memory|OutOfMemoryError"),
        yields="an out-of-memory event: the run died short of its true peak, so its memory peaks are lower bounds",
    ),
    LineGrammar(
        name="jobid",
        era="SLURM environment dumps, scontrol show job",
        example="SLURM_JOB_ID=2796012",
        pattern=re.compile(r"\b(?:SLURM_JOB_ID|SLURM_JOBID|JobId)\s*[=:]\s*(\d+)"),
        yields="the job id",
    ),
)

FIELDS: dict[str, FieldGrammar] = {
    f.label: f
    for f in (
        FieldGrammar(label="elapsed time per iteration (ms)", attr="elapsed_ms", scale=1.0, era="Megatron-LM 2021-"),
        FieldGrammar(label="elapsed time per iteration (s)", attr="elapsed_ms", scale=1000.0, era="Megatron-DeepSpeed"),
        FieldGrammar(label="throughput per GPU (TFLOP/s/GPU)", attr="tflops", scale=1.0, era="Megatron-LM 2023-"),
        FieldGrammar(label="TFLOPs", attr="tflops", scale=1.0, era="Megatron-DeepSpeed / BigScience (per GPU)"),
        FieldGrammar(label="samples per second", attr="samples_per_s", scale=1.0, era="Megatron-DeepSpeed"),
        FieldGrammar(label="train_step_timing in s", attr="elapsed_ms", scale=1000.0, era="NeMo 2 / Lightning"),
        FieldGrammar(label="TFLOPS_per_GPU", attr="tflops", scale=1.0, era="NeMo 2 (FLOPs callback)"),
        FieldGrammar(label="lm loss", attr="loss", scale=1.0, era="all"),
        FieldGrammar(label="reduced_train_loss", attr="loss", scale=1.0, era="NeMo 2 / Lightning"),
        FieldGrammar(label="number of skipped iterations", attr="skipped", scale=1.0, era="all"),
        FieldGrammar(label="number of nan iterations", attr="nan", scale=1.0, era="all"),
    )
}
"""Iteration-line fields by printed label. A value printed ``current/average`` (``13090.4/13102.9``)
is read as its current value, the window's own figure."""

MEMORY_FIELDS: dict[str, FieldGrammar] = {
    f.label: f
    for f in (
        FieldGrammar(label="memory(GiB)", attr="max_reserved_mib", scale=1024.0, unit="GiB",
                     era="ms-swift Megatron: torch.cuda.max_memory_reserved() in GiB"),
        FieldGrammar(label="hip mem usage/free/total/usage_ratio", attr="device_used_mib", scale=1024.0, unit="GiB",
                     era="Primus (ROCm): used/free/total from torch.cuda.mem_get_info(), GiB printed as 'GB'"),
        FieldGrammar(label="rocm mem usage/free/total/usage_ratio", attr="device_used_mib", scale=1024.0, unit="GiB",
                     era="Primus (ROCm): VRAM used/free/total from rocm-smi, GiB printed as 'GB'"),
        FieldGrammar(label="max_memory_reserved", attr="max_reserved_mib", scale=1 / 2**20, unit="B",
                     era="NeMo 2 (MegatronStrategy log_memory_usage): torch.cuda.max_memory_reserved() in bytes, "
                         "printed '{:.4}' (4 significant digits) as the mean over the log interval"),
        FieldGrammar(label="max_memory_allocated", attr="max_allocated_mib", scale=1 / 2**20, unit="B",
                     era="NeMo 2 (MegatronStrategy log_memory_usage): torch.cuda.max_memory_allocated() in bytes"),
    )
}  # fmt: skip
"""Memory fields printed on iteration lines, read as MiB (GiB: the first number of a ``used/free/...`` list;
bytes: divided by 2**20). Any other iteration field whose label says memory is named in a warning, never guessed
at. NeMo 2 prints a window's mean of a running peak, at most 0.05% under the peak at the window's end."""

TIMING_ATTRS = ("elapsed_ms", "tflops")
"""An iteration line counts only with one of these (else it is a validation or foreign line)."""


def grammar(name: str) -> LineGrammar:
    """The grammar called ``name``."""
    return next(g for g in GRAMMARS if g.name == name)


def clean_text(text: str) -> str:
    """``text`` without ANSI escape codes (colour, cursor) and with CRLF line ends as LF."""
    return strip_ansi(text).replace("\r\n", "\n")


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape codes (no code holds a line end, so lines can be stripped one by one)."""
    return _ANSI_RE.sub("", text) if "\x1b" in text else text


_ITER_ANY = re.compile(r"\biteration\s+\d+\s*/\s*\d+")
_LABEL = re.compile(r"\|\s*([A-Za-z][^:|]{0,60}?)\s*:")


def describe_unknown(text: str) -> str:
    """What the parser looked for and what ``text`` holds instead, for a "no iteration lines" error."""
    if "\x00" in text[:4096] or text[:1] == "\ufffd":
        return f"{_WANTED}; found binary data instead (an allocator snapshot? use snapshot-report)"
    seen = UnknownLines()
    for line in text.splitlines():
        seen.add(line)
    return seen.describe()


_WANTED = (
    "looked for iteration lines 'iteration N/ M | ... | <timing field>: X |' with a timing field "
    f"({', '.join(repr(f.label) for f in FIELDS.values() if f.attr in TIMING_ATTRS)})"
)


class UnknownLines:
    """What a log holds instead of iteration lines, gathered one line at a time in bounded memory.

    The parser feeds it the lines it could not read and describes them in its "no iteration lines"
    error; it keeps counts, the first line and the first field labels, never the lines.
    """

    __slots__ = ("first", "iteration_lines", "labels", "lines")

    def __init__(self) -> None:
        self.lines = 0
        self.iteration_lines = 0
        self.labels: dict[str, None] = {}
        self.first = ""

    def add(self, line: str) -> None:
        """Count one line (labels are read from the first 50 'iteration N/M' lines, 8 kept)."""
        line = line.strip()
        if not line:
            return
        if not self.lines:
            self.first = line
        self.lines += 1
        if _ITER_ANY.search(line):
            self.iteration_lines += 1
            if self.iteration_lines <= 50 and len(self.labels) < 8:
                for m in _LABEL.finditer(line):
                    self.labels.setdefault(m.group(1), None)
                    if len(self.labels) == 8:
                        break

    def describe(self) -> str:
        """The looked-for shape and what was found instead."""
        if self.iteration_lines:
            shown = ", ".join(repr(x) for x in self.labels) or "none"
            return f"{_WANTED}; found {self.iteration_lines} 'iteration N/M' line(s) without one, with fields {shown}"
        clip = self.first if len(self.first) <= 100 else self.first[:100] + "…"
        return f"{_WANTED}; found {self.lines} other non-empty line(s) instead, the first: {clip!r}"
