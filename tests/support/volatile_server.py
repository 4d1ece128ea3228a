"""An OpenEnv environment with volatile fields, built with the real ``openenv`` package (the live
replay drift report's test server).

Each step answers a seeded count plus one fresh ``nonce`` (``uuid4``) at a depth that depends on
the step index: step 0 ``observation.nonce``, step 1 ``observation.stats.nonce``, step 2 and later
``observation.trace.span.nonce``. So a replay of a three-step episode drifts in three fields at
three depths, and ``result.observation.**.nonce`` covers all of them. The episode never ends by
itself. ``--random-reset``: the reset observation carries a ``draw`` from an unseeded generator
(the environment ignores the seed), which no replay can match. Run:
``python -m tests.support.volatile_server --port P [--max-concurrent-envs N] [--random-reset]``.
"""

from __future__ import annotations

import argparse
import random
import uuid
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

RANDOM_RESET = False  # set by --random-reset before the app is built


class VolatileAction(Action):
    amount: int = Field(ge=1, le=5, description="How much to add to the count (1-5)")


class VolatileObservation(Observation):
    count: int = 0
    input_text: str = ""
    nonce: Optional[str] = None
    stats: Optional[dict[str, Any]] = None
    trace: Optional[dict[str, Any]] = None
    draw: Optional[int] = None


class VolatileState(State):
    count: int = 0


class VolatileEnvironment(Environment[VolatileAction, VolatileObservation, VolatileState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = VolatileState(episode_id=None, step_count=0)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="volatile", description="Count up; replies carry fresh nonces.",
                                   version="0.1.0", author="kiln")

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> VolatileObservation:
        self._state = VolatileState(episode_id=f"seed-{seed}", step_count=0, count=random.Random(seed).randint(0, 3))
        draw = random.SystemRandom().randint(0, 10**9) if RANDOM_RESET else None
        return VolatileObservation(count=self._state.count, input_text=f"Count is {self._state.count}.", draw=draw)

    def step(self, action: VolatileAction, timeout_s: Optional[float] = None, **kwargs: Any) -> VolatileObservation:
        index = self._state.step_count
        self._state.step_count += 1
        self._state.count += action.amount
        nonce = uuid.uuid4().hex
        observation = VolatileObservation(count=self._state.count, input_text=f"Count is {self._state.count}.",
                                          reward=1.0, done=False)
        if index == 0:
            observation.nonce = nonce
        elif index == 1:
            observation.stats = {"nonce": nonce, "steps": self._state.step_count}
        else:
            observation.trace = {"span": {"nonce": nonce, "depth": 2}}
        return observation

    @property
    def state(self) -> VolatileState:
        return self._state


def build_app(max_concurrent_envs: int = 1) -> Any:
    return create_app(VolatileEnvironment, VolatileAction, VolatileObservation, env_name="volatile",
                      max_concurrent_envs=max_concurrent_envs)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    global RANDOM_RESET
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-concurrent-envs", type=int, default=1)
    parser.add_argument("--random-reset", action="store_true")
    args = parser.parse_args(argv)
    RANDOM_RESET = args.random_reset
    uvicorn.run(build_app(args.max_concurrent_envs), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
