"""Action parsing, schema compilation/validation and rewards."""

import math

import pytest

from kiln.core.canonical import digest_json
from kiln.core.errors import EnvironmentProtocolError, InvalidActionSchema
from kiln.core.openenv.actions import (
    ActionParseError,
    ActionSchemaValidationError,
    parse_action_text,
    parse_and_validate_action,
)
from kiln.core.openenv.rewards import training_reward
from kiln.core.openenv.schema import ActionValidator, policy_action_schema

COUNTER_SCHEMA = {
    "$defs": {
        "Note": {"properties": {"text": {"maxLength": 40, "type": "string"},
                                "tag": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}},
                 "required": ["text"], "type": "object"},
        "Op": {"enum": ["add", "sub"], "type": "string"},
    },
    "additionalProperties": False,
    "properties": {
        "metadata": {"type": "object", "additionalProperties": True},
        "op": {"$ref": "#/$defs/Op", "default": "add"},
        "amount": {"type": "integer", "minimum": 1, "maximum": 10},
        "note": {"anyOf": [{"$ref": "#/$defs/Note"}, {"type": "null"}], "default": None},
    },
    "required": ["amount"],
    "title": "CounterAction",
    "type": "object",
}


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"amount": 2}', {"amount": 2}),
        ('  {"amount": 2}\n', {"amount": 2}),
        ('```json\n{"amount": 3}\n```', {"amount": 3}),
        ('```JSON {"amount": 3}```', {"amount": 3}),
        ('```\n{"op": "sub", "amount": 1}\n```  ', {"op": "sub", "amount": 1}),
    ],
)
def test_parse_ok(text, expected):
    assert parse_action_text(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("   \n", "empty"),
        ('```json\n{"amount": 3}', "opened a code fence but did not close it"),
        ('{"amount": 2} {"amount": 3}', "not exactly one JSON value"),
        ('I pick {"amount": 2}', "not exactly one JSON value"),
        ("[1, 2]", "not an object"),
        ('"secret-ish text"', "not an object"),
        ('{"amount": NaN}', "non-finite"),
        ('{"amount": 1e999}', "non-finite"),
    ],
)
def test_parse_errors_are_content_free(text, message):
    with pytest.raises(ActionParseError) as info:
        parse_action_text(text)
    assert info.value.code == "INVALID_MODEL_ACTION"
    assert message in info.value.message
    assert "amount" not in info.value.message and "secret" not in info.value.message


def test_validator_accepts_and_reports_pointers():
    validator = ActionValidator.compile(COUNTER_SCHEMA)
    assert validator.validate({"amount": 2, "op": "sub", "note": {"text": "hi"}}) == []
    issues = validator.validate({"amount": 0, "op": "mul", "colour": "red"})
    assert issues == [
        {"keyword": "additionalProperties", "instance_path": "$", "schema_path": "/additionalProperties"},
        {"keyword": "minimum", "instance_path": "/amount", "schema_path": "/properties/amount/minimum"},
        {"keyword": "enum", "instance_path": "/op", "schema_path": "/properties/op/enum"},
    ]
    # Key order does not matter: the digest is over canonical JSON.
    assert validator.action_schema_sha256 == digest_json(dict(reversed(list(COUNTER_SCHEMA.items()))))


def test_validation_truncates_to_four_and_never_echoes_content():
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in "abcdef"}}
    validator = ActionValidator.compile(schema)
    with pytest.raises(ActionSchemaValidationError) as info:
        parse_and_validate_action('{"a":"SECRETVALUE","b":"x","c":"x","d":"x","e":"x","f":"x"}', validator)
    assert info.value.code == "ACTION_SCHEMA_VALIDATION_FAILED"
    assert len(info.value.issues) == 4 and info.value.truncated
    assert [i["instance_path"] for i in info.value.issues] == ["/a", "/b", "/c", "/d"]
    assert "additional issues omitted" in info.value.message
    assert "SECRETVALUE" not in info.value.message


def test_long_pointer_is_capped():
    key = "k" * 300
    validator = ActionValidator.compile({"type": "object", "properties": {key: {"type": "integer"}}})
    (issue,) = validator.validate({key: "x"})
    assert len(issue["instance_path"].encode()) <= 192 and issue["instance_path"].endswith("...")


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "http://127.0.0.1:1/schema.json"},
        {"type": "object", "properties": {"x": {"$ref": "file:///etc/passwd"}}},
        {"$defs": {"A": {"$ref": "https://example.test/a#/x"}}, "properties": {"y": {"$ref": "#/$defs/A"}}},
        {"properties": {"x": {"$ref": "other.json#/a"}}},
        {"properties": {"x": {"$ref": "#/$defs/Missing"}}},
        {"type": "object", "properties": {"x": {"type": 12}}},
        {"properties": {"x": {"$id": "http://example.test/x", "type": "integer"}}},
        [],
    ],
)
def test_compile_rejects_without_echo(schema):
    with pytest.raises(InvalidActionSchema) as info:
        ActionValidator.compile(schema)
    assert info.value.code == "environment_protocol_error"
    for leak in ("127.0.0.1", "passwd", "example.test", "other.json", "Missing"):
        assert leak not in info.value.message


def test_ref_like_data_is_not_a_reference():
    schema = {"type": "object", "properties": {"x": {"const": {"$ref": "http://example.test"}}}}
    validator = ActionValidator.compile(schema)
    assert validator.validate({"x": {"$ref": "http://example.test"}}) == []


def test_policy_schema_drops_inherited_metadata():
    shown = policy_action_schema(COUNTER_SCHEMA)
    assert "metadata" not in shown["properties"]
    assert "metadata" in COUNTER_SCHEMA["properties"]  # the original is untouched
    assert list(shown["properties"]) == ["op", "amount", "note"]


@pytest.mark.parametrize(
    "value, expected",
    [(None, 0.0), (False, 0.0), (True, 1.0), (0, 0.0), (3, 3.0), (-2, -2.0), (0.5, 0.5), (-1.25, -1.25)],
)
def test_training_reward(value, expected):
    result = training_reward(value)
    assert type(result) is float and result == expected


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1", [1], {"r": 1}, 10**400])
def test_training_reward_rejects(value):
    with pytest.raises(EnvironmentProtocolError):
        training_reward(value)
