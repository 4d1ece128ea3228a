"""An OpenEnv environment whose observations grow each step, built with the real ``openenv``
package: a long episode outgrows a small model's context (the context guard's test server).

Reset (seeded) shows a short count; step ``k`` (1-based) adds ``amount`` (1..5) and answers an
``input_text`` holding ``GROWTH × k`` words of log, so the prompt grows faster each turn. Reward
1.0 per step; the episode never ends by itself (``max_steps`` or the context ends it). Run:
``python -m tests.support.growing_server --port P [--max-concurrent-envs N]``.
"""

from __future__ import annotations

import random
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

from tests.support.server_main import serve_main

GROWTH = 60  # words of log per step index


class GrowAction(Action):
    amount: int = Field(ge=1, le=5, description="How much to add to the count (1-5)")


class GrowObservation(Observation):
    count: int = 0
    input_text: str = ""


class GrowState(State):
    count: int = 0


class GrowingEnvironment(Environment[GrowAction, GrowObservation, GrowState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GrowState(episode_id=None, step_count=0)
        self._words: list[str] = []

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="growing", description="Count up; every observation repeats a longer log.",
            version="0.1.0", author="kiln",
        )

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GrowObservation:
        rng = random.Random(seed)
        self._words = [rng.choice(["count", "step", "target", "amount", "add"]) for _ in range(64)]
        self._state = GrowState(episode_id=episode_id or f"seed-{seed}", step_count=0, count=0)
        return GrowObservation(count=0, input_text="Count is 0.", reward=None)

    def step(self, action: GrowAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GrowObservation:
        self._state.step_count += 1
        self._state.count += action.amount
        words = GROWTH * self._state.step_count
        log = " ".join(self._words[i % len(self._words)] for i in range(words))
        text = f"Count is {self._state.count}. Log: {log}"
        return GrowObservation(count=self._state.count, input_text=text, reward=1.0, done=False)

    @property
    def state(self) -> GrowState:
        return self._state


def build_app(max_concurrent_envs: int = 1) -> Any:
    return create_app(
        GrowingEnvironment, GrowAction, GrowObservation, env_name="growing",
        max_concurrent_envs=max_concurrent_envs,
    )


def main(argv: list[str] | None = None) -> None:
    serve_main(build_app, __doc__, argv)


if __name__ == "__main__":
    main()
