"""How every subcommand refuses: one line on stderr naming what is wrong, and an exit code (2: bad input)."""

from __future__ import annotations

import typer


def fail(prefix: str, message: str, code: int = 2) -> typer.Exit:
    """Print `prefix: message` on stderr; returns the Exit for the caller to raise."""
    typer.echo(f"{prefix}: {message}", err=True)
    return typer.Exit(code)
