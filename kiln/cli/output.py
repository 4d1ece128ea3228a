"""CLI output discipline (issue 12): with ``--json`` stdout carries exactly one JSON document.

Owns the per-invocation JSON mode (set from the command's ``as_json`` parameter by
:class:`JsonAwareGroup` before the command runs), the console progress goes to (stderr under
``--json``, stdout otherwise), and :func:`fail`: a ``KilnError`` becomes ``{"error": {code,
message, hint, …}}`` on stdout under ``--json`` (plus the usual line on stderr), exit status 2.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from typer.core import TyperGroup

from kiln.errors import KilnError

_state = {"json": False}
_stdout = Console(soft_wrap=True)
_stderr = Console(stderr=True, soft_wrap=True)


def set_json(on: bool) -> None:
    _state["json"] = bool(on)


def json_mode() -> bool:
    return _state["json"]


def progress() -> Console:
    """Where human-readable progress goes: stderr under ``--json``, else stdout."""
    return _stderr if _state["json"] else _stdout


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def fail(error: KilnError, exit_code: int = 2) -> NoReturn:
    """Report ``error`` (stderr line; JSON envelope on stdout under ``--json``) and exit."""
    _stderr.print(f"[red]error[/] {error.code}: {error.message}", markup=True, highlight=False)
    if error.hint:
        _stderr.print(f"hint: {error.hint}", markup=False, highlight=False)
    if _state["json"]:
        print_json({"error": {**error.to_dict(), "exit_code": exit_code}})
    raise typer.Exit(exit_code)


class JsonAwareGroup(TyperGroup):
    """A command group whose commands switch JSON mode from their ``as_json`` parameter."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None and not hasattr(command, "_kiln_json_aware") and not hasattr(command, "commands"):
            original = command.invoke

            def invoke(sub_ctx: Any, _original: Any = original) -> Any:
                set_json(bool(sub_ctx.params.get("as_json", False)))
                return _original(sub_ctx)

            command.invoke = invoke  # type: ignore[method-assign]
            command._kiln_json_aware = True  # type: ignore[attr-defined]
        return command
