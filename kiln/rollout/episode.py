"""One candidate's episode state: token pieces, text trajectory, replay exchanges and outcome.

The collector (``kiln.rollout.group``) drives several of these in lock-step; this module owns the
bookkeeping rules of R3.11–R3.16 and R4.2 so they exist in exactly one place.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import EnvironmentProtocolError
from kiln.rollout.prompts import harness_error_content, protocol_error_content

TURN_BREAK = "<TURN_BREAK>"
NO_OUTPUT = "MODEL_ACTION_NO_OUTPUT"
INVALID_ACTION = "INVALID_MODEL_ACTION"
SCHEMA_FAILED = "ACTION_SCHEMA_VALIDATION_FAILED"
TRUNCATED = "MODEL_ACTION_TRUNCATED"


def truncation_outcome(code: str, message: str, action_ids: int, max_action_tokens: int) -> tuple[str, str]:
    """An unparsable or schema-failing action that used all ``max_action_tokens`` ids was cut
    off, not wrong: it gets its own code (the one rule the collector and verify share)."""
    if code in (INVALID_ACTION, SCHEMA_FAILED) and action_ids >= max_action_tokens:
        return TRUNCATED, f"the action was cut at max_action_tokens ({max_action_tokens}): {message}"
    return code, message


@dataclass
class CandidateEpisode:
    """Mutable state of one candidate while its episode runs."""

    candidate_index: int
    prompt_ids: list[int]
    protocol_error_reward: float
    max_recoverable_errors: int
    capacity_retries: int = 0
    pieces: list[dict[str, Any]] = field(default_factory=list)
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    exchanges: list[dict[str, Any]] = field(default_factory=list)
    step_values: list[float] = field(default_factory=list)
    protocol_errors: int = 0
    recoverable_errors: int = 0
    steps: int = 0
    model_tokens: int = 0
    model_latency_ms: float = 0.0
    termination: str | None = None
    protocol_error_code: str | None = None
    harness_code: str | None = None
    final_state: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.pieces.append({"kind": "context", "ids": list(self.prompt_ids)})
        self.context_ids = list(self.prompt_ids)

    @property
    def live(self) -> bool:
        return self.termination is None

    # ----------------------------------------------------------------- recording
    def record_action(self, ids: list[int], logprobs: list[float], text: str, latency_ms: float) -> None:
        self.pieces.append({"kind": "action", "ids": list(ids), "logprobs": list(logprobs)})
        self.context_ids.extend(ids)
        self.trajectory.append({"role": "assistant", "kind": "action", "content": text})
        self.model_tokens += len(ids)
        self.model_latency_ms += latency_ms

    def append_observation_tokens(
        self, turn: tuple[list[int], list[int], list[int]], *, warning: bool
    ) -> None:
        before, content, after = turn
        self.pieces.append({"kind": "context", "ids": list(before)})
        self.pieces.append({"kind": "observation", "ids": list(content), "warning": warning})
        self.pieces.append({"kind": "context", "ids": list(after)})
        self.context_ids.extend(before)
        self.context_ids.extend(content)
        self.context_ids.extend(after)

    def record_harness_error(self, code: str, message: str) -> str:
        """Invalid or missing action: harness segment, penalty, ``invalid_model_action``."""
        content = harness_error_content(code, message)
        self.trajectory.append(
            {
                "role": "tool",
                "kind": "observation",
                "content": content,
                "warning_prefix_len": len(content.encode("utf-8")),
            }
        )
        self.harness_code = code
        self.termination = "invalid_model_action"
        return content

    def record_observation(self, action: dict[str, Any], wire: dict[str, Any], value: float, content: str) -> None:
        if not math.isfinite(value):
            raise EnvironmentProtocolError("the environment sent a non-finite reward")
        self.steps += 1
        self.step_values.append(value)
        self.trajectory.append({"role": "tool", "kind": "observation", "content": content})
        self.exchanges.append(
            {
                "step_index": len(self.exchanges),
                "action": action,
                "result": {"kind": "observation", "observation": wire},
            }
        )
        if bool(wire.get("done")):
            self.termination = "done"

    def record_protocol_error(self, action: dict[str, Any], error: dict[str, Any], recoverable: bool) -> str:
        """R3.13: budgeted same-episode feedback for recoverable codes; terminal codes end it."""
        continued = recoverable and self.recoverable_errors < self.max_recoverable_errors
        if recoverable:
            self.recoverable_errors += 1
        self.steps += 1
        self.protocol_errors += 1
        content = protocol_error_content(error, continued)
        self.trajectory.append(
            {
                "role": "tool",
                "kind": "observation",
                "content": content,
                "warning_prefix_len": len(content.encode("utf-8")),
            }
        )
        self.exchanges.append(
            {
                "step_index": len(self.exchanges),
                "action": action,
                "result": {"kind": "protocol_error", "error": error, "continued": continued},
            }
        )
        if not continued:
            self.termination = "protocol_error"
            self.protocol_error_code = str(error.get("code"))
        return content

    # ----------------------------------------------------------------- outcome
    @property
    def episode_return(self) -> float:
        """Σ step values + penalty × protocol errors (+ penalty once for an invalid action)."""
        total = 0.0
        for value in self.step_values:
            total += value
        total += self.protocol_error_reward * self.protocol_errors
        if self.termination == "invalid_model_action":
            total += self.protocol_error_reward
        return total

    @property
    def terminal_done(self) -> bool:
        return self.termination == "done"

    def action_texts(self) -> list[str]:
        return [seg["content"] for seg in self.trajectory if seg["kind"] == "action"]


def now_ms() -> float:
    return time.perf_counter() * 1000.0
