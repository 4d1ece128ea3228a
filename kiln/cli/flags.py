"""Flags in, flags out: choice flags from the request models, errors that name the flags typed.

Each choice lives once, in the request model's ``Literal`` type: :func:`literal_choices` turns it
into an ``Enum`` the CLI option takes, so a wrong value is refused locally ("Invalid value for
'--optimizer': 'sgd' is not one of 'muon', 'adamw'"), before anything is submitted.

:func:`check_request` validates the request the flags built with the same model the API uses and
reports each problem under the flag that set it (``--group-size``, not ``body: group_size``).
"""

from __future__ import annotations

import enum
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from kiln.cli.model_options import choices
from kiln.errors import InvalidRequest

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
# Field names in model-level messages: snake_case paths, and the two plain-word fields.
_IDENTIFIER = re.compile(r"\b(?:[a-z]+(?:_[a-z0-9]+)+(?:\.[a-z_]+)*|groups|iterations)\b")


def literal_enum(name: str, literal: Any) -> type[enum.Enum]:
    """A ``str`` Enum of the string values of a ``Literal`` type (the one home of them)."""
    values = [v for v in typing.get_args(literal) if isinstance(v, str)]
    if not values:
        raise TypeError(f"{literal!r} is not a Literal of strings")
    return enum.Enum(name, {value: value for value in values}, type=str)  # type: ignore[return-value]


def literal_choices(name: str, model: type[BaseModel], field: str) -> type[enum.Enum]:
    """A ``str`` Enum of ``model.field``'s choices (``kiln.cli.model_options.choices``)."""
    values = [v for v in choices(model, field) if isinstance(v, str)]
    if not values:
        raise TypeError(f"{model.__name__}.{field} is not a Literal of strings")
    return enum.Enum(name, {value: value for value in values}, type=str)  # type: ignore[return-value]


def flag_for(path: str) -> str:
    """The CLI flag that sets request field ``path`` (``training_config.optimizer`` → ``--optimizer``)."""
    if path in _FLAG_OF_PATH:
        return _FLAG_OF_PATH[path]
    last = path.split(".")[-1]
    return "--" + last.replace("_", "-")


def _in_flags(message: str) -> str:
    """Field names in a model-level message replaced by their flags."""
    return _IDENTIFIER.sub(lambda m: flag_for(m.group(0)), message)


def flag_message(error: ValidationError) -> str:
    """``--flag: reason`` per problem (model-level problems: the reason with fields as flags)."""
    parts = []
    for item in error.errors():
        loc = [str(p) for p in item.get("loc", ()) if not isinstance(p, int)]
        reason = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        if loc:
            parts.append(f"{flag_for('.'.join(loc))}: {_in_flags(reason)}")
        else:
            parts.append(_in_flags(reason))
    return "; ".join(parts)


def check_request(model: type[BaseModel], request: dict[str, Any]) -> None:
    """Validate ``request`` as ``model``; raise ``InvalidRequest`` naming the flags at fault."""
    try:
        model.model_validate(request)
    except ValidationError as exc:
        raise InvalidRequest(
            f"invalid flags: {flag_message(exc)}",
            hint="see --help for each flag's bounds and default",
        ) from None
