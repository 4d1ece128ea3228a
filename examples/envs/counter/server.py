"""Counter: a multi-step, seeded, deterministic OpenEnv environment a tiny model can learn.

Reset picks a target in 8..12 from the seed (``random.Random(seed)``), the count starts at 0. Each
step adds ``amount`` (1..5). Reward per step: ``1.0`` while the new count stays at or below the
target, ``0.0`` and done on overshoot; reaching the target exactly ends the episode. The best
policy adds small amounts (1 each turn gives the maximal return ``min(target, max_steps)``),
which a tiny model can learn from group-relative advantages.

Knobs (for tests): ``schema_variant`` adds an optional field to the action schema (a different
environment identity); ``max_concurrent_envs`` allows several sessions; ``drift_step`` (replay
tests) makes every episode answer reward ``0.5`` at that step index instead of the normal reward,
with the same identity (metadata, schemas, OpenAPI), so only a live replay can notice.
"""

from __future__ import annotations

import random
import uuid
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

MIN_TARGET = 8
MAX_TARGET = 12


class CounterAction(Action):
    amount: int = Field(ge=1, le=5, description="How much to add to the count (1-5)")


class CounterActionV2(CounterAction):
    note: Optional[str] = Field(default=None, max_length=40)


class CounterObservation(Observation):
    count: int = 0
    target: int = 0
    input_text: str = ""


class CounterState(State):
    count: int = 0
    target: int = 0
    seed: Optional[int] = None


class CounterEnvironment(Environment[CounterAction, CounterObservation, CounterState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = CounterState(episode_id=None, step_count=0)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="counter",
            description="Count up to the target without going over; small steps score more.",
            version="0.1.0",
            author="kiln",
        )

    def _text(self) -> str:
        return f"Count is {self._state.count}. Target is {self._state.target}."

    def reset(
        self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any
    ) -> CounterObservation:
        rng = random.Random(seed)
        target = rng.randint(MIN_TARGET, MAX_TARGET)
        self._state = CounterState(
            episode_id=episode_id or (f"seed-{seed}" if seed is not None else str(uuid.uuid4())),
            step_count=0,
            count=0,
            target=target,
            seed=seed,
        )
        return CounterObservation(count=0, target=target, input_text=self._text(), reward=None)

    def step(
        self, action: CounterAction, timeout_s: Optional[float] = None, **kwargs: Any
    ) -> CounterObservation:
        self._state.step_count += 1
        self._state.count += action.amount
        count, target = self._state.count, self._state.target
        if count > target:
            return CounterObservation(
                count=count, target=target, input_text=self._text(), reward=0.0, done=True,
                metadata={"overshoot": True},
            )
        return CounterObservation(
            count=count, target=target, input_text=self._text(), reward=1.0,
            done=count == target,
        )

    @property
    def state(self) -> CounterState:
        return self._state


DRIFT_REWARD = 0.5


def _drifting(drift_step: int) -> type[CounterEnvironment]:
    """A counter whose step ``drift_step`` (0-based) answers reward ``DRIFT_REWARD``."""

    class DriftingCounterEnvironment(CounterEnvironment):
        def step(
            self, action: CounterAction, timeout_s: Optional[float] = None, **kwargs: Any
        ) -> CounterObservation:
            index = self._state.step_count
            observation = super().step(action, timeout_s=timeout_s, **kwargs)
            if index == drift_step:
                observation.reward = DRIFT_REWARD
            return observation

    return DriftingCounterEnvironment


def build_app(
    *, max_concurrent_envs: int = 8, schema_variant: int = 1, drift_step: int | None = None
) -> Any:
    action_cls = CounterActionV2 if schema_variant == 2 else CounterAction
    env_cls = CounterEnvironment if drift_step is None else _drifting(drift_step)
    return create_app(
        env_cls,
        action_cls,
        CounterObservation,
        env_name="counter",
        max_concurrent_envs=max_concurrent_envs,
        state_cls=CounterState,
    )
