"""The ``bufreuse`` command line: thin Typer commands over the packages below it.

Command modules import nothing heavy at module level (no torch, no pandas), so ``bufreuse --help``
and ``bufreuse snapshot-report`` start fast; each command imports its library when it runs.
"""

from bufreuse.cli.app import app, main

__all__ = ["app", "main"]
