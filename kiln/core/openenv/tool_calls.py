"""MCP tool calls as actions: the action schema shown to the policy and the local check of a call.

Owns ``kiln.openenv-tool-calls.v1``: when an environment lists MCP tools (``identity.tools``) and
its advertised action schema has a tool-call form (an object with a ``tool_name`` property, at the
top level or as one variant of a ``oneOf``/``anyOf``), the policy is shown — and a constrained
policy is decoded under — a union with one variant per listed tool::

    {"anyOf": [{"type": "object",
                "properties": {"type": {"const": "call_tool"},      # when the form has one
                               "tool_name": {"const": "<tool>"},
                               "arguments": <the tool's inputSchema>},
                "required": [..., "tool_name", "arguments"], "additionalProperties": false},
               ...one per tool..., ...the form's other variants, without list_tools...]}

The tool's ``inputSchema`` loses ``$schema``/``$id`` (Kiln validates with JSON Schema 2020-12),
gets ``type: object`` when it names none, and one holding local ``$ref``s moves under
``$defs/kiln_tool_<i>`` with its references rewritten, so every tool keeps its own definitions.

A call is checked locally before it is sent (:class:`ToolCallValidator`): against the advertised
schema, then against the variant of the tool it names — a call to an unlisted tool, or with
arguments its tool's schema refuses, fails ``ACTION_SCHEMA_VALIDATION_FAILED`` and never reaches
the environment. Which form a run used is recorded in its identity (``identity.tool_calls``);
identities without it (inspected before this version) keep the generic call form, so their
bundles still verify.
"""

from __future__ import annotations

import copy
from typing import Any

from kiln.core.errors import InvalidActionSchema
from kiln.core.openenv.schema import (
    SCHEMA_DATA_KEYWORDS,
    ActionValidator,
    json_pointer,
    policy_action_schema,
    resolve_local_ref,
)

TOOL_CALLS_VERSION = "kiln.openenv-tool-calls.v1"
_TOOL_DEF = "kiln_tool_{index}"


def _is_call_form(node: Any) -> bool:
    properties = node.get("properties") if isinstance(node, dict) else None
    return isinstance(properties, dict) and "tool_name" in properties


def _is_list_tools(node: Any) -> bool:
    properties = node.get("properties") if isinstance(node, dict) else None
    kind = properties.get("type") if isinstance(properties, dict) else None
    return isinstance(kind, dict) and kind.get("const") == "list_tools"


def _rewrite_refs(node: Any, prefix: str) -> None:
    if isinstance(node, list):
        for item in node:
            _rewrite_refs(item, prefix)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in ("$ref", "$dynamicRef") and isinstance(value, str) and value.startswith("#"):
                node[key] = prefix + value[1:]
            elif key not in SCHEMA_DATA_KEYWORDS:
                _rewrite_refs(value, prefix)


def _has_refs(node: Any) -> bool:
    if isinstance(node, list):
        return any(_has_refs(item) for item in node)
    if isinstance(node, dict):
        return any(
            key in ("$ref", "$dynamicRef") or (key not in SCHEMA_DATA_KEYWORDS and _has_refs(v))
            for key, v in node.items()
        )
    return False


def _arguments_schema(input_schema: dict, index: int, definitions: dict) -> dict:
    """The tool's input schema as the ``arguments`` subschema (references kept working)."""
    schema = {k: copy.deepcopy(v) for k, v in input_schema.items() if k not in ("$schema", "$id")}
    schema.setdefault("type", "object")
    if not _has_refs(schema):
        return schema
    name = _TOOL_DEF.format(index=index)
    _rewrite_refs(schema, f"#/$defs/{name}")
    definitions[name] = schema
    return {"$ref": f"#/$defs/{name}"}


