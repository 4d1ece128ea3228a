"""An OpenEnv environment whose rewards come from a delayed rubric (RFC 004), built with the real
``openenv`` package: ``openenv.core.rubrics.ExponentialDiscountingTrajectoryRubric``.

Reach ``TARGET`` by adding 1-5 per step. The episode ends after ``EPISODE_STEPS`` steps. The rubric
answers ``INTERMEDIATE_REWARD`` on every step before the last and, on the ``done`` step, its
trajectory score: 1.0 when the final count is ``TARGET``, else ``MISS_SCORE``. Its discounted
per-step credit (``compute_step_rewards``) stays on the server, as the protocol has it.
Run: ``python -m tests.support.rubric_server --port P``.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from openenv.core.rubrics import ExponentialDiscountingTrajectoryRubric
from pydantic import Field

TARGET = 10
EPISODE_STEPS = 3
INTERMEDIATE_REWARD = -0.125  # binary-exact, so the expected returns are exact
MISS_SCORE = 0.25


class ReachAction(Action):
    amount: int = Field(ge=1, le=5, description="How much to add to the count (1-5)")


class ReachObservation(Observation):
    count: int = 0
    input_text: str = ""


class ReachState(State):
    count: int = 0


class ReachRubric(ExponentialDiscountingTrajectoryRubric):
    def score_trajectory(self, trajectory: list[tuple[Any, Any]]) -> float:
        _, final = trajectory[-1]
        return 1.0 if final.count == TARGET else MISS_SCORE


class ReachEnvironment(Environment[ReachAction, ReachObservation, ReachState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__(rubric=ReachRubric(gamma=0.5, intermediate_reward=INTERMEDIATE_REWARD))
        self._state = ReachState(episode_id=None, step_count=0)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="reach", description=f"Reach exactly {TARGET} in {EPISODE_STEPS} steps.",
                                   version="0.1.0", author="kiln")

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> ReachObservation:
        self._reset_rubric()
        self._state = ReachState(episode_id=f"seed-{seed}", step_count=0, count=0)
        return ReachObservation(count=0, input_text=f"Count is 0; reach {TARGET}.")

    def step(self, action: ReachAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ReachObservation:
        self._state.step_count += 1
        self._state.count += action.amount
        observation = ReachObservation(count=self._state.count, input_text=f"Count is {self._state.count}.",
                                       done=self._state.step_count >= EPISODE_STEPS)
        observation.reward = self._apply_rubric(action, observation)
        return observation

    @property
    def state(self) -> ReachState:
        return self._state


def build_app(max_concurrent_envs: int = 4) -> Any:
    return create_app(ReachEnvironment, ReachAction, ReachObservation, env_name="reach",
                      max_concurrent_envs=max_concurrent_envs)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
