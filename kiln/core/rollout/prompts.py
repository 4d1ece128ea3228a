"""The policy's prompt: a versioned, deterministic system prompt and observation content.

Offline verification recomputes these texts, so any change here must bump ``PROMPT_VERSION``.
How MCP tool calls are shown is versioned by the identity's ``tool_calls``
(:mod:`kiln.core.openenv.tool_calls`): the same prompt version renders both forms.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from kiln.core.canonical import canonical_json
from kiln.core.openenv.mcp_tools import tools_prompt_block

PROMPT_VERSION = "kiln.openenv-prompt.v3"  # v3: MCP tools listed in the system prompt

_SYSTEM_TEMPLATE = """You are acting in the OpenEnv environment "{name}".
Environment description: {description}

Each turn, reply with exactly one JSON object that validates against this action JSON Schema:
{schema}

Reply with the JSON object only: no Markdown, no commentary, no code fences.
When an observation has a non-empty "input_text", that text is your decision prompt; otherwise the
full observation JSON (observation, reward, done, and optional metadata) is shown to you."""


def system_prompt(
    metadata: dict[str, Any],
    policy_action_schema: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
    tool_calls: str | None = None,
) -> str:
    """System text naming the environment and embedding the compact action schema, then the MCP
    tools when the environment offers any (``tool_calls``: the identity's tool-call form version,
    see :func:`kiln.core.openenv.mcp_tools.tools_prompt_block`)."""
    return _SYSTEM_TEMPLATE.format(
        name=str(metadata.get("name", "")),
        description=str(metadata.get("description", "")),
        schema=canonical_json(policy_action_schema).decode("utf-8"),
    ) + tools_prompt_block(tools, tool_calls)


def observation_content(wire: dict[str, Any], label: Literal["reset result", "step result"]) -> str:
    """``input_text`` verbatim when it is a non-blank string, else the labelled compact wire JSON."""
    observation = wire.get("observation")
    if isinstance(observation, dict):
        text = observation.get("input_text")
        if isinstance(text, str) and text.strip():
            return text
    return f"OpenEnv {label} (observation, reward, done, and optional metadata JSON):\n" + canonical_json(wire).decode(
        "utf-8"
    )


def initial_messages(
    metadata: dict[str, Any],
    policy_action_schema: dict[str, Any],
    reset_wire: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
    tool_calls: str | None = None,
) -> list[dict[str, str]]:
    """``[system, user]`` for a candidate; identical across a group."""
    return [
        {"role": "system", "content": system_prompt(metadata, policy_action_schema, tools, tool_calls)},
        {"role": "user", "content": observation_content(reset_wire, "reset result")},
    ]


def harness_error_content(code: str, message: str) -> str:
    """Content of the harness error segment (invalid or missing model action)."""
    return json.dumps(
        {"openenv_harness_error": {"code": code, "message": message}, "done": True},
        separators=(",", ":"),
        ensure_ascii=False,
    )


def protocol_error_content(error: dict[str, Any], continued: bool) -> str:
    """Content of a protocol-error observation segment."""
    return json.dumps(
        {"openenv_error": error, "recoverable": continued, "done": not continued},
        separators=(",", ":"),
        ensure_ascii=False,
    )
