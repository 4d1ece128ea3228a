"""The schema a decoding grammar is compiled from: the policy schema, tightened.

The rule (written out for users in ``docs/actions.md``): **every value the tightened schema
accepts parses with Kiln's bounded JSON parser and validates against the original schema**, and
every value it accepts is bounded in size, so a constrained action never overruns
``max_action_tokens`` because of the grammar. The tightening only removes choices; it never adds
one the original schema refuses.

A grammar generated straight from a JSON schema lets the model omit optional discriminators and
write strings, numbers, arrays and free-form objects of any size. This module rewrites a copy of
the schema, node by node:

* a property whose value is fixed (``const``, a one-value ``enum``, also through a local ``$ref``)
  is required, and so is an OpenAPI ``discriminator`` property in every variant;
* a string without ``enum``/``const``/``pattern``/``format`` is printable, escape-free and at most
  ``DEFAULT_MAX_STRING_CHARS`` characters long (``minLength``/a smaller ``maxLength`` kept);
* an integer gets ``minimum``/``maximum`` within ``±(10**MAX_INTEGER_DIGITS - 1)`` (the schema's
  own bounds, exclusive ones turned inclusive, intersected with that); with ``multipleOf`` the
  range is cut to at most ``MAX_MULTIPLES`` multiples (the grammar enumerates them);
* a number gets ``minimum``/``maximum`` within ``±MAX_NUMBER_MAGNITUDE`` (xgrammar then writes at
  most 16 integer and 6 fraction digits and no exponent: always finite);
* an array gets ``maxItems`` (at most ``MAX_ARRAY_ITEMS``, never below ``minItems``); with
  ``uniqueItems`` at most one item (one item is always unique); no ``items`` means free values;
* an object that declares properties gets no extra ones; a free-form object (no declared
  properties: ``additionalProperties: true``, an untyped ``object``) gets at most
  ``FREE_MAX_PROPERTIES`` keys matching ``FREE_KEY_PATTERN``, whose values are free values;
* an unconstrained value (``{}``, ``true``, annotations only) becomes a free value: a bounded
  scalar, or an array/object of bounded scalars (depth at most 2 below it);
* a ``type`` list becomes an ``anyOf`` of one-type copies, so each gets its type's bounds.

``const``/``enum`` values are data and never rewritten. What the compiler (xgrammar 0.2.8) does
not enforce — ``oneOf`` exclusivity between overlapping variants, ``not``, ``if``/``then``,
``multipleOf`` on numbers, ``uniqueItems`` with ``minItems > 1``, recursive ``$ref`` depth, an
environment's own ``pattern``/``format`` length — is listed in ``docs/actions.md``; actions are
validated locally either way.
"""

from __future__ import annotations

import copy
import math
from typing import Any, TypeVar

from kiln.core.boundedjson import MAX_INT_DIGITS
from kiln.core.openenv.schema import SCHEMA_DATA_KEYWORDS, resolve_local_ref

GRAMMAR_SCHEMA_VERSION = "kiln.action-grammar.v2"  # v2: bounds for every JSON type
DEFAULT_MAX_STRING_CHARS = 64
MAX_INTEGER_DIGITS = 15  # |n| < 10**15 < 2**53: exact in a 64-bit int and a double
MAX_NUMBER_MAGNITUDE = 10**15
MAX_MULTIPLES = 256
MAX_ARRAY_ITEMS = 8
FREE_MAX_PROPERTIES = 4
FREE_MAX_ITEMS = 4
FREE_STRING_CHARS = 16
FREE_KEY_PATTERN = "^[A-Za-z_][A-Za-z0-9_]{0,15}$"
FREE_SCALAR_DEF = "kiln_free_scalar"
FREE_VALUE_DEF = "kiln_free_value"

assert MAX_INTEGER_DIGITS <= MAX_INT_DIGITS  # every grammar integer passes Kiln's parser

_INTEGER_LIMIT = 10**MAX_INTEGER_DIGITS - 1
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
)
_STRING_SHAPED = ("maxLength", "enum", "const", "pattern", "format")
_OBJECT_KEYWORDS = frozenset(
    {
        "properties",
        "patternProperties",
        "additionalProperties",
        "propertyNames",
        "required",
        "minProperties",
        "maxProperties",
    }
)


