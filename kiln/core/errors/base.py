"""The root of Kiln's error tree: :class:`KilnError`, its registry of stable codes, and the
round trip of an error through a dict (across process and Temporal boundaries).

Every subclass registers its ``code`` when it is defined; the package ``kiln.core.errors``
imports every module that defines one, so the registry never depends on what else was imported.
"""

from __future__ import annotations

from typing import Any

MAX_MESSAGE_BYTES = 4096


def truncate_message(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """Cut a message to ``limit`` UTF-8 bytes, marking the cut with ``...``."""
    raw = message.encode("utf-8")
    if len(raw) <= limit:
        return message
    return raw[: limit - 3].decode("utf-8", errors="ignore") + "..."


# code -> the KilnError subclass that declares it (filled as each class is defined, below).
_REGISTRY: dict[str, type[KilnError]] = {}


class KilnError(Exception):
    """Base of every Kiln failure. Subclasses fix ``code``, ``retryable`` and ``http_status``."""

    code: str = "internal_error"
    retryable: bool = False
    http_status: int = 500
    stage: str | None = None
    # An expected wait, not a failure (an environment at capacity): workers log it as one INFO
    # line without a traceback, and Temporal marks it benign.
    expected: bool = False

    def __init_subclass__(
        cls,
        *,
        code: str | None = None,
        retryable: bool | None = None,
        http_status: int | None = None,
        stage: str | None = None,
        expected: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """Fix the attributes a subclass declares as class keywords
        (``class ReplayDrift(KilnError, code="openenv_replay_drift", http_status=409)``), then register
        the class under the code it declares itself, when it is built like KilnError (so
        ``error_from_dict`` can rebuild it); the first class of a code keeps it."""
        super().__init_subclass__(**kwargs)
        declared = {
            "code": code,
            "retryable": retryable,
            "http_status": http_status,
            "stage": stage,
            "expected": expected,
        }
        for name, value in declared.items():
            if value is not None:
                setattr(cls, name, value)
        code = cls.__dict__.get("code")
        if isinstance(code, str) and "__init__" not in cls.__dict__:
            _REGISTRY.setdefault(code, cls)

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        code: str | None = None,
        retryable: bool | None = None,
        stage: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        self.message = truncate_message(message)
        super().__init__(self.message)
        self.hint = hint
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable
        if stage is not None:
            self.stage = stage
        self.details = dict(details or {})

    def to_dict(self) -> dict[str, Any]:
        """The wire form used by the API, run status and Temporal failure details."""
        out: dict[str, Any] = {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.hint:
            out["hint"] = self.hint
        if self.stage:
            out["stage"] = self.stage
        if self.details:
            out["details"] = self.details
        return out

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def error_type(code: str) -> type[KilnError]:
    """The ``KilnError`` class of ``code`` (every class lives in this module, so the answer never
    depends on what else was imported); ``KilnError`` for an unknown code."""
    return _REGISTRY.get(code, KilnError)


def registered_errors() -> dict[str, type[KilnError]]:
    """Every stable code and its class, in definition order (``docs/errors.md`` is made of it)."""
    return dict(_REGISTRY)


def error_from_dict(data: dict[str, Any]) -> KilnError:
    """Rebuild a KilnError from its ``to_dict`` form (used across process boundaries)."""
    code = str(data.get("code") or "internal_error")
    cls = error_type(code)
    return cls(
        str(data.get("message") or code),
        hint=data.get("hint"),
        code=code,
        retryable=bool(data.get("retryable", False)),
        stage=data.get("stage"),
        details=data.get("details") or None,
    )
