"""The CLI's consoles and output discipline: one way to print, report a KilnError and exit.

With ``--json`` stdout carries exactly one JSON document: :class:`JsonAwareGroup` switches the
per-invocation JSON mode from the command's ``as_json`` parameter before the command runs,
:func:`progress` is where human-readable progress goes (stderr under ``--json``, stdout
otherwise), and :func:`fail` turns a ``KilnError`` into ``{"error": {code, message, hint, …}}``
on stdout under ``--json`` (plus the usual line on stderr), exit status 2. No console highlights
(the highlighter colours parts of SHA-256 digests), and no console hard-wraps a line (URLs and
digests stay whole; on a terminal :func:`link` also makes a URL a clickable hyperlink).

A reader that goes away (``kiln openenv status RUN | head -2``) is not an error: output to a
closed pipe is discarded and the command still exits with its own code (the run's outcome).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, NoReturn, TypeVar

import click
import typer
from pydantic import BaseModel
from rich.console import Console
from typer.core import TyperGroup

from kiln.core.errors import KilnError

T = TypeVar("T")

try:  # Typer vendors its own Click: its parse errors are not click's classes
    from typer._click.exceptions import UsageError as _VendoredUsageError
except ImportError:  # pragma: no cover - a Typer that uses the installed Click
    _VendoredUsageError = click.UsageError  # type: ignore[misc,assignment]  # the same class under Typer's name
USAGE_ERRORS = (click.UsageError, _VendoredUsageError)


def _discard_stream(stream: Any) -> None:
    """Point ``stream``'s file descriptor at /dev/null (its reader is gone)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


class KilnConsole(Console):
    """A console that never hard-wraps and treats a closed pipe as "nobody is reading"."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("soft_wrap", True)
        kwargs.setdefault("highlight", False)
        super().__init__(**kwargs)

    def on_broken_pipe(self) -> None:  # rich's default raises SystemExit(1), the "failed" code
        self.quiet = True
        _discard_stream(self.file)


def flush_quietly() -> None:
    """Flush stdout/stderr at exit; a reader that went away is not an error."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            try:
                _discard_stream(stream)
            except (OSError, ValueError):
                pass


def link(url: str) -> str:
    """Console markup for ``url``: a terminal hyperlink whose text is the whole URL, unwrapped."""
    from rich.markup import escape

    return f"[link={escape(url)}]{escape(url)}[/link]"


console = KilnConsole()
err_console = KilnConsole(stderr=True)
_state = {"json": False}


def set_json(on: bool) -> None:
    _state["json"] = bool(on)


def json_mode() -> bool:
    return _state["json"]


def progress() -> Console:
    """Where human-readable progress goes: stderr under ``--json``, else stdout."""
    return err_console if _state["json"] else console


def print_json(value: Any) -> None:
    """``value`` (a pydantic model is dumped as the API sends it) as one indented JSON document on
    stdout (nothing if its reader went away)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", by_alias=True)
    elif isinstance(value, list):
        value = [v.model_dump(mode="json", by_alias=True) if isinstance(v, BaseModel) else v for v in value]
    try:
        sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
    except BrokenPipeError:
        _discard_stream(sys.stdout)


def fail(error: KilnError, exit_code: int = 2) -> NoReturn:
    """Report ``error`` (stderr line; JSON envelope on stdout under ``--json``) and exit."""
    err_console.print(f"[red]error[/] {error.code}: {error.message}", markup=True, highlight=False)
    if error.hint:
        err_console.print(f"hint: {error.hint}", markup=False, highlight=False)
    if _state["json"]:
        print_json({"error": {**error.to_dict(), "exit_code": exit_code}})
    raise typer.Exit(exit_code)


def answer(call: Callable[[], T]) -> T:
    """``call()``'s answer (an API call, a download); a ``KilnError`` it raises ends the command
    as :func:`fail` reports it."""
    try:
        return call()
    except KilnError as error:
        fail(error)


def usage_error(error: Any, argv: list[str]) -> None:
    """A Click parse error (``click.UsageError``): pydantic's ``Value error,`` prefix removed from
    its message, and, when ``--json`` was typed, one ``{"error": …}`` envelope (code
    ``cli_usage_error``, exit status 2) on stdout; Click still prints its usage on stderr."""
    from kiln.core.errors import CliUsageError

    error.message = str(error.message).replace("Value error, ", "")
    if getattr(error, "_kiln_reported", False) or "--json" not in argv:
        return
    error._kiln_reported = True
    command = getattr(getattr(error, "ctx", None), "command_path", None) or "kiln"
    param = getattr(error, "param", None)
    opts = getattr(param, "opts", None)
    name = opts[0] if opts else getattr(error, "option_name", None)
    details = {"parameter": name} if name else None
    envelope = CliUsageError(error.format_message(), hint=f"see `{command} --help`", details=details)
    print_json({"error": {**envelope.to_dict(), "exit_code": getattr(error, "exit_code", 2)}})


class JsonAwareGroup(TyperGroup):
    """A command group whose commands switch JSON mode from their ``as_json`` parameter, and whose
    parse errors honour ``--json`` (:func:`usage_error`)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if ctx.parent is None:
            ctx.meta["kiln_argv"] = list(args)
        try:
            return super().parse_args(ctx, args)
        except USAGE_ERRORS as error:
            usage_error(error, list(args))
            raise

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except USAGE_ERRORS as error:
            usage_error(error, ctx.meta.get("kiln_argv", []))
            raise

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None and not hasattr(command, "_kiln_json_aware") and not hasattr(command, "commands"):
            original = command.invoke

            def invoke(sub_ctx: Any, _original: Any = original) -> Any:
                set_json(bool(sub_ctx.params.get("as_json", False)))
                return _original(sub_ctx)

            command.invoke = invoke  # type: ignore[method-assign,assignment]  # per-instance wrapper; the closure keeps the original
            command._kiln_json_aware = True  # type: ignore[attr-defined]  # a marker click does not declare
        return command
