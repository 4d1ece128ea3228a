"""Inspecting an environment server: discovery, identity and revalidation.

Owns: the discovery order (``/health`` first, then ``/metadata``, ``/schema``,
``/list_environments``, ``/openapi.json``), payload shape checks, the
``kiln.openenv-identity.v1`` object with its two canonical digests, action-schema compilation
before success, and naming the fields that drifted between two inspections.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kiln.core.canonical import canonical_json, digest_json
from kiln.core.errors import EnvironmentProtocolError, HarnessUnsupported, KilnError
from kiln.core.openenv.credentials import authentication_label, prepare_token
from kiln.core.openenv.httpio import check_health, make_client, request_json
from kiln.core.openenv.mcp_tools import list_tools
from kiln.core.openenv.schema import ActionValidator
from kiln.core.openenv.tool_calls import TOOL_CALLS_VERSION, action_contract
from kiln.core.openenv.urls import EnvironmentUrl, coerce_url

IDENTITY_SCHEMA = "kiln.openenv-identity.v1"
DISCOVERY_SCHEMA = "kiln.openenv-discovery.v1"
INSPECTION_SCHEMA = "kiln.openenv-inspection.v1"
CLIENT_PROFILE = "openenv-http/1.x"

_METADATA_OPTIONAL = ("readme_content", "version", "author", "documentation_url")
_IDENTITY_FIELDS = (
    "schema",
    "client_profile",
    "base_url",
    "websocket_url",
    "authentication",
    "openapi_version",
    "environments",
    "metadata",
    "schema_sha256",
    "tools",
)
_SCHEMA_FIELDS = ("action", "observation", "state")


def _protocol(url: str, reason: str) -> EnvironmentProtocolError:
    return EnvironmentProtocolError(f"GET {url}: {reason}", details={"url": url})


def check_metadata(value: Any, url: str) -> dict:
    """An object with string ``name``/``description``; optional nullable strings."""
    if not isinstance(value, dict):
        raise _protocol(url, "metadata is not a JSON object")
    for key in ("name", "description"):
        if not isinstance(value.get(key), str):
            raise _protocol(url, f"metadata.{key} is missing or not a string")
    for key in _METADATA_OPTIONAL:
        if key in value and value[key] is not None and not isinstance(value[key], str):
            raise _protocol(url, f"metadata.{key} is not a string or null")
    return value


def check_schema_document(value: Any, url: str) -> dict:
    """An object holding ``action``, ``observation`` and ``state``."""
    if not isinstance(value, dict):
        raise _protocol(url, "schema document is not a JSON object")
    for key in _SCHEMA_FIELDS:
        if key not in value:
            raise _protocol(url, f"schema document has no {key!r} entry")
    return value


def check_environments(value: Any, url: str) -> list:
    """An array of strings."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _protocol(url, "list_environments is not an array of strings")
    return value


def openapi_version_of(openapi: Any) -> str | None:
    """The string at ``/info/version`` of the OpenAPI document, else ``None``."""
    if isinstance(openapi, dict):
        info = openapi.get("info")
        if isinstance(info, dict) and isinstance(info.get("version"), str):
            return info["version"]
    return None


def discovery_digest(metadata: Any, schema: Any, environments: Any, openapi: Any, tools: Any = None) -> str:
    """``discovery_sha256`` over the canonical discovery object (MCP tools when offered)."""
    document = {
        "schema": DISCOVERY_SCHEMA,
        "metadata": metadata,
        "environment_schema": schema,
        "environments": environments,
        "openapi": openapi,
    }
    if tools:
        document["tools"] = tools
    return digest_json(document)


def build_identity(
    url: EnvironmentUrl,
    *,
    metadata: dict,
    schema: dict,
    environments: list,
    openapi: Any,
    authentication: str = "none",
    tools: list | None = None,
) -> dict:
    """The ``kiln.openenv-identity.v1`` object; ``tools`` (and ``tool_calls``, the version of
    the tool-call form, :mod:`kiln.core.openenv.tool_calls`) only for MCP environments."""
    identity = {
        "schema": IDENTITY_SCHEMA,
        "client_profile": CLIENT_PROFILE,
        "base_url": url.base_url,
        "websocket_url": url.websocket_url,
        "authentication": authentication,
        "openapi_version": openapi_version_of(openapi),
        "environments": environments,
        "metadata": metadata,
        "schema_sha256": digest_json(schema),
        "discovery_sha256": discovery_digest(metadata, schema, environments, openapi, tools),
    }
    if tools:
        identity["tools"] = tools
        identity["tools_sha256"] = digest_json(tools)
        identity["tool_calls"] = TOOL_CALLS_VERSION  # how calls are shown and checked
    return identity


