"""Guess the number: multi-turn, sparse delayed reward, recoverable errors, state across turns.

Reset picks a secret in ``1..64`` from the seed (``random.Random(seed)``). Each step the policy
guesses a whole number; the observation says only whether *that* guess was too low or too high,
so the policy must carry the interval it has narrowed down across turns (binary search finds any
secret in at most 7 guesses). An episode lasts up to ``MAX_STEPS`` (8) guesses.

- **Sparse, delayed reward**: every step pays 0 except the last one. Guessing the secret ends the
  episode with ``1 + (MAX_STEPS − guesses used) / MAX_STEPS`` (faster pays more); running out of
  guesses ends it with 0.
- **Recoverable errors**: a guess outside ``1..64`` or one already made is answered with an error
  observation (``metadata.error``); it uses up the step, the episode goes on.

Guessing uniformly without repeats finds the secret in 8 guesses 12.5 % of the time (8 of 64); a
policy that keeps the interval wins every episode.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import (
    Action,
    EnvironmentMetadata,
    Observation,
    State,
)
from pydantic import Field

LOW, HIGH = 1, 64
MAX_STEPS = 8


class GuessAction(Action):
    guess: int = Field(description=f"Your guess: a whole number from {LOW} to {HIGH}")


class GuessObservation(Observation):
    feedback: str = ""  # "start" | "low" | "high" | "correct" | "out_of_range" | "repeated"
    guesses_left: int = MAX_STEPS
    input_text: str = ""


class GuessState(State):
    secret: int = 0
    guesses: list[int] = Field(default_factory=list)
    seed: int | None = None


_TEXT = {
    "low": "{g} is too low.",
    "high": "{g} is too high.",
    "correct": "{g} is correct!",
    "out_of_range": f"{{g}} is not a number from {LOW} to {HIGH}; that guess is lost.",
    "repeated": "You already guessed {g}; that guess is lost.",
}


class GuessEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState(episode_id=None, step_count=0)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="guess",
            description=f"Find the secret number from {LOW} to {HIGH} in at most {MAX_STEPS} guesses; "
            "each answer says only whether the guess was too low or too high.",
            version="0.1.0",
            author="kiln",
        )

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._state = GuessState(
            episode_id=episode_id or (f"seed-{seed}" if seed is not None else str(uuid.uuid4())),
            step_count=0, secret=random.Random(seed).randint(LOW, HIGH), seed=seed)
        text = f"I picked a number from {LOW} to {HIGH}. You have {MAX_STEPS} guesses."
        return GuessObservation(feedback="start", guesses_left=MAX_STEPS, input_text=text, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        state = self._state
        state.step_count += 1
        left = MAX_STEPS - state.step_count
        g = action.guess
        error = None
        if not LOW <= g <= HIGH:
            feedback = error = "out_of_range"
        elif g in state.guesses:
            feedback = error = "repeated"
        else:
            feedback = "correct" if g == state.secret else ("low" if g < state.secret else "high")
        state.guesses.append(g)
        won = feedback == "correct"
        done = won or left == 0
        reward = (1.0 + left / MAX_STEPS) if won else 0.0
        text = _TEXT[feedback].format(g=g) + ("" if done else f" {left} guesses left.")
        return GuessObservation(feedback=feedback, guesses_left=left, input_text=text, reward=reward, done=done,
                                metadata={"error": error} if error else {})

    @property
    def state(self) -> GuessState:
        return self._state


def build_app(*, max_concurrent_envs: int = 8, schema_variant: int = 1) -> Any:
    """The FastAPI app (``schema_variant`` is accepted for the shared example-env CLI and ignored)."""
    return create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                      max_concurrent_envs=max_concurrent_envs, state_cls=GuessState)
