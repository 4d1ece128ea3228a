"""Grammar bounds for every JSON type (issue 25): a constrained action always parses with Kiln's
bounded parser and validates locally, for every JSON Schema construct the tightening supports.

Three layers: the tightened schema carries the bounds (structure), the compiled xgrammar grammar
refuses what Kiln's parser refuses (a 42-digit integer, ``1e999``, a fifth free key...), and a
random policy (random logits, temperature 1, thinking off) sampled 256 times per schema shape under
the grammar produces 0 unparseable, 0 locally invalid and 0 truncated answers at the default
``max_action_tokens``.
"""

from __future__ import annotations

import pytest

from kiln.core.boundedjson import MAX_INT_DIGITS
from kiln.core.openenv.schema import ActionValidator
from kiln.core.policy.grammar_schema import (
    DEFAULT_MAX_STRING_CHARS,
    FREE_KEY_PATTERN,
    FREE_MAX_PROPERTIES,
    FREE_VALUE_DEF,
    MAX_ARRAY_ITEMS,
    MAX_INTEGER_DIGITS,
    MAX_MULTIPLES,
    MAX_NUMBER_MAGNITUDE,
    grammar_schema,
)
from tests.support.grammar_sampling import grammar_cache, random_policy_tokenizer, sample_random_actions

pytestmark = pytest.mark.timeout(120)

LIMIT = 10**MAX_INTEGER_DIGITS - 1
FREE_REF = {"$ref": f"#/$defs/{FREE_VALUE_DEF}"}


def _obj(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


def _prop(schema: dict, name: str = "x") -> dict:
    return grammar_schema(_obj(**{name: schema}))["properties"][name]


# ---------------------------------------------------------------- the tightened schema
def test_integer_digits_fit_kilns_parser() -> None:
    assert MAX_INTEGER_DIGITS <= MAX_INT_DIGITS
    assert _prop({"type": "integer"}) == {"type": "integer", "minimum": -LIMIT, "maximum": LIMIT}


@pytest.mark.parametrize(
    ("given", "low", "high"),
    [
        ({"minimum": -7, "maximum": 1234}, -7, 1234),
        ({"exclusiveMinimum": 0, "exclusiveMaximum": 10}, 1, 9),
        ({"exclusiveMinimum": 0.5, "maximum": 2.5}, 1, 2),
        ({"minimum": 0}, 0, LIMIT),
        ({"maximum": 10**30}, -LIMIT, LIMIT),
        # a range wholly beyond the limit keeps its own bounds (within Kiln's parser)
        ({"minimum": -(10**30), "exclusiveMaximum": -(10**20)}, -(10**30), -(10**20) - 1),
    ],
)
def test_integer_bounds_intersect_the_schemas(given: dict, low: int, high: int) -> None:
    tight = _prop({"type": "integer", **given})
    assert (tight["minimum"], tight["maximum"]) == (low, high)
    assert "exclusiveMinimum" not in tight and "exclusiveMaximum" not in tight


def test_integer_multiple_of_keeps_at_most_max_multiples() -> None:
    tight = _prop({"type": "integer", "multipleOf": 5})
    assert tight["multipleOf"] == 5
    assert (tight["maximum"] - tight["minimum"]) // 5 + 1 == MAX_MULTIPLES
    assert tight["minimum"] % 5 == 0 and tight["minimum"] <= 0 <= tight["maximum"]
    small = _prop({"type": "integer", "multipleOf": 3, "minimum": 1, "maximum": 20})
    assert (small["minimum"], small["maximum"]) == (1, 20)  # 6 multiples: the schema's own range


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {"minimum": -MAX_NUMBER_MAGNITUDE, "maximum": MAX_NUMBER_MAGNITUDE}),
        ({"minimum": -10.5, "maximum": 100}, {"minimum": -10.5, "maximum": 100}),
        ({"exclusiveMinimum": 0, "exclusiveMaximum": 1}, {"exclusiveMinimum": 0, "exclusiveMaximum": 1}),
        ({"minimum": 0, "exclusiveMinimum": 0}, {"exclusiveMinimum": 0, "maximum": MAX_NUMBER_MAGNITUDE}),
        ({"minimum": -1e300}, {"minimum": -MAX_NUMBER_MAGNITUDE, "maximum": MAX_NUMBER_MAGNITUDE}),
    ],
)
def test_number_bounds_are_finite_and_one_keyword_per_side(given: dict, expected: dict) -> None:
    assert _prop({"type": "number", **given}) == {"type": "number", **expected}


