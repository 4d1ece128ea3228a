"""Flags in, flags out: choice flags from the request models, errors that name the flags typed.

Each choice lives once, in the request model's ``Literal`` type: :func:`literal_choices` turns it
into an ``Enum`` the CLI option takes, so a wrong value is refused locally ("Invalid value for
'--optimizer': 'sgd' is not one of 'muon', 'adamw'"), before anything is submitted.

:func:`check_request` validates the request the flags built with the same model the API uses and
reports each problem under the flag that set it (``--group-size``, not ``body: group_size``).
"""

from __future__ import annotations

import enum
from functools import partial
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from kiln.cli.model_options import choices
from kiln.core.errors import InvalidRequest

# Request paths whose flag is not simply ``--`` + the last name with dashes.
_FLAG_OF_PATH = {
    "environment_urls": "--environment",
    "credential_ids": "--credential-id",
    "training_config.echo.lambda": "--echo-lambda",
    "training_config.echo": "--echo-lambda",
    "environment_eval": "--eval-groups",
    "environment_eval.groups": "--eval-groups",
    "environment_eval.group_size": "--eval-group-size",
    "environment_eval.seed_start": "--eval-seed-start",
    "environment_eval.gate": "--gate",
    "post_eval": "--post-eval-suite",
    "post_eval.suite": "--post-eval-suite",
    "post_eval.min_accuracy": "--post-eval-min-accuracy",
}
# Words in a message that may name a request field (snake_case, dotted); quoted spans are the
# user's own values and never rewritten.
_WORD = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)*(?:\.[a-z][a-z0-9_]*)*\b")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
# A plain word (``groups``) names its field only beside an operator ("groups >= 20", "groups ×").
_OPERATORS = "×+-*<>="


def literal_enum(name: str, literal: Any) -> type[enum.Enum]:
    """A ``str`` Enum of the string values of a ``Literal`` type (the one home of them)."""
    values = [v for v in typing.get_args(literal) if isinstance(v, str)]
    if not values:
        raise TypeError(f"{literal!r} is not a Literal of strings")
    return enum.Enum(name, {value: value for value in values}, type=str)  # type: ignore[return-value]  # functional API: a class


def literal_choices(name: str, model: type[BaseModel], field: str) -> type[enum.Enum]:
    """A ``str`` Enum of ``model.field``'s choices (``kiln.cli.model_options.choices``)."""
    values = [v for v in choices(model, field) if isinstance(v, str)]
    if not values:
        raise TypeError(f"{model.__name__}.{field} is not a Literal of strings")
    return enum.Enum(name, {value: value for value in values}, type=str)  # type: ignore[return-value]  # functional API: a class


def flag_for(path: str) -> str:
    """The CLI flag that sets request field ``path`` (``training_config.optimizer`` → ``--optimizer``)."""
    if path in _FLAG_OF_PATH:
        return _FLAG_OF_PATH[path]
    last = path.split(".")[-1]
    return "--" + last.replace("_", "-")


def field_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every request field path of ``model`` (nested models through Optional/list, dotted), under
    both its name and its alias."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        for key in {name, info.alias or name}:
            path = f"{prefix}{key}"
            out.add(path)
            for arg in (info.annotation, *typing.get_args(info.annotation)):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    out |= field_paths(arg, path + ".")
    return out


def _in_flags(message: str, fields: set[str], scope: str = "") -> str:
    """Request field names in a message replaced by their flags: only names of real fields (of
    ``scope``'s model first), never inside a quoted value, a plain word only beside an operator."""

    def swap(match: re.Match[str], text: str) -> str:
        word = match.group(0)
        path = next((p for p in (f"{scope}.{word}" if scope else None, word) if p and p in fields), None)
        if path is None:
            return word
        if "_" not in word and "." not in word:
            before, after = text[: match.start()].rstrip()[-1:], text[match.end() :].lstrip()[:1]
            if not (before and before in _OPERATORS) and not (after and after in _OPERATORS):
                return word
        return flag_for(path)

    pieces, last = [], 0
    for quoted in _QUOTED.finditer(message):
        plain = message[last : quoted.start()]
        pieces.append(_WORD.sub(partial(swap, text=plain), plain))
        pieces.append(quoted.group(0))
        last = quoted.end()
    tail = message[last:]
    pieces.append(_WORD.sub(lambda m: swap(m, tail), tail))
    return "".join(pieces)


def flag_message(error: ValidationError, model: type[BaseModel] | None = None) -> str:
    """``--flag: reason`` per problem (model-level problems: the reason with fields as flags)."""
    fields = field_paths(model) if model is not None else set()
    parts = []
    for item in error.errors():
        loc = [str(p) for p in item.get("loc", ()) if not isinstance(p, int)]
        reason = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        if loc:
            scope = ".".join(loc)
            parts.append(f"{flag_for(scope)}: {_in_flags(reason, fields, scope)}")
        else:
            parts.append(_in_flags(reason, fields))
    return "; ".join(parts)


def check_request(model: type[BaseModel], request: dict[str, Any]) -> None:
    """Validate ``request`` as ``model``; raise ``InvalidRequest`` naming the flags at fault."""
    try:
        model.model_validate(request)
    except ValidationError as exc:
        raise InvalidRequest(
            f"invalid flags: {flag_message(exc, model)}",
            hint="see --help for each flag's bounds and default",
        ) from None
