"""Help output that fits 80 columns: click's plain formatter, no ``<int>``/``<str>`` type labels.

Typer's rich panels truncate long option names at 80 columns and label every option with its
type. The Typer apps are built with ``rich_markup_mode=None`` (plain, wrapping help); this module
turns the app into its click command and drops the type labels (the help text says what a value
is, and defaults are shown).
"""

from __future__ import annotations

from typing import Any

import typer


def _no_type(*_args: object, **_kwargs: object) -> str:
    return ""


def _strip(command: Any) -> None:
    for param in command.params:
        kind = getattr(param, "param_type_name", None)
        if kind == "argument" and hasattr(param, "display_type_rich"):
            param.display_type_rich = _no_type  # type: ignore[method-assign]
            param.metavar = (param.name or "value").upper()
        if kind == "option" and not getattr(param, "is_flag", False) and not getattr(param, "count", False):
            param.metavar = ""
            if hasattr(param, "display_type_rich"):  # Typer's options print their type here
                param.display_type_rich = _no_type  # type: ignore[method-assign]
    if getattr(command, "help", None) and not getattr(command, "short_help", None):
        # The first paragraph, whole (click would cut it with "..." to fit the command list).
        command.short_help = " ".join(command.help.split("\n\n")[0].split())
    for sub in (getattr(command, "commands", None) or {}).values():
        _strip(sub)


def plain_command(app: typer.Typer) -> Any:
    """The click command of ``app`` with type labels removed from every option."""
    command = typer.main.get_command(app)
    _strip(command)
    return command