def test_strings_bounded_respecting_min_and_max_length() -> None:
    assert _prop({"type": "string"})["maxLength"] == DEFAULT_MAX_STRING_CHARS
    assert _prop({"type": "string", "minLength": 3})["pattern"].endswith(f"{{3,{DEFAULT_MAX_STRING_CHARS}}}$")
    assert _prop({"type": "string", "maxLength": 5})["pattern"].endswith("{0,5}$")
    assert _prop({"type": "string", "minLength": 100})["pattern"].endswith("{100,100}$")
    assert _prop({"type": "string", "enum": ["a"]}) == {"type": "string", "enum": ["a"]}


@pytest.mark.parametrize(
    ("given", "most"),
    [
        ({}, MAX_ARRAY_ITEMS),
        ({"maxItems": 3}, 3),
        ({"minItems": 12}, 12),
        ({"minItems": 2, "maxItems": 100}, MAX_ARRAY_ITEMS),
        ({"uniqueItems": True}, 1),
    ],
)
def test_arrays_bounded_respecting_min_and_max_items(given: dict, most: int) -> None:
    tight = _prop({"type": "array", "items": {"type": "integer"}, **given})
    assert tight["maxItems"] == most
    assert tight["items"]["maximum"] == LIMIT
    assert _prop({"type": "array"})["items"] == FREE_REF  # no items: free values


def test_free_form_objects_bounded_keys_count_and_depth() -> None:
    for free in ({"type": "object"}, {"type": "object", "additionalProperties": True}):
        tight = grammar_schema(_obj(x=free))
        prop = tight["properties"]["x"]
        assert prop["maxProperties"] == FREE_MAX_PROPERTIES
        assert prop["propertyNames"] == {"pattern": FREE_KEY_PATTERN}
        assert prop["additionalProperties"] == FREE_REF
        value = tight["$defs"][FREE_VALUE_DEF]["anyOf"]
        nested = [v for v in value if v.get("type") in ("array", "object")]
        # one level of arrays/objects below a free value, and only scalars in them: depth 2
        assert {v.get("type") for v in nested} == {"array", "object"}
        assert all(v.get("items", v.get("additionalProperties"))["$ref"].endswith("kiln_free_scalar") for v in nested)
    typed = _prop({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2})
    assert typed["additionalProperties"]["maximum"] == LIMIT and typed["maxProperties"] == 2


def test_declared_objects_get_no_extra_properties() -> None:
    tight = grammar_schema({**_obj(a={"type": "integer"}), "additionalProperties": True})
    assert tight["additionalProperties"] is False
    no_arguments = _prop({"type": "object", "properties": {}})  # a tool without arguments
    assert no_arguments["additionalProperties"] is False and "maxProperties" not in no_arguments
    free = _prop({"type": "object", "properties": {}, "additionalProperties": True})
    assert free["additionalProperties"] == FREE_REF and free["maxProperties"] == FREE_MAX_PROPERTIES


def test_unions_type_lists_refs_and_data_keywords() -> None:
    schema = {
        "$defs": {"N": {"type": "integer"}},
        **_obj(
            a={"anyOf": [{"type": "integer"}, {"type": "null"}]},
            b={"type": ["number", "string"]},
            c={"$ref": "#/$defs/N"},
            d={"const": 10**50},
            e={},
        ),
    }
    tight = grammar_schema(schema)
    props = tight["properties"]
    assert props["a"]["anyOf"][0]["maximum"] == LIMIT
    assert [v["type"] for v in props["b"]["anyOf"]] == ["number", "string"]
    assert props["b"]["anyOf"][0]["maximum"] == MAX_NUMBER_MAGNITUDE
    assert props["b"]["anyOf"][1]["maxLength"] == DEFAULT_MAX_STRING_CHARS
    assert tight["$defs"]["N"]["maximum"] == LIMIT
    assert props["d"] == {"const": 10**50}  # data is never rewritten
    assert props["e"] == FREE_REF
    assert schema["properties"]["e"] == {}  # the input is not modified


