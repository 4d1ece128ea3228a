"""OpenEnv servers with the properties of public environments (issue 12), built with the real
``openenv`` package. Each has ONE property on top of the counter game; Kiln must handle the
property, never the server.

* ``uuid_episode``: a fresh random uuid ``episode_id`` in state on every reset (most public envs).
* ``seed_ignoring``: part of the reset (a ``side``) ignores the seed.

All keep openenv's default of one session unless ``--max-concurrent-envs`` says otherwise.
Run: ``python -m tests.support.wild_servers NAME --port P``.
"""

from __future__ import annotations

import argparse
import random
import uuid
from typing import Any, Optional

import uvicorn
from openenv.core.env_server.http_server import create_app

from examples.envs.counter.server import (
    CounterAction,
    CounterEnvironment,
    CounterObservation,
    CounterState,
)


class UuidEpisodeCounter(CounterEnvironment):
    """The counter, but ``episode_id`` is a new uuid4 on every reset, whatever was asked."""

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> CounterObservation:
        observation = super().reset(seed=seed, **kwargs)
        self._state.episode_id = str(uuid.uuid4())
        return observation


class SideObservation(CounterObservation):
    side: str = ""


class SideState(CounterState):
    side: str = ""


class SeedIgnoringCounter(CounterEnvironment):
    """The counter, plus a ``side`` drawn from an unseeded generator at every reset."""

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> SideObservation:
        base = super().reset(seed=seed, episode_id=episode_id, **kwargs)
        side = random.SystemRandom().choice(["white", "black"]) + "-" + uuid.uuid4().hex[:6]
        self._state = SideState(**self._state.model_dump(), side=side)
        return SideObservation(**base.model_dump(), side=side)


SERVERS: dict[str, tuple[type, type, type]] = {
    "uuid_episode": (UuidEpisodeCounter, CounterObservation, CounterState),
    "seed_ignoring": (SeedIgnoringCounter, SideObservation, SideState),
}


def build_app(name: str, *, max_concurrent_envs: int = 1) -> Any:
    env_cls, observation_cls, state_cls = SERVERS[name]
    return create_app(
        env_cls,
        CounterAction,
        observation_cls,
        env_name=name,
        max_concurrent_envs=max_concurrent_envs,
        state_cls=state_cls,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name", choices=sorted(SERVERS))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-concurrent-envs", type=int, default=1)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(args.name, max_concurrent_envs=args.max_concurrent_envs), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
