"""What an OpenEnv server answers to ``reset`` and ``step``: an observation or a wire error.

Owns: the wire error codes Kiln sorts replies by (recoverable: the episode may go on with
feedback; terminal: the session is over) and :class:`StepResult`, the reply as the rollout and
replay code read it (its training reward, done flag and replay form).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kiln.core.openenv.rewards import is_valid_wire_reward, training_reward

RECOVERABLE_CODES = frozenset({"INVALID_JSON", "UNKNOWN_TYPE", "VALIDATION_ERROR", "EXECUTION_ERROR"})
TERMINAL_CODES = frozenset({"CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR"})
CAPACITY_REACHED = "CAPACITY_REACHED"
_OBSERVATION_KEYS = frozenset({"observation", "reward", "done", "metadata"})


@dataclass
class StepResult:
    """The reply to ``reset`` or ``step``: an observation or a wire protocol error."""

    kind: Literal["observation", "protocol_error"]
    observation: dict | None = None  # wire data: {"observation", "reward", "done"[, "metadata"]}
    error: dict | None = None  # wire data: {"code", "message", ...}

    @property
    def done(self) -> bool:
        return bool(self.observation["done"]) if self.observation is not None else False

    @property
    def reward_value(self) -> float:
        return training_reward(self.observation.get("reward")) if self.observation else 0.0

    @property
    def code(self) -> str | None:
        return self.error.get("code") if self.error is not None else None

    @property
    def terminal(self) -> bool:
        return self.code in TERMINAL_CODES

    @property
    def recoverable(self) -> bool:
        return self.code in RECOVERABLE_CODES

    @classmethod
    def of(cls, kind: str, data: dict) -> StepResult:
        """The result of a decoded ``observation`` or ``error`` frame's data."""
        if kind == "error":
            return cls(kind="protocol_error", observation=None, error=data)
        return cls(kind="observation", observation=data, error=None)

    def to_dict(self) -> dict:
        """Replay form: ``{"kind", "observation"}`` or ``{"kind", "error"}``."""
        if self.kind == "observation":
            return {"kind": "observation", "observation": self.observation}
        return {"kind": "protocol_error", "error": self.error}


def observation_problem(data: dict) -> str | None:
    """What is wrong with an ``observation`` frame's data (None: a well-formed observation)."""
    if not set(data) <= _OBSERVATION_KEYS:
        return "observation data has unexpected keys"
    if not isinstance(data.get("observation"), dict):
        return "observation data has no 'observation' object"
    if not isinstance(data.get("done"), bool):
        return "observation data has no boolean 'done'"
    if "reward" not in data or not is_valid_wire_reward(data["reward"]):
        return "observation reward is missing or not null/bool/finite number"
    if "metadata" in data and not isinstance(data["metadata"], (dict, type(None))):
        return "observation metadata is not an object"
    return None
