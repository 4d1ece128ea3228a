"""Help output that fits 80 columns: click's plain formatter, no ``<int>``/``<str>`` type labels.

Typer's rich panels truncate long option names at 80 columns and label every option with its
type. The Typer apps are built with ``rich_markup_mode=None`` (plain, wrapping help); this module
turns the app into its click command, drops the type labels (the help text says what a value
is, and defaults are shown), appends each choice flag's choices (read from its Enum, which
``kiln.cli.flags`` builds from the request model), and groups a command's options into sections
by their ``rich_help_panel`` (Collection, Policy, Training, …; options without one are listed
last, under "Options") — Typer itself draws panels only in rich markup mode.
"""

from __future__ import annotations

import re
import types
from typing import Any

import typer


# The help panels, in the order they are drawn (options of any other panel follow them).
COLLECTION, POLICY, TRAINING, EVALUATION, ONLINE_RL, OUTPUT = PANELS = (
    "Collection",
    "Policy",
    "Training",
    "Evaluation",
    "Online RL",
    "Output",
)
_TERM_MAX = 30  # click's widest first column


def _no_type(*_args: object, **_kwargs: object) -> str:
    return ""


def _choices(param: Any) -> list[str]:
    descriptor = getattr(param, "type_descriptor", None)
    choices = getattr(descriptor, "choices", None) or ()
    return [str(getattr(choice, "value", choice)) for choice in choices]


def _grouped_options(self: Any, ctx: Any, formatter: Any) -> None:
    """Arguments, then one section per help panel (first-seen order), then the ungrouped options."""
    args: list[tuple[str, str]] = []
    panels: dict[str, list[tuple[str, str]]] = {}
    loose: list[tuple[str, str]] = []
    for param in self.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        if param.param_type_name == "argument":
            args.append(record)
        elif getattr(param, "rich_help_panel", None):
            panels.setdefault(param.rich_help_panel, []).append(record)
        else:
            loose.append(record)
    if len(panels) < 2:  # one panel is no grouping: a plain list
        loose = [record for records in panels.values() for record in records] + loose
        panels = {}
    order = [p for p in PANELS if p in panels] + [p for p in panels if p not in PANELS]
    panels = {title: panels[title] for title in order}
    # One first-column width for every section, so the descriptions line up across sections.
    width = min(max((len(term) for records in (*panels.values(), loose) for term, _ in records), default=0), _TERM_MAX)
    panels = {title: [(term.ljust(width), text) for term, text in records] for title, records in panels.items()}
    loose = [(term.ljust(width), text) for term, text in loose]
    if args:
        with formatter.section("Arguments"):
            formatter.write_dl(args)
    for title, records in panels.items():
        with formatter.section(f"{title} options"):
            formatter.write_dl(records)
    if loose:
        with formatter.section("Other options" if panels else "Options"):
            formatter.write_dl(loose)


def _strip(command: Any) -> None:
    for param in command.params:
        kind = getattr(param, "param_type_name", None)
        if kind == "argument" and hasattr(param, "display_type_rich"):
            param.display_type_rich = _no_type
            param.metavar = (param.name or "value").upper()
        if kind == "option" and not getattr(param, "is_flag", False) and not getattr(param, "count", False):
            param.metavar = ""
            if hasattr(param, "display_type_rich"):  # Typer's options print their type here
                param.display_type_rich = _no_type
            choices = _choices(param)
            words = set(re.findall(r"[\w-]+", param.help or ""))
            if choices and param.help and not set(choices) <= words:  # not already named
                param.help = f"{param.help} Choices: {', '.join(choices)}."
    if getattr(command, "help", None) and not getattr(command, "short_help", None):
        # The first paragraph, whole (click would cut it with "..." to fit the command list).
        command.short_help = " ".join(command.help.split("\n\n")[0].split())
    if not hasattr(command, "commands"):
        command.format_options = types.MethodType(_grouped_options, command)
    for sub in (getattr(command, "commands", None) or {}).values():
        _strip(sub)


def plain_command(app: typer.Typer) -> Any:
    """The click command of ``app``: no type labels, choices shown, options grouped by panel."""
    command = typer.main.get_command(app)
    _strip(command)
    return command