def refuse_harness(action_schema: dict, base_url: str) -> None:
    """An OpenEnv agent harness (RFC 005; its action schema is openenv's ``HarnessAction``: one
    ``message`` string) is refused: its turns are run by the harness's own agent and model, so
    there is no policy action for Kiln to sample, record or train (docs/openenv.md)."""
    if action_schema.get("title") == "HarnessAction" and "message" in (action_schema.get("required") or []):
        raise HarnessUnsupported(
            f"{base_url} is an OpenEnv agent harness (its action is HarnessAction, one message to an "
            "agent that runs its own model): Kiln trains the policy that chooses the actions, so it "
            "cannot collect from a harness",
            hint="serve the environment the harness wraps (its tools as an MCP environment, or its "
            "actions as a plain OpenEnv environment) and point Kiln at that",
            details={"environment_url": base_url},
        )


async def inspect_environment(
    url: str | EnvironmentUrl,
    *,
    bearer_token: str | None = None,
    connect_timeout_s: float = 10.0,
    timeout_s: float = 60.0,
) -> dict:
    """Inspect one server: ``{"identity": {...}, "schema": <raw /schema>}``.

    Raises ``EnvironmentUnavailable`` (unreachable, non-2xx, redirect), ``EnvironmentProtocolError``
    (bad or oversized body, reflected credential) or ``InvalidActionSchema``.
    """
    env_url = coerce_url(url)
    token = prepare_token(env_url, bearer_token)
    async with make_client(bearer_token=token, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s) as client:
        await check_health(client, env_url.route("/health"), timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)

        async def get(path: str, ok_statuses: tuple[int, ...] = ()) -> tuple[int, Any]:
            return await request_json(
                client,
                "GET",
                env_url.route(path),
                bearer_token=token,
                timeout_s=timeout_s,
                connect_timeout_s=connect_timeout_s,
                ok_statuses=ok_statuses,
            )

        results = await asyncio.gather(
            get("/metadata"),
            get("/schema"),
            get("/list_environments", ok_statuses=(404,)),
            get("/openapi.json"),
            return_exceptions=True,
        )
        tools = None
        answered = [r for r in results if not isinstance(r, BaseException)]
        if len(answered) == len(results) and _offers_mcp(answered[3][1]):
            try:
                tools = await list_tools(
                    client, env_url, bearer_token=token, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s
                )
            except KilnError:
                tools = None  # a broken /mcp is "no tools", never a failed inspection
    for result in results:  # report the first failure in route order (deterministic)
        if isinstance(result, BaseException):
            raise result
    (_, metadata), (_, schema), (env_status, environments), (_, openapi) = results  # type: ignore[misc]  # no exception is left
    metadata = check_metadata(metadata, env_url.route("/metadata"))
    schema = check_schema_document(schema, env_url.route("/schema"))
    # Older servers (openenv-core 0.3.0) have no /list_environments: no environments, no Task API.
    environments = [] if env_status == 404 else check_environments(environments, env_url.route("/list_environments"))
    refuse_harness(schema["action"], env_url.base_url)
    ActionValidator.compile(schema["action"])
    identity = build_identity(
        env_url,
        metadata=metadata,
        schema=schema,
        environments=environments,
        openapi=openapi,
        authentication=authentication_label(token),
        tools=tools,
    )
    inspection = {"identity": identity, "schema": schema}
    action_contract(inspection)  # every listed tool's input schema compiles (else InvalidActionSchema)
    return inspection


def _offers_mcp(openapi: Any) -> bool:
    """The OpenAPI document lists ``POST /mcp`` (servers without it are never asked)."""
    paths = openapi.get("paths") if isinstance(openapi, dict) else None
    route = paths.get("/mcp") if isinstance(paths, dict) else None
    return isinstance(route, dict) and "post" in route


def _same(a: Any, b: Any) -> bool:
    # Canonical bytes, not ``==``: 1 == 1.0 == True in Python but not on the wire.
    try:
        return canonical_json(a) == canonical_json(b)
    except (TypeError, ValueError):
        return a == b


def identity_differences(first: dict, second: dict) -> list[str]:
    """The closed labels of fields that differ between two inspections, in a fixed order."""
    a_id, b_id = first.get("identity", {}), second.get("identity", {})
    labels = [f"identity.{f}" for f in _IDENTITY_FIELDS if not _same(a_id.get(f), b_id.get(f))]
    if "discovery_sha256" in a_id and not _same(a_id.get("discovery_sha256"), b_id.get("discovery_sha256")):
        labels.append("identity.discovery_sha256")
    a_schema, b_schema = first.get("schema", {}), second.get("schema", {})
    for field in _SCHEMA_FIELDS:
        if (
            not isinstance(a_schema, dict)
            or not isinstance(b_schema, dict)
            or not _same(a_schema.get(field), b_schema.get(field))
        ):
            labels.append(f"schema.{field}")
    return labels
