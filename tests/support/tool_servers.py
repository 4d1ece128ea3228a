"""An MCP tool environment with three tools of different input schemas (issue 25), built with the
real ``openenv`` package: ``call_tool``/``list_tools`` actions and ``POST /mcp`` ``tools/list``.

* ``move``: an enum and a bounded integer (its schema names the draft-07 dialect, as many MCP
  servers' generated schemas do);
* ``note``: a free string, an array of ``$ref``-defined short strings, an optional nullable number;
* ``configure``: a free-form object (``additionalProperties: true``) and an unbounded integer.

The server checks each call itself with ``jsonschema`` against the tool's input schema: a call
to an unknown tool or with invalid arguments scores 0 (``result.valid: false``), a valid one 1.
An episode ends after ``CALLS_PER_EPISODE`` calls. Run:
``python -m tests.support.tool_servers --port P [--max-concurrent-envs N]``.
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import (
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
    Tool,
)
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State

from tests.support.server_main import serve_main

CALLS_PER_EPISODE = 3

TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "move": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "direction": {"type": "string", "enum": ["north", "south", "east", "west"]},
            "steps": {"type": "integer", "minimum": 1, "maximum": 3},
        },
        "required": ["direction", "steps"],
    },
    "note": {
        "type": "object",
        "$defs": {"Tag": {"type": "string", "maxLength": 8}},
        "properties": {
            "text": {"type": "string"},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}},
            "weight": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None},
        },
        "required": ["text", "tags"],
    },
    "configure": {
        "type": "object",
        "properties": {
            "options": {"type": "object", "additionalProperties": True},
            "level": {"type": "integer"},
        },
        "required": ["options"],
    },
}
DESCRIPTIONS = {
    "move": "Move a number of steps in a direction.",
    "note": "Write a note with tags.",
    "configure": "Set free-form options.",
}


def _validators() -> dict[str, Draft202012Validator]:
    out = {}
    for name, schema in TOOL_SCHEMAS.items():
        out[name] = Draft202012Validator({k: v for k, v in schema.items() if k != "$schema"})
    return out


def call_is_valid(tool_name: str, arguments: Any) -> bool:
    """What this server accepts: a listed tool, with arguments valid for its input schema."""
    validator = _validators().get(tool_name)
    return validator is not None and validator.is_valid(arguments)


class ToolState(State):
    calls: int = 0
    valid_calls: int = 0


class ThreeToolEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = ToolState(episode_id=None, step_count=0)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="three-tools", description="Call the tools with valid arguments.", version="0.1.0"
        )

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._state = ToolState(episode_id=f"seed-{seed}", step_count=0)
        return CallToolObservation(tool_name="", result="Call any tool.", reward=None)

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        if isinstance(action, ListToolsAction):
            return ListToolsObservation(
                tools=[Tool(name=n, description=DESCRIPTIONS[n], input_schema=s) for n, s in TOOL_SCHEMAS.items()]
            )
        self._state.step_count += 1
        self._state.calls += 1
        valid = call_is_valid(action.tool_name, action.arguments)
        self._state.valid_calls += valid
        return CallToolObservation(
            tool_name=action.tool_name,
            result={"valid": valid, "calls": self._state.calls},
            reward=float(valid),
            done=self._state.calls >= CALLS_PER_EPISODE,
        )

    @property
    def state(self) -> ToolState:
        return self._state


def build_app(max_concurrent_envs: int = 1) -> Any:
    return create_app(
        ThreeToolEnvironment, CallToolAction, CallToolObservation, env_name="three-tools",
        max_concurrent_envs=max_concurrent_envs, state_cls=ToolState,
    )


def main(argv: list[str] | None = None) -> None:
    serve_main(build_app, __doc__, argv)


if __name__ == "__main__":
    main()
