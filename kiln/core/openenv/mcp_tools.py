"""MCP tool discovery (protocol §2.4): the tools a tool-calling environment offers.

Owns: ``tools/list`` over ``POST /mcp`` (JSON-RPC 2.0), the normal form of a tool list
(``[{"name", "description", "input_schema"}]`` in the server's order), and the answer "this
environment has no MCP tools" (404/405 on ``/mcp``, or any JSON-RPC error such as -32603
"Environment does not support MCP"). Tools go into the identity (and its digests) and the prompt;
:mod:`kiln.core.openenv.tool_calls` turns them into the action schema's call variants.
"""

from __future__ import annotations

from typing import Any

import httpx

from kiln.core.errors import EnvironmentProtocolError
from kiln.core.openenv.httpio import request_json
from kiln.core.openenv.urls import EnvironmentUrl

MAX_TOOLS = 256
_LIST_REQUEST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}


def normalize_tools(value: Any, url: str) -> list[dict[str, Any]]:
    """``[{"name", "description", "input_schema"}]`` from a ``tools/list`` result."""
    tools = value.get("tools") if isinstance(value, dict) else None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise EnvironmentProtocolError(f"POST {url}: tools/list result has no tool list (or over {MAX_TOOLS})")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise EnvironmentProtocolError(f"POST {url}: a listed tool has no string name")
        schema = tool.get("input_schema", tool.get("inputSchema", {}))
        out.append(
            {
                "name": tool["name"],
                "description": str(tool.get("description") or ""),
                "input_schema": schema if isinstance(schema, dict) else {},
            }
        )
    return out


async def list_tools(
    client: httpx.AsyncClient,
    url: EnvironmentUrl,
    *,
    bearer_token: str | None,
    timeout_s: float,
    connect_timeout_s: float,
) -> list[dict[str, Any]] | None:
    """The environment's MCP tools, or None when it offers none."""
    route = url.route("/mcp")
    status, body = await request_json(
        client,
        "POST",
        route,
        json_body=_LIST_REQUEST,
        bearer_token=bearer_token,
        timeout_s=timeout_s,
        connect_timeout_s=connect_timeout_s,
        ok_statuses=(404, 405, 422),
    )
    if status != 200 or not isinstance(body, dict) or "error" in body or "result" not in body:
        return None
    tools = normalize_tools(body["result"], route)
    return tools or None


def tools_prompt_block(tools: list[dict[str, Any]] | None, tool_calls: str | None = None) -> str:
    """The prompt paragraph listing the tools (empty when there are none).

    With ``tool_calls`` (``kiln.openenv-tool-calls.v1``) the action schema above it already holds
    one call variant per tool with the tool's input schema, so the paragraph lists names and
    descriptions only; without it (identities inspected before), the generic call form and each
    tool's input schema, as before.
    """
    if not tools:
        return ""
    from kiln.core.canonical import canonical_json

    if tool_calls:
        listed = [{"name": tool["name"], "description": tool["description"]} for tool in tools]
        return (
            "\n\nTools this environment offers (the action schema has one variant per tool: call one "
            "per turn, tool_name naming it and arguments matching its input schema):\n"
            + canonical_json(listed).decode("utf-8")
        )
    return (
        "\n\nTools this environment offers (call one per turn with "
        '{"type": "call_tool", "tool_name": NAME, "arguments": {...}} matching its input_schema):\n'
        + canonical_json(tools).decode("utf-8")
    )
