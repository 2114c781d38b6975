"""The toolkit's error hierarchy (the pool has its own, ``bufreuse.pool.BufferReuseError``).

Each error carries the exit code the CLI turns it into: 2 for bad input (a file, a label, an
option), 1 for a check that ran and did not pass or a job that failed. Messages say what failed,
where (file, job id, field) and what to do; the CLI prints them as one line.
"""

from __future__ import annotations

__all__ = [
    "BufreuseError",
    "CheckFailedError",
    "ConfigError",
    "InputError",
    "JobFailedError",
    "LogFormatError",
    "OutputError",
    "SnapshotFormatError",
    "SubmissionError",
]


class BufreuseError(Exception):
    """Base of every toolkit error; ``exit_code`` is what the CLI exits with."""

    exit_code: int = 2


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

    exit_code = 1


class JobFailedError(BufreuseError):
    """A submitted or local run ended badly; the message carries job id, state and stderr tail."""

    exit_code = 1


class CheckFailedError(BufreuseError):
    """A check ran and did not pass (``compare --fail-on-regression``, ``check-config``)."""

    exit_code = 1
