"""One error hierarchy for the whole project, rooted at :class:`BufreuseError`.

The pool's errors (:class:`bufreuse.pool.BufferReuseError` and its subclasses) are a branch of this
tree, so callers can catch one type. Exceptions carry no exit codes: the boundaries (the CLI, the
one-configuration runner, the Megatron entry wrapper) choose them with :func:`exit_code_for`. Messages
say what failed, where (file, job id, field, ring/slot) and what to do; the CLI prints them as one line.
"""

from __future__ import annotations

__all__ = [
    "BackendContractError",
    "BufreuseError",
    "CheckFailedError",
    "ConfigError",
    "InputError",
    "JobFailedError",
    "LogFormatError",
    "OutputError",
    "SnapshotFormatError",
    "SubmissionError",
    "exit_code_for",
]


class BufreuseError(Exception):
    """Base of every error this project raises on purpose."""


class InputError(BufreuseError):
    """Bad user input: a missing file, an unknown label, an option out of range."""


class OutputError(InputError, OSError):
    """A result cannot be written where asked (no permission, a file where a folder should be).

    Also an ``OSError``, so code that handles failed writes as such keeps working.
    """


class SnapshotFormatError(InputError):
    """An allocator snapshot that cannot be read or has the wrong structure."""


class LogFormatError(InputError):
    """A training log with nothing usable in it (no iteration lines, say)."""


class ConfigError(InputError):
    """A configuration that cannot be enabled as written; lists every unmet requirement."""


class SubmissionError(BufreuseError):
    """A job could not be submitted or tracked (sbatch failed, no scheduler reachable)."""


class JobFailedError(BufreuseError):
    """A submitted or local run ended badly; the message carries job id, state and stderr tail."""


class CheckFailedError(BufreuseError):
    """A check ran and did not pass (``compare --fail-on-regression``, ``check-config``)."""


class BackendContractError(BufreuseError, RuntimeError):
    """An outside backend (DeepEP, Transformer Engine, megatron-core) broke the contract we rely on.

    Names the backend, the call and what it returned instead (``backend``, ``call``, ``got``), e.g.
    Transformer Engine's ``GroupedLinear.forward(out=...)`` returning other storage than ``out``.
    """

    def __init__(self, backend: str, call: str, got: str, *, hint: str = "") -> None:
        self.backend = backend
        self.call = call
        self.got = got
        msg = f"{backend}: {call} {got}"
        super().__init__(f"{msg}; {hint}" if hint else msg)


def exit_code_for(exc: BaseException) -> int:
    """The process exit code for ``exc`` at a boundary: 2 for bad input, 1 for a run that did not pass.

    1: a check that ran and did not pass, a job that failed or could not be submitted, and runtime
    failures (pool misuse, a backend contract breach: both are ``RuntimeError`` too). 2: everything else
    the project raises (bad input: files, labels, options, configurations).
    """
    if isinstance(exc, (CheckFailedError, SubmissionError, JobFailedError, RuntimeError)):
        return 1
    return 2
