"""Turning the policy's final text into one action object.

Owns: trimming, the optional code fence (```json ... ```), parsing exactly one JSON object, and
the two harness failure codes. Error messages are content-free: they never quote the model output.
"""

from __future__ import annotations

from typing import Any

from kiln.core.boundedjson import JsonBoundsError
from kiln.core.canonical import strict_loads
from kiln.core.openenv.schema import ActionValidator, describe_issues

INVALID_MODEL_ACTION = "INVALID_MODEL_ACTION"
ACTION_SCHEMA_VALIDATION_FAILED = "ACTION_SCHEMA_VALIDATION_FAILED"
MODEL_ACTION_NO_OUTPUT = "MODEL_ACTION_NO_OUTPUT"
_FENCE = "```"


class ActionParseError(Exception):
    """The model output is not one JSON object (harness code ``INVALID_MODEL_ACTION``)."""

    code = INVALID_MODEL_ACTION

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)

    def to_harness_error(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class ActionSchemaValidationError(Exception):
    """The action object fails the advertised schema (``ACTION_SCHEMA_VALIDATION_FAILED``)."""

    code = ACTION_SCHEMA_VALIDATION_FAILED

    def __init__(self, issues: list[dict[str, str]], truncated: bool) -> None:
        self.issues = issues
        self.truncated = truncated
        self.message = describe_issues(issues, truncated)
        super().__init__(self.message)

    def to_harness_error(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}


def strip_code_fence(text: str) -> str:
    """Trim; unwrap one ```/```json fence (which must be closed at the end)."""
    body = text.strip()
    if not body:
        raise ActionParseError("model output is empty")
    if body.startswith(_FENCE):
        body = body[len(_FENCE) :]
        if body.startswith("json") or body.startswith("JSON"):
            body = body[4:]
        body = body.lstrip()
        if not body.endswith(_FENCE):
            raise ActionParseError("model output opened a code fence but did not close it")
        body = body[: -len(_FENCE)].rstrip()
    return body


def parse_action_text(text: str) -> dict:
    """One JSON object from the model's final content, or ``ActionParseError``."""
    if not isinstance(text, str):
        raise ActionParseError("model output is not text")
    body = strip_code_fence(text)
    try:
        value = strict_loads(body)
    except JsonBoundsError:
        raise ActionParseError(
            "model output breaks Kiln's JSON bounds (a non-finite or oversized number, or nesting too deep)"
        ) from None
    except ValueError:
        raise ActionParseError("model output is not exactly one JSON value") from None
    if not isinstance(value, dict):
        raise ActionParseError("model output is a JSON value but not an object")
    return value


def parse_and_validate_action(text: str, validator: ActionValidator) -> dict:
    """Parse then validate; raises ``ActionParseError`` or ``ActionSchemaValidationError``."""
    action = parse_action_text(text)
    issues, truncated = validator.issues(action)
    if issues:
        raise ActionSchemaValidationError(issues, truncated)
    return action
