"""OpenEnv servers with the properties of public environments (issue 12), built with the real
``openenv`` package. Each has ONE property on top of the counter game; Kiln must handle the
property, never the server.

* ``uuid_episode``: a fresh random uuid ``episode_id`` in state on every reset (most public envs).
* ``seed_ignoring``: part of the reset (a ``side``) ignores the seed.
* ``clock_metadata``: every step observation carries a wall-clock ``metadata.execution_time``.
* ``mcp_tools``: an MCP-style tool environment (``call_tool`` / ``list_tools`` actions, null
  rewards); ``--tool-variant 2`` changes one tool's input schema.

All keep openenv's default of one session unless ``--max-concurrent-envs`` says otherwise.
Run: ``python -m tests.support.wild_servers NAME --port P``.
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import (
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
    Tool,
)
from openenv.core.env_server.types import (
    Action,
    EnvironmentMetadata,
    Observation,
    State,
)

from examples.envs.counter.server import (
    CounterAction,
    CounterEnvironment,
    CounterObservation,
    CounterState,
)


class UuidEpisodeCounter(CounterEnvironment):
    """The counter, but ``episode_id`` is a new uuid4 on every reset, whatever was asked."""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CounterObservation:
        observation = super().reset(seed=seed, **kwargs)
        self._state.episode_id = str(uuid.uuid4())
        return observation


class SideObservation(CounterObservation):
    side: str = ""


class SideState(CounterState):
    side: str = ""


class SeedIgnoringCounter(CounterEnvironment):
    """The counter, plus a ``side`` drawn from an unseeded generator at every reset."""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SideObservation:
        base = super().reset(seed=seed, episode_id=episode_id, **kwargs)
        side = random.SystemRandom().choice(["white", "black"]) + "-" + uuid.uuid4().hex[:6]
        self._state = SideState(**self._state.model_dump(), side=side)
        return SideObservation(**base.model_dump(), side=side)


class ClockCounter(CounterEnvironment):
    """The counter, plus the wall-clock seconds each step took in ``metadata.execution_time``."""

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> CounterObservation:
        started = time.perf_counter()
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        observation.metadata = {**observation.metadata, "execution_time": time.perf_counter() - started}
        return observation


class ToolState(State):
    total: int = 0


def _tools(variant: int) -> list[Tool]:
    add_schema: dict[str, Any] = {
        "type": "object",
        "properties": {"amount": {"type": "integer", "minimum": 1, "maximum": 5 if variant == 1 else 9}},
        "required": ["amount"],
    }
    return [
        Tool(name="add", description="Add an amount to the running total.", input_schema=add_schema),
        Tool(name="total", description="Read the running total.", input_schema={"type": "object", "properties": {}}),
    ]


def _mcp_env(variant: int) -> type:
    class McpToolEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state = ToolState(episode_id=None, step_count=0)

        def get_metadata(self) -> EnvironmentMetadata:
            return EnvironmentMetadata(name="tools", description="Call tools to reach a total of 6.", version="0.1.0")

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
            self._state = ToolState(episode_id=f"seed-{seed}", step_count=0)
            return CallToolObservation(tool_name="", result="Reach a total of 6.", reward=None)

        def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
            if isinstance(action, ListToolsAction):
                return ListToolsObservation(tools=_tools(variant))
            self._state.step_count += 1
            if action.tool_name == "add":
                self._state.total += int(action.arguments.get("amount", 0))
            done = self._state.total >= 6
            return CallToolObservation(
                tool_name=action.tool_name, result={"total": self._state.total},
                reward=None if not done else float(self._state.total == 6), done=done,
            )

        @property
        def state(self) -> ToolState:
            return self._state

    return McpToolEnvironment


SERVERS: dict[str, tuple[type, type, type]] = {
    "uuid_episode": (UuidEpisodeCounter, CounterObservation, CounterState),
    "seed_ignoring": (SeedIgnoringCounter, SideObservation, SideState),
    "clock_metadata": (ClockCounter, CounterObservation, CounterState),
}


def build_app(name: str, *, max_concurrent_envs: int = 1, tool_variant: int = 1) -> Any:
    if name == "mcp_tools":
        return create_app(
            _mcp_env(tool_variant), CallToolAction, CallToolObservation, env_name="tools",
            max_concurrent_envs=max_concurrent_envs, state_cls=ToolState,
        )
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
    parser.add_argument("name", choices=sorted([*SERVERS, "mcp_tools"]))
    parser.add_argument("--tool-variant", type=int, default=1)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-concurrent-envs", type=int, default=1)
    args = parser.parse_args(argv)
    app = build_app(args.name, max_concurrent_envs=args.max_concurrent_envs, tool_variant=args.tool_variant)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
