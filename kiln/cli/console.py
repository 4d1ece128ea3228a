"""The CLI's consoles and output discipline: one way to print, report a KilnError and exit.

With ``--json`` stdout carries exactly one JSON document: :class:`JsonAwareGroup` switches the
per-invocation JSON mode from the command's ``as_json`` parameter before the command runs,
:func:`progress` is where human-readable progress goes (stderr under ``--json``, stdout
otherwise), and :func:`fail` turns a ``KilnError`` into ``{"error": {code, message, hint, …}}``
on stdout under ``--json`` (plus the usual line on stderr), exit status 2. No console highlights
(the highlighter colours parts of SHA-256 digests).
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from typer.core import TyperGroup

from kiln.errors import KilnError

console = Console(soft_wrap=True, highlight=False)
err_console = Console(stderr=True, soft_wrap=True, highlight=False)
_state = {"json": False}


def set_json(on: bool) -> None:
    _state["json"] = bool(on)


def json_mode() -> bool:
    return _state["json"]


def progress() -> Console:
    """Where human-readable progress goes: stderr under ``--json``, else stdout."""
    return err_console if _state["json"] else console


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def fail(error: KilnError, exit_code: int = 2) -> NoReturn:
    """Report ``error`` (stderr line; JSON envelope on stdout under ``--json``) and exit."""
    err_console.print(f"[red]error[/] {error.code}: {error.message}", markup=True, highlight=False)
    if error.hint:
        err_console.print(f"hint: {error.hint}", markup=False, highlight=False)
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
