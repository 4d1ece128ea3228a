"""One candidate's episode state: token pieces, text trajectory, replay exchanges and outcome.

The collector (``kiln.core.rollout.group``) drives several of these in lock-step; this module owns the
bookkeeping rules of an episode (steps, errors, rewards, segments) so they exist in exactly one place.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from kiln.core.errors import EnvironmentProtocolError
from kiln.core.openenv.replies import RECOVERABLE_CODES
from kiln.core.rollout.context import TERMINATION as CONTEXT_TERMINATION
from kiln.core.rollout.context import context_record, has_room
from kiln.core.rollout.exchange import (
    action_segment,
    exchange_segment,
    harness_segment,
    observation_exchange,
    protocol_error_continues,
    protocol_error_exchange,
)

TURN_BREAK = "<TURN_BREAK>"


@dataclass
class CandidateEpisode:
    """Mutable state of one candidate while its episode runs."""

    candidate_index: int
    prompt_ids: list[int]
    protocol_error_reward: float
    max_recoverable_errors: int
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
    context_limit: int | None = None  # the served model's context (None: unknown, unchecked)
    max_action_tokens: int = 0
    penalise_context: bool = False  # context_policy end_penalised
    omitted_turn_tokens: int = 0  # ids of a final turn left out for want of context

    def __post_init__(self) -> None:
        self.pieces.append({"kind": "context", "ids": list(self.prompt_ids)})
        self.context_ids = list(self.prompt_ids)

    # ----------------------------------------------------------------- context
    def check_context(self) -> bool:
        """Before sampling: end the episode (``context_exhausted``) unless its prompt leaves room
        for a whole action; returns whether it may sample."""
        if self.live and not has_room(len(self.context_ids), self.max_action_tokens, self.context_limit):
            self.termination = CONTEXT_TERMINATION
        return self.live

    @property
    def context_exhausted(self) -> dict[str, Any] | None:
        """The replay record of an episode that hit the context (None when it did not)."""
        if self.context_limit is None or (self.termination != CONTEXT_TERMINATION and not self.omitted_turn_tokens):
            return None
        return context_record(self.context_limit, len(self.context_ids), self.omitted_turn_tokens)

    @property
    def live(self) -> bool:
        return self.termination is None

    # ----------------------------------------------------------------- recording
    def record_action(self, ids: list[int], logprobs: list[float], text: str, latency_ms: float) -> None:
        self.pieces.append({"kind": "action", "ids": list(ids), "logprobs": list(logprobs)})
        self.context_ids.extend(ids)
        self.trajectory.append(action_segment(text))
        self.model_tokens += len(ids)
        self.model_latency_ms += latency_ms

    def append_observation_tokens(self, turn: tuple[list[int], list[int], list[int]], *, warning: bool) -> None:
        before, content, after = turn
        size = len(before) + len(content) + len(after)
        if not has_room(len(self.context_ids) + size, self.max_action_tokens, self.context_limit):
            # The policy never sees this turn: its ids are left out, and a live episode ends here.
            self.omitted_turn_tokens = size
            if self.live:
                self.termination = CONTEXT_TERMINATION
            return
        self.pieces.append({"kind": "context", "ids": list(before)})
        self.pieces.append({"kind": "observation", "ids": list(content), "warning": warning})
        self.pieces.append({"kind": "context", "ids": list(after)})
        self.context_ids.extend(before)
        self.context_ids.extend(content)
        self.context_ids.extend(after)

    def record_harness_error(self, code: str, message: str) -> str:
        """Invalid or missing action: harness segment, penalty, ``invalid_model_action``."""
        segment = harness_segment(code, message)
        self.trajectory.append(segment)
        self.harness_code = code
        self.termination = "invalid_model_action"
        return segment["content"]

    def record_observation(self, action: dict[str, Any], wire: dict[str, Any], value: float) -> str:
        """A step answered by an observation; returns the content shown to the policy."""
        if not math.isfinite(value):
            raise EnvironmentProtocolError("the environment sent a non-finite reward")
        if not math.isfinite(sum(self.step_values, value)):
            raise EnvironmentProtocolError(
                "the environment's rewards overflow the episode return (sum is not a finite float)",
                hint="keep per-step rewards well below 1e308",
            )
        exchange = observation_exchange(len(self.exchanges), action, wire)
        segment = exchange_segment(exchange)
        self.steps += 1
        self.step_values.append(value)
        self.trajectory.append(segment)
        self.exchanges.append(exchange)
        if bool(exchange["result"]["observation"].get("done")):
            self.termination = "done"
        return segment["content"]

    def record_protocol_error(self, action: dict[str, Any], error: dict[str, Any]) -> str:
        """Budgeted same-episode feedback for recoverable codes; any other code ends it."""
        code = error.get("code")
        continued = protocol_error_continues(code, self.recoverable_errors, self.max_recoverable_errors)
        if code in RECOVERABLE_CODES:
            self.recoverable_errors += 1
        exchange = protocol_error_exchange(len(self.exchanges), action, error, continued)
        segment = exchange_segment(exchange)
        self.steps += 1
        self.protocol_errors += 1
        self.trajectory.append(segment)
        self.exchanges.append(exchange)
        if not continued:
            self.termination = "protocol_error"
            self.protocol_error_code = str(error.get("code"))
        return segment["content"]

    # ----------------------------------------------------------------- outcome
    @property
    def episode_return(self) -> float:
        """Σ step values + penalty × protocol errors (+ penalty once for an invalid action)."""
        total = 0.0
        for value in self.step_values:
            total += value
        total += self.protocol_error_reward * self.protocol_errors
        if self.termination == "invalid_model_action" or (
            self.termination == CONTEXT_TERMINATION and self.penalise_context
        ):
            total += self.protocol_error_reward
        return total

    @property
    def terminal_done(self) -> bool:
        return self.termination == "done"

    def action_texts(self) -> list[str]:
        return [seg["content"] for seg in self.trajectory if seg["kind"] == "action"]


def now_ms() -> float:
    return time.perf_counter() * 1000.0
