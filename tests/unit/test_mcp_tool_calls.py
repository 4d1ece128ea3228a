"""MCP tool calls by schema (issue 25): the action schema is a union over the listed tools,
discriminated by ``tool_name``, each with its own input schema as ``arguments``; unconstrained
calls are checked against the named tool before they are sent; a random constrained policy names a
listed tool with valid arguments.
"""

from __future__ import annotations

import copy

import pytest
from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

from kiln.core.errors import InvalidActionSchema
from kiln.core.openenv.mcp_tools import normalize_tools
from kiln.core.openenv.schema import ActionValidator, policy_action_schema
from kiln.core.openenv.tool_calls import TOOL_CALLS_VERSION, ToolCallValidator, action_contract, tool_call_schema
from kiln.core.rollout.exchange import SCHEMA_FAILED, judge_answer
from kiln.core.rollout.prompts import system_prompt
from tests.support.grammar_sampling import grammar_cache, random_policy_tokenizer, sample_random_actions
from tests.support.tool_servers import DESCRIPTIONS, TOOL_SCHEMAS, call_is_valid

pytestmark = pytest.mark.timeout(120)

CALL_SCHEMA = CallToolAction.model_json_schema()
TOOLS = normalize_tools(
    {"tools": [{"name": n, "description": DESCRIPTIONS[n], "inputSchema": s} for n, s in TOOL_SCHEMAS.items()]},
    "http://test/mcp",
)


def _inspection(tool_calls: str | None = TOOL_CALLS_VERSION, action: dict = CALL_SCHEMA) -> dict:
    identity = {"metadata": {"name": "three-tools", "description": "d"}, "tools": TOOLS}
    if tool_calls:
        identity["tool_calls"] = tool_calls
    return {"identity": identity, "schema": {"action": action}}


def test_union_has_one_variant_per_tool_with_its_input_schema() -> None:
    union = tool_call_schema(CALL_SCHEMA, TOOLS)
    calls = union["anyOf"]
    assert [c["properties"]["tool_name"]["const"] for c in calls] == ["move", "note", "configure"]
    for call in calls:
        assert list(call["properties"]) == ["type", "tool_name", "arguments"]  # metadata not shown
        assert call["required"] == ["tool_name", "arguments"] and call["additionalProperties"] is False
        assert call["properties"]["type"]["const"] == "call_tool"
    move = calls[0]["properties"]["arguments"]
    assert "$schema" not in move and move["properties"]["steps"] == {"type": "integer", "minimum": 1, "maximum": 3}
    # a tool with local references moves under $defs, its references rewritten
    assert calls[1]["properties"]["arguments"] == {"$ref": "#/$defs/kiln_tool_1"}
    assert union["$defs"]["kiln_tool_1"]["properties"]["tags"]["items"] == {"$ref": "#/$defs/kiln_tool_1/$defs/Tag"}
    ActionValidator.compile(union)  # a valid 2020-12 schema


def test_union_form_keeps_other_variants_and_drops_list_tools() -> None:
    game = {"type": "object", "properties": {"type": {"const": "move"}, "to": {"type": "integer"}}, "required": ["to"]}
    action = {
        "$defs": {"Call": CALL_SCHEMA, "List": ListToolsAction.model_json_schema(), "Game": game},
        "oneOf": [{"$ref": "#/$defs/Call"}, {"$ref": "#/$defs/List"}, {"$ref": "#/$defs/Game"}],
    }
    union = tool_call_schema(action, TOOLS)
    assert len(union["anyOf"]) == 4 and union["anyOf"][3] == {"$ref": "#/$defs/Game"}
    _, validator = action_contract(_inspection(action=action))
    assert validator.validate({"type": "move", "to": 3}) == []
    assert validator.validate({"type": "list_tools"})  # the tools are listed already: not an action
    assert tool_call_schema({"type": "object", "properties": {"x": {"type": "integer"}}}, TOOLS) is None


def test_unknown_tool_or_invalid_arguments_never_validate() -> None:
    shown, validator = action_contract(_inspection())
    assert isinstance(validator, ToolCallValidator)
    good = {"type": "call_tool", "tool_name": "move", "arguments": {"direction": "north", "steps": 2}}
    assert validator.validate(good) == []
    unknown = {"type": "call_tool", "tool_name": "jump", "arguments": {}}
    assert validator.validate(unknown) == [{"keyword": "const", "instance_path": "/tool_name", "schema_path": "/anyOf"}]
    bad_steps = {**good, "arguments": {"direction": "north", "steps": 9}}
    assert validator.validate(bad_steps) == [
        {"keyword": "maximum", "instance_path": "/arguments/steps", "schema_path": "/anyOf/0/properties/arguments/properties/steps/maximum"}
    ]
    bad_tag = {"tool_name": "note", "arguments": {"text": "x", "tags": ["much-too-long"]}}
    assert [i["keyword"] for i in validator.validate(bad_tag)] == ["maxLength"]
    # the generic call form (before) let all three through
    plain = ActionValidator.compile(CALL_SCHEMA)
    assert plain.validate(unknown) == [] and plain.validate(bad_steps) == []
    # what the collector records: a schema failure, never sent
    action, harness = judge_answer('{"tool_name": "jump", "arguments": {}}', validator)
    assert action is None and harness[0] == SCHEMA_FAILED


def test_identities_before_tool_calls_keep_the_generic_form() -> None:
    shown, validator = action_contract(_inspection(tool_calls=None))
    assert shown == policy_action_schema(CALL_SCHEMA) and isinstance(validator, ActionValidator)
    old = system_prompt({"name": "n"}, shown, TOOLS)
    assert '"input_schema"' in old and "call one per turn with" in old  # the v3 text, unchanged
    new_shown, _ = action_contract(_inspection())
    new = system_prompt({"name": "n"}, new_shown, TOOLS, TOOL_CALLS_VERSION)
    assert '"input_schema"' not in new and '"const":"configure"' in new and '"name":"configure"' in new


def test_a_tool_schema_that_does_not_compile_fails_the_inspection() -> None:
    tools = copy.deepcopy(TOOLS)
    tools[2]["input_schema"] = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}
    with pytest.raises(InvalidActionSchema) as info:
        action_contract({**_inspection(), "identity": {**_inspection()["identity"], "tools": tools}})
    assert "MCP tool #2" in info.value.message


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return random_policy_tokenizer(tmp_path_factory.mktemp("random-policy-tokenizer"))


def test_random_constrained_calls_name_a_listed_tool_with_valid_arguments(tokenizer) -> None:
    shown, validator = action_contract(_inspection())
    outcomes = sample_random_actions(grammar_cache(tokenizer), tokenizer, shown, validator, n=256)
    assert outcomes.count("valid") == 256, {c: outcomes.count(c) for c in set(outcomes.codes)}
    server_ok = [call_is_valid(a["tool_name"], a["arguments"]) for a in outcomes.actions]
    assert sum(server_ok) == 256  # the issue asks >= 95 %
    assert {a["tool_name"] for a in outcomes.actions} == {"move", "note", "configure"}
