"""The field rules every request model shares: bounds, name checks and the strict base model.

Kept apart from the models so the run request (``kiln.core.contracts``) and the training
configuration (``kiln.core.training_config``) read the same rules from one place."""

from __future__ import annotations

import re
from typing import Any

from pydantic import AliasChoices, ConfigDict, ValidationError

from kiln.core import boundedjson
from kiln.core.canonical import compact_json
from kiln.core.tolerant import Tolerant

MAX_SEED = 2**63 - 1
MAX_ITERATIONS = 1000
# The deepest collection pipeline an online run may ask for (TRL's async trainer defaults to 4;
# AReaL evaluates its decoupled objective at a staleness of 4).
MAX_STALENESS = 4
MAX_RESET_OPTIONS_BYTES = 16 * 1024 * 1024 - 1024
_ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
IDEMPOTENCY_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
CREDENTIAL_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# The environment URLs field has one documented name, environment_urls; "environments" (the name
# the OpenAPI document once required) is still accepted from older clients, never written.
ENVIRONMENT_URLS = AliasChoices("environment_urls", "environments")
BASE_ADAPTER_ALIASES = {"base", "none", "null"}


def normalize_adapter(name: str | None) -> str | None:
    """``base``/``none``/``null`` (any case, trimmed) and None mean the base model → None."""
    if name is None:
        return None
    text = name.strip()
    if text.lower() in BASE_ADAPTER_ALIASES:
        return None
    return text


def check_adapter_name(name: str, field: str) -> str:
    if not _ADAPTER_NAME_RE.match(name):
        raise ValueError(
            f"{field} {name!r} is not a valid adapter name: use 1-128 characters from "
            "A-Z a-z 0-9 . _ - starting with a letter or digit"
        )
    return name


def check_model_name(name: str | None) -> str | None:
    """A served model's name is its folder name under KILN_MODELS_DIR (None = the default model)."""
    if name is not None and not _MODEL_NAME_RE.match(name):
        raise ValueError(
            f"model {name!r} is not a model name: use the folder name of a served model "
            "(1-128 characters from A-Z a-z 0-9 . _ - starting with a letter or digit)"
        )
    return name


class StrictModel(Tolerant):
    """No coercion (``true``/``"1"`` are not integers), no unknown fields (but under
    ``kiln.core.tolerant.TOLERANT_CONTEXT``: one release newer's), every float finite."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False)


MAX_FREE_JSON_DEPTH = 32


def check_staleness(max_staleness: int, iterations: int, adapter: str) -> None:
    """A run's ``max_staleness`` against its plan: overlap needs two iterations, and full training
    keeps no second frozen copy for the decoupled correction."""
    if max_staleness and iterations < 2:
        raise ValueError(
            f"max_staleness {max_staleness} needs iterations >= 2 (it overlaps consecutive iterations); "
            "set iterations >= 2 or max_staleness 0"
        )
    if max_staleness and adapter == "full":
        raise ValueError("training_config.adapter full does not support max_staleness >= 1: set it to 0 or train lora")


def check_free_json(value: Any, field: str) -> Any:
    """Bound a free-form JSON value (reset options, policy identity): depth, finite numbers, size."""
    try:
        boundedjson.check(value, max_depth=MAX_FREE_JSON_DEPTH, path=field)
    except boundedjson.JsonBoundsError as exc:
        raise ValueError(str(exc)) from None
    if len(compact_json(value)) > MAX_RESET_OPTIONS_BYTES:
        raise ValueError(f"{field} is larger than 16 MiB - 1024 bytes of canonical JSON")
    return value


def format_validation_error(error: ValidationError) -> str:
    """Field-level, content-free message: ``field.path: reason`` per problem."""
    parts: list[str] = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item.get("loc", ())) or "request"
        msg = str(item.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)
