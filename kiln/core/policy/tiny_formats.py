"""The warm-up formats of the tiny demo model: what its synthetic transcripts say, per game.

The tiny model (:mod:`kiln.core.policy.tiny`) learns an action *format* before RL: its supervised
warm-up writes conversations shaped like one environment's episodes, with actions drawn at random
and independent of the text, so the warmed-up policy writes valid actions while every choice is
left to RL. A :class:`WarmupFormat` is one such shape. ``counter`` (the default, defined in
:mod:`kiln.core.policy.tiny`) is the counter environment's ``{"amount": N}``; :data:`GUESS` is
``examples/envs/guess``'s ``{"guess": N}``: its system prompt as Kiln writes it, the game's opening
line, then feedback on the previous guess ("too low" / "too high", now and then a lost guess) with
the guesses left, and guesses uniform over ``1..64`` (the feedback is random too: the warm-up
teaches the format, never the search).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WarmupFormat:
    """One game's transcript shape: ``kiln_system`` a Kiln-written system prompt, ``systems`` and
    ``extra_corpus`` generic texts, ``turns`` the episode lengths drawn, ``user(rng, turn,
    previous_action)`` an observation, ``action(rng)`` a random action object, ``reasoning`` short
    thoughts, ``steps`` the warm-up's optimizer steps."""

    name: str
    kiln_system: Callable[[random.Random], str]
    systems: Sequence[str]
    turns: Sequence[int]
    user: Callable[[random.Random, int, dict[str, Any] | None], str]
    action: Callable[[random.Random], dict[str, Any]]
    reasoning: Sequence[str]
    extra_corpus: Sequence[str]
    steps: int


GUESS_LOW, GUESS_HIGH, GUESS_STEPS = 1, 64, 8
GUESS_WARMUP_STEPS = 320

_GUESS_REASONING = ["", "", "", "I will guess a number.", "Pick one.", "Try another number.", "OK."]
_GUESS_SYSTEMS = [
    "You are playing a guessing game. Reply with one JSON action.",
    "Guess the secret number. Answer only with a JSON object.",
    "You are a policy. Each turn, output an action as JSON.",
]


def _guess_system(rng: random.Random) -> str:
    from kiln.core.rollout.prompts import system_prompt

    schema = {
        "additionalProperties": False,
        "properties": {
            "guess": {
                "description": f"Your guess: a whole number from {GUESS_LOW} to {GUESS_HIGH}",
                "title": "Guess",
                "type": "integer",
            }
        },
        "required": ["guess"],
        "title": "GuessAction",
        "type": "object",
    }
    metadata = {
        "name": "guess",
        "description": f"Find the secret number from {GUESS_LOW} to {GUESS_HIGH} in at most {GUESS_STEPS} guesses; "
        "each answer says only whether the guess was too low or too high.",
    }
    return system_prompt(metadata, schema)


def _guess_user(rng: random.Random, turn: int, previous: dict[str, Any] | None) -> str:
    if previous is None:
        return f"I picked a number from {GUESS_LOW} to {GUESS_HIGH}. You have {GUESS_STEPS} guesses."
    g = previous["guess"]
    roll = rng.random()
    if roll < 0.45:
        said = f"{g} is too low."
    elif roll < 0.9:
        said = f"{g} is too high."
    else:
        said = f"You already guessed {g}; that guess is lost."
    return f"{said} {max(1, GUESS_STEPS - turn)} guesses left."


GUESS = WarmupFormat(
    name="guess",
    kiln_system=_guess_system,
    systems=_GUESS_SYSTEMS,
    turns=tuple(range(1, GUESS_STEPS + 1)),
    user=_guess_user,
    action=lambda rng: {"guess": rng.randint(GUESS_LOW, GUESS_HIGH)},
    reasoning=_GUESS_REASONING,
    extra_corpus=[f"{n} is too low. {n} is too high." for n in range(GUESS_LOW, GUESS_HIGH + 1)],
    # 8-turn episodes with two-digit actions: more steps than the counter's for the same reliability
    steps=GUESS_WARMUP_STEPS,
)