def tool_call_schema(action_schema: dict, tools: list[dict[str, Any]]) -> dict | None:
    """The union of one call variant per tool, or None when the schema has no tool-call form."""
    shown = policy_action_schema(action_schema)
    given_definitions = shown.get("$defs")
    root_definitions = given_definitions if isinstance(given_definitions, dict) else {}
    if _is_call_form(shown):
        form, others = shown, []
    else:
        variants = shown.get("oneOf") or shown.get("anyOf")
        if not isinstance(variants, list):
            return None
        resolved = [resolve_local_ref(v, shown) for v in variants]
        forms = [v for v in resolved if _is_call_form(v)]
        if len(forms) != 1:
            return None
        form = forms[0]
        others = [v for v, r in zip(variants, resolved) if r is not form and not _is_list_tools(r)]
    definitions = copy.deepcopy(root_definitions)
    required = [name for name in form.get("required") or [] if isinstance(name, str)]
    calls = []
    for index, tool in enumerate(tools):
        properties: dict[str, Any] = {}
        for name, sub in form["properties"].items():
            if name == "metadata" and name not in required:
                continue  # the inherited optional metadata is not shown to the policy
            if name == "tool_name":
                properties[name] = {"type": "string", "const": tool["name"]}
            elif name == "arguments":
                properties[name] = _arguments_schema(tool["input_schema"], index, definitions)
            else:
                properties[name] = copy.deepcopy(sub)
        properties.setdefault("arguments", _arguments_schema(tool["input_schema"], index, definitions))
        call_required = [*required, *(n for n in ("tool_name", "arguments") if n not in required)]
        call = {
            "type": "object",
            "title": f"call {tool['name']}",
            "properties": properties,
            "required": call_required,
            "additionalProperties": False,
        }
        if tool.get("description"):
            call["description"] = tool["description"]
        calls.append(call)
    union: dict[str, Any] = {"anyOf": [*calls, *copy.deepcopy(others)]}
    if definitions:
        union["$defs"] = definitions
    return union


class ToolCallValidator:
    """Validates an action against the advertised schema, then a call against its named tool."""

    def __init__(self, advertised: ActionValidator, shown: dict, tools: list[dict[str, Any]]) -> None:
        self.advertised = advertised
        self.shown = shown
        definitions = shown.get("$defs")
        self._calls: dict[str, tuple[int, ActionValidator]] = {}
        for index, tool in enumerate(tools):
            variant = dict(shown["anyOf"][index])
            if definitions:
                variant["$defs"] = definitions
            try:
                compiled = ActionValidator.compile(variant)
            except InvalidActionSchema as exc:
                raise InvalidActionSchema(
                    f"the input schema of MCP tool #{index} does not compile: {exc.message}"
                ) from None
            self._calls.setdefault(tool["name"], (index, compiled))
        others = shown["anyOf"][len(tools) :]
        self._others = (
            ActionValidator.compile({**({"$defs": definitions} if definitions else {}), "anyOf": others})
            if others
            else None
        )

    def issues(self, action: object) -> tuple[list[dict[str, str]], bool]:
        found, truncated = self.advertised.issues(action)
        if found:
            return found, truncated
        if isinstance(action, dict) and "tool_name" in action:
            named = self._calls.get(action["tool_name"]) if isinstance(action["tool_name"], str) else None
            if named is None:  # not a listed tool: the const of every call variant fails
                return [{"keyword": "const", "instance_path": "/tool_name", "schema_path": "/anyOf"}], False
            index, validator = named
            found, truncated = validator.issues(action)
            for issue in found:
                issue["schema_path"] = json_pointer(["anyOf", index]) + issue["schema_path"].lstrip("$")
            return found, truncated
        if self._others is not None:
            return self._others.issues(action)
        return [{"keyword": "anyOf", "instance_path": "$", "schema_path": "/anyOf"}], False

    def validate(self, action: object) -> list[dict]:
        """``[]`` when valid, else at most four ``{keyword, instance_path, schema_path}`` issues."""
        return self.issues(action)[0]

    def is_valid(self, action: object) -> bool:
        return not self.validate(action)


ActionContract = tuple[dict, "ActionValidator | ToolCallValidator"]


def action_contract(inspection: dict) -> ActionContract:
    """The schema shown to the policy and the validator of its answers, for one inspection."""
    action_schema = inspection["schema"]["action"]
    advertised = ActionValidator.compile(action_schema)
    identity = inspection.get("identity") or {}
    tools = identity.get("tools")
    if tools and identity.get("tool_calls") == TOOL_CALLS_VERSION:
        union = tool_call_schema(action_schema, tools)
        if union is not None:
            return union, ToolCallValidator(advertised, union, tools)
    return policy_action_schema(action_schema), advertised
