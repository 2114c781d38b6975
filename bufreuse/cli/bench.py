"""`bufreuse` command module (bench): being written; registers nothing yet."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add this module's command(s) to ``app``."""
