"""What a CLI option reads from the request model it fills: default, description, bounds, choices.

Each default, bound and description lives once, on the pydantic field (``kiln.core.contracts``); the
CLI builds its options from them, and the API's ``/docs`` shows the very same text.
"""

from __future__ import annotations

import typing
from typing import Any, Callable

import annotated_types
import typer
from pydantic import BaseModel


def _field(model: type[BaseModel], field: str) -> Any:
    try:
        return model.model_fields[field]
    except KeyError:
        raise KeyError(f"{model.__name__} has no field {field!r}") from None


def default(model: type[BaseModel], field: str) -> Any:
    """A CLI option's default is the model field's default (each default lives once, in the model)."""
    return _field(model, field).get_default(call_default_factory=True)


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def bounds(model: type[BaseModel], field: str) -> str | None:
    """The field's numeric bounds as help text: ``1-256``, ``>= 0``, ``> 0``, ``>= 0, < 1``; else None."""
    low = high = None
    for item in _field(model, field).metadata:
        if isinstance(item, annotated_types.Ge):
            low = _number(item.ge)
        elif isinstance(item, annotated_types.Gt):
            low = f"> {_number(item.gt)}"
        elif isinstance(item, annotated_types.Le):
            high = _number(item.le)
        elif isinstance(item, annotated_types.Lt):
            high = f"< {_number(item.lt)}"
    if low is None and high is None:
        return None
    if high is None:
        return low if str(low).startswith(">") else f">= {low}"
    if low is None:
        return high if high.startswith("<") else f"<= {high}"
    if str(low).startswith(">") or high.startswith("<"):
        low = low if str(low).startswith(">") else f">= {low}"
        high = high if high.startswith("<") else f"<= {high}"
        return f"{low}, {high}"
    return f"{low}-{high}"


def choices(model: type[BaseModel], field: str) -> tuple[Any, ...]:
    """The values a ``Literal`` field accepts (in declaration order; empty when not a choice)."""
    found: list[Any] = []

    def walk(annotation: Any) -> None:
        if typing.get_origin(annotation) is typing.Literal:
            found.extend(typing.get_args(annotation))
        else:
            for arg in typing.get_args(annotation):
                walk(arg)

    walk(_field(model, field).annotation)
    return tuple(found)


def describe(model: type[BaseModel], field: str, *, with_bounds: bool = True) -> str:
    """The field's description (the one ``/docs`` shows), with its bounds appended: ``Seed groups
    to collect (1-16384).``"""
    text = (_field(model, field).description or "").strip()
    limits = bounds(model, field) if with_bounds else None
    if limits is None:
        return text
    body = text[:-1] if text.endswith(".") else text
    if body.endswith(")"):  # one parenthesis: "(at least 2 for training; 1-256)"
        return f"{body[:-1]}; {limits})."
    return f"{body} ({limits})." if body else f"{limits}."


__all__ = ["bounds", "choices", "default", "describe"]


def model_option(
    model: type[BaseModel],
    field: str,
    panel: str,
    *names: str,
    choice: Callable[[Any], Any] | None = None,
    help_suffix: str = "",
    with_bounds: bool = True,
) -> Any:
    """A typer option whose default and help text are ``model.field``'s (``choice`` wraps the
    default in the flag's choice enum); ``names`` are its flags when not derived from the name."""
    value = default(model, field)
    return typer.Option(
        choice(value) if choice is not None else value,
        *names,
        rich_help_panel=panel,
        help=describe(model, field, with_bounds=with_bounds) + help_suffix,
    )