# ---------------------------------------------------------------- the compiled grammar
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return random_policy_tokenizer(tmp_path_factory.mktemp("random-policy-tokenizer"))


@pytest.fixture(scope="module")
def cache(tokenizer):
    return grammar_cache(tokenizer)


def _accepts(cache, schema: dict, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(cache.get(schema).compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        (_obj(x={"type": "integer"}), '{"x": -999999999999999}', '{"x": ' + "9" * 42 + "}"),
        (_obj(x={"type": "integer"}), '{"x": 7}', '{"x": 1000000000000000}'),
        (_obj(x={"type": "integer", "minimum": 1, "maximum": 5}), '{"x": 5}', '{"x": 6}'),
        (_obj(x={"type": "number"}), '{"x": -12.5}', '{"x": 1e999}'),
        (_obj(x={"type": "number", "exclusiveMinimum": 0, "maximum": 1}), '{"x": 0.25}', '{"x": 0}'),
        (_obj(x={"type": "object"}), '{"x": {"a": 1, "b": [true, null]}}', '{"x": {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}}'),
        (_obj(x={"type": "object"}), '{"x": {"a": {"b": 1}}}', '{"x": {"a": {"b": {"c": 1}}}}'),
        (_obj(x={"additionalProperties": True, "type": "object"}), '{"x": {"k_1": "v"}}', '{"x": {"' + "k" * 17 + '": 1}}'),
        (_obj(x={"type": "array", "items": {"type": "integer"}}), '{"x": [1, 2]}', '{"x": [' + ", ".join(["1"] * 9) + "]}"),
        (_obj(x={"type": "array", "minItems": 2, "items": {"type": "boolean"}}), '{"x": [true, false]}', '{"x": [true]}'),
    ],
)
def test_grammar_refuses_what_kiln_cannot_parse_or_validate(cache, schema: dict, good: str, bad: str) -> None:
    assert _accepts(cache, schema, good)
    assert not _accepts(cache, schema, bad)


def test_action_grammar_exposes_the_tightened_schema(cache) -> None:
    import json

    from kiln.core.canonical import sha256_bytes

    schema = _obj(x={"type": "integer"})
    grammar = cache.get(schema)
    assert json.loads(grammar.schema_json) == grammar_schema(schema)
    assert grammar.grammar_schema_sha256 == sha256_bytes(grammar.schema_json.encode("utf-8"))
    assert grammar.identity()["bounds"]["max_integer_digits"] == MAX_INTEGER_DIGITS


# ---------------------------------------------------------------- random sampling
SHAPES = {
    "integer_unbounded": _obj(x={"type": "integer"}),
    "integer_bounded": _obj(
        x={"type": "integer", "minimum": -7, "maximum": 1234},
        y={"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        z={"type": "integer", "multipleOf": 7},
    ),
    "number_unbounded": _obj(x={"type": "number"}),
    "number_bounded": _obj(
        x={"type": "number", "minimum": -10.5, "maximum": 100},
        y={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    ),
    "free_object": _obj(params={"type": "object", "additionalProperties": True}, meta={"type": "object"}, any={}),
    "arrays": _obj(
        a={"type": "array", "items": {"type": "integer"}},
        b={"type": "array", "minItems": 2, "maxItems": 3, "items": {"type": "string"}},
        c={"type": "array"},
        u={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "uniqueItems": True},
    ),
    "unions": {
        "$defs": {"Kind": {"enum": ["a", "b"], "type": "string"}},
        **_obj(
            v={"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
            w={"type": ["number", "boolean"]},
            r={"$ref": "#/$defs/Kind"},
            k={
                "oneOf": [
                    _obj(kind={"const": "a"}, n={"type": "integer"}),
                    _obj(kind={"const": "b"}, s={"type": "string", "minLength": 2}),
                ]
            },
        ),
    },
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_random_policy_256_answers_all_parse_and_validate(cache, tokenizer, shape: str) -> None:
    schema = SHAPES[shape]
    outcomes = sample_random_actions(cache, tokenizer, schema, ActionValidator.compile(schema), n=256)
    assert outcomes.count("valid") == 256, {code: outcomes.count(code) for code in set(outcomes.codes)}
    assert outcomes.count("MODEL_ACTION_TRUNCATED") == 0