def bounded_string_pattern(min_chars: int, max_chars: int) -> str:
    """Printable, no quote or backslash (so no escapes), no UTF-16 surrogate code point (a
    byte-level vocabulary can spell one in UTF-8, which no decoder accepts as text),
    ``min_chars``..``max_chars`` characters."""
    return f'^[^\\u0000-\\u001f"\\\\\\ud800-\\udfff]{{{min_chars},{max_chars}}}$'


def compiler_form(node: Any) -> Any:
    """A copy of a tightened schema for the grammar compiler: ``minLength``/``maxLength`` are left
    out of every string whose ``pattern`` is Kiln's own :func:`bounded_string_pattern` of exactly
    those lengths. The pattern already spells the bounds, and xgrammar ignores the lengths beside a
    pattern (with one warning per string), so the grammar is the same; the recorded tightened
    schema (and its digest) keep them. An environment's own patterns are left as they are."""
    if isinstance(node, list):
        return [compiler_form(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: compiler_form(value) for key, value in node.items()}
    low, high = out.get("minLength", 0), out.get("maxLength")
    if (
        isinstance(low, int)
        and isinstance(high, int)
        and isinstance(out.get("pattern"), str)
        and out["pattern"] == bounded_string_pattern(low, high)
    ):
        out.pop("minLength", None)
        out.pop("maxLength")
    return out


def _free_definitions() -> dict[str, Any]:
    scalar = {
        "anyOf": [
            {"type": "string", "maxLength": FREE_STRING_CHARS, "pattern": bounded_string_pattern(0, FREE_STRING_CHARS)},
            {"type": "integer", "minimum": -_INTEGER_LIMIT, "maximum": _INTEGER_LIMIT},
            {"type": "boolean"},
            {"type": "null"},
        ]
    }
    ref = {"$ref": f"#/$defs/{FREE_SCALAR_DEF}"}
    value = {
        "anyOf": [
            ref,
            {"type": "array", "items": ref, "maxItems": FREE_MAX_ITEMS},
            _free_object(ref, None),
        ]
    }
    return {FREE_SCALAR_DEF: scalar, FREE_VALUE_DEF: value}


def _free_object(values: Any, node: dict | None) -> dict[str, Any]:
    """A free-form object: bounded keys, at most FREE_MAX_PROPERTIES of them (or minProperties)."""
    node = node or {}
    low = node.get("minProperties", 0) if isinstance(node.get("minProperties"), int) else 0
    high = node.get("maxProperties") if isinstance(node.get("maxProperties"), int) else None
    most = max(low, FREE_MAX_PROPERTIES) if high is None else min(high, max(low, FREE_MAX_PROPERTIES))
    out: dict[str, Any] = {"type": "object", "additionalProperties": values, "maxProperties": most}
    if low:
        out["minProperties"] = low
    out["propertyNames"] = node.get("propertyNames", {"pattern": FREE_KEY_PATTERN})
    return out


class _Tightener:
    def __init__(self, root: dict, max_string_chars: int) -> None:
        self.root = root
        self.max_string_chars = max_string_chars
        self.free_used = False

    # ------------------------------------------------------------ helpers
    def resolve(self, node: Any) -> Any:
        return resolve_local_ref(node, self.root)

    def fixed(self, node: Any) -> bool:
        node = self.resolve(node)
        if not isinstance(node, dict):
            return False
        if "const" in node:
            return True
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) == 1:
            return True
        subs = node.get("allOf")
        return isinstance(subs, list) and any(self.fixed(sub) for sub in subs)

    def free_value(self) -> dict[str, Any]:
        self.free_used = True
        return {"$ref": f"#/$defs/{FREE_VALUE_DEF}"}

    @staticmethod
    def unconstrained(node: Any) -> bool:
        """True for ``true``, ``{}`` and annotation-only schemas (any JSON value)."""
        if node is True:
            return True
        if not isinstance(node, dict):
            return False
        rest = {k: v for k, v in node.items() if k not in _ANNOTATIONS}
        if rest.get("additionalProperties") is True:
            rest.pop("additionalProperties")
        return not rest

    # ------------------------------------------------------------ walk
    def child(self, value: Any) -> Any:
        """A subschema slot: unconstrained values become free values, the rest is tightened."""
        if self.unconstrained(value):
            return self.free_value()
        self.node(value)
        return value

    def node(self, node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                self.node(item)
            return
        if not isinstance(node, dict):
            return
        types = node.get("type")
        if isinstance(types, list) and "anyOf" not in node and "oneOf" not in node:
            self.split_types(node, types)
        self.require_fixed(node)
        kind = node.get("type")
        if kind == "string":
            self.string(node)
        elif kind == "integer":
            self.integer(node)
        elif kind == "number":
            self.number(node)
        elif kind == "array":
            self.array(node)
        elif kind == "object" or (kind is None and _OBJECT_KEYWORDS & node.keys()):
            self.object(node)
        for key, value in list(node.items()):
            if key in SCHEMA_DATA_KEYWORDS:
                continue
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                if isinstance(value, dict):
                    for name in list(value):
                        value[name] = self.child(value[name])
            elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
                if isinstance(value, list):
                    node[key] = [self.child(sub) for sub in value]
            elif key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
                if value is not False:
                    node[key] = self.child(value)
            elif isinstance(value, (dict, list)) and key != "propertyNames":
                self.node(value)

    def split_types(self, node: dict, types: list) -> None:
        keep = {k: v for k, v in node.items() if k not in _ANNOTATIONS and k != "type"}
        variants = [{**copy.deepcopy(keep), "type": t} for t in types if isinstance(t, str)]
        for key in list(node):
            if key not in _ANNOTATIONS:
                del node[key]
        node["anyOf"] = variants

    def require_fixed(self, node: dict) -> None:
        properties = node.get("properties")
        if isinstance(properties, dict):
            for name, sub in properties.items():
                if self.fixed(sub):
                    _require(node, name)
        discriminator = node.get("discriminator")
        if isinstance(discriminator, dict) and isinstance(discriminator.get("propertyName"), str):
            name = discriminator["propertyName"]
            for key in ("oneOf", "anyOf"):
                for variant in node.get(key) or []:
                    target = self.resolve(variant)
                    props = target.get("properties") if isinstance(target, dict) else None
                    if isinstance(props, dict) and name in props:
                        _require(target, name)

    # ------------------------------------------------------------ per type
    def string(self, node: dict) -> None:
        if any(key in node for key in ("enum", "const", "pattern", "format")):
            return
        low = _typed(node, "minLength", int, 0)
        high = _typed(node, "maxLength", int, None)
        most = max(low, self.max_string_chars) if high is None else min(high, max(low, self.max_string_chars))
        # Printable: JSON forbids raw control characters inside strings, and a byte-level
        # vocabulary can offer them as single tokens. Quotes and backslashes are left out too,
        # so the model never has to produce an escape sequence.
        node["maxLength"] = most
        node["pattern"] = bounded_string_pattern(low, most)

    def integer(self, node: dict) -> None:
        if "enum" in node or "const" in node:
            return
        low, high = _integer_range(node, _INTEGER_LIMIT)
        if low > high:  # the schema's range lies beyond the limit: its own, within Kiln's parser
            low, high = _integer_range(node, 10**MAX_INT_DIGITS - 1)
        step = node.get("multipleOf")
        if isinstance(step, int) and not isinstance(step, bool) and step > 0:
            first, last = -(-low // step), high // step  # the multiples k*step inside [low, high]
            if last - first + 1 > MAX_MULTIPLES:  # keep the MAX_MULTIPLES nearest to zero
                centre = min(max(0, first), last)
                first = max(first, centre - MAX_MULTIPLES // 2)
                last = min(last, first + MAX_MULTIPLES - 1)
                low, high = first * step, last * step
        node.pop("exclusiveMinimum", None)
        node.pop("exclusiveMaximum", None)
        node["minimum"], node["maximum"] = low, high

    def number(self, node: dict) -> None:
        if "enum" in node or "const" in node:
            return
        for inclusive, exclusive, limit, sign in (
            ("minimum", "exclusiveMinimum", -MAX_NUMBER_MAGNITUDE, 1),
            ("maximum", "exclusiveMaximum", MAX_NUMBER_MAGNITUDE, -1),
        ):
            # The tightest of the schema's bounds and the limit, written as one keyword.
            bound, keyword = limit, inclusive
            if _is_number(node.get(inclusive)) and sign * node[inclusive] > sign * bound:
                bound = node[inclusive]
            if _is_number(node.get(exclusive)) and sign * node[exclusive] >= sign * bound:
                bound, keyword = node[exclusive], exclusive
            node.pop(inclusive, None)
            node.pop(exclusive, None)
            node[keyword] = bound

    def array(self, node: dict) -> None:
        low = _typed(node, "minItems", int, 0)
        high = _typed(node, "maxItems", int, None)
        cap = 1 if node.get("uniqueItems") is True else MAX_ARRAY_ITEMS
        node["maxItems"] = max(low, cap) if high is None else min(high, max(low, cap))
        if "items" not in node and "prefixItems" not in node:
            node["items"] = True  # turned into free values by the walk

    def object(self, node: dict) -> None:
        declared: dict = _typed(node, "properties", dict, {})
        required: list = _typed(node, "required", list, [])
        low = _typed(node, "minProperties", int, 0)
        # ``properties: {}`` with no word on extras declares "no properties" (a tool without
        # arguments); with ``additionalProperties`` true or a schema, the object is free-form.
        extras_given = node.get("additionalProperties") is True or isinstance(node.get("additionalProperties"), dict)
        declares = bool(declared) or "patternProperties" in node or ("properties" in node and not extras_given)
        if declares and set(required) <= set(declared) and low <= len(declared):
            if "patternProperties" in node and "maxProperties" not in node:
                node["maxProperties"] = len(declared) + FREE_MAX_PROPERTIES
            node["additionalProperties"] = False  # the model writes declared properties only
            return
        extra = node.get("additionalProperties", True)
        if extra is False:
            return
        bounded = _free_object(extra, node)
        node.update({k: v for k, v in bounded.items() if k != "additionalProperties"})
        node["additionalProperties"] = extra if extra is not True else True  # walk makes it free


_T = TypeVar("_T")
_D = TypeVar("_D")


def _typed(node: dict, key: str, kind: type[_T], default: _D) -> _T | _D:
    """``node[key]`` when it is a ``kind``, else ``default``."""
    value = node.get(key)
    return value if isinstance(value, kind) else default


def _integer_range(node: dict, limit: int) -> tuple[int, int]:
    """The integers the schema's bounds admit, intersected with ``[-limit, limit]``."""
    low, high = -limit, limit
    if _is_number(node.get("minimum")):
        low = max(low, math.ceil(node["minimum"]))
    if _is_number(node.get("exclusiveMinimum")):
        low = max(low, math.floor(node["exclusiveMinimum"]) + 1)
    if _is_number(node.get("maximum")):
        high = min(high, math.floor(node["maximum"]))
    if _is_number(node.get("exclusiveMaximum")):
        high = min(high, math.ceil(node["exclusiveMaximum"]) - 1)
    return low, high


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require(node: dict, name: str) -> None:
    required = node.get("required")
    if not isinstance(required, list):
        required = []
    if name not in required:
        node["required"] = [*required, name]


def grammar_schema(schema: dict[str, Any], *, max_string_chars: int = DEFAULT_MAX_STRING_CHARS) -> dict[str, Any]:
    """A tightened copy of ``schema`` for grammar compilation (the input is not modified)."""
    out = copy.deepcopy(schema)
    tightener = _Tightener(out, max_string_chars)
    if tightener.unconstrained(out):
        out = {"type": "object"}  # an action is one JSON object
        tightener.root = out
    tightener.node(out)
    if tightener.free_used:
        definitions = out.setdefault("$defs", {})
        free = _free_definitions()
        definitions.update(free)
    return out


def grammar_bounds() -> dict[str, Any]:
    """The bounds the tightening applies (part of a constrained run's behaviour identity)."""
    return {
        "version": GRAMMAR_SCHEMA_VERSION,
        "max_string_chars": DEFAULT_MAX_STRING_CHARS,
        "max_integer_digits": MAX_INTEGER_DIGITS,
        "max_number_magnitude": MAX_NUMBER_MAGNITUDE,
        "max_array_items": MAX_ARRAY_ITEMS,
        "free_max_properties": FREE_MAX_PROPERTIES,
        "free_max_items": FREE_MAX_ITEMS,
        "free_string_chars": FREE_STRING_CHARS,
        "free_key_pattern": FREE_KEY_PATTERN,
    }
