"""The CLI's one pair of consoles and its one way to report a KilnError and exit."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console

from kiln.errors import KilnError

console = Console(soft_wrap=True, highlight=False)  # no highlighter colouring parts of digests
err_console = Console(stderr=True, soft_wrap=True, highlight=False)


def fail(error: KilnError) -> NoReturn:
    """Print a KilnError (code, message, hint) on stderr and exit 2."""
    err_console.print(f"[red]error[/] {error.code}: {error.message}", highlight=False)
    if error.hint:
        err_console.print(f"hint: {error.hint}", markup=False, highlight=False)
    raise typer.Exit(2)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
