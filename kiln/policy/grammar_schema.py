"""The schema a decoding grammar is compiled from: the policy schema, tightened (issue 12).

A grammar generated straight from a JSON schema lets the model *omit* optional properties and
write strings of any length. Two things then go wrong under constrained decoding: a discriminated
union's discriminator (a ``const`` / single-value ``enum`` / ``Literal`` with a default, not in
``required``) can be left out, and a free string runs until ``max_action_tokens``. This module
rewrites a copy of the schema so that:

* every property whose value is fixed (``const``, or an ``enum`` with one value, also through a
  local ``$ref``) is required — the grammar then writes it, and the value is forced;
* in a ``oneOf``/``anyOf`` with an OpenAPI ``discriminator``, the discriminator property is
  required in every variant;
* every string without ``maxLength``/``enum``/``const``/``pattern``/``format`` gets
  ``maxLength: DEFAULT_MAX_STRING_CHARS``.

Everything the tightened grammar accepts is accepted by the original schema (it only removes
choices), so the environment sees valid actions either way.
"""

from __future__ import annotations

import copy
from typing import Any

DEFAULT_MAX_STRING_CHARS = 64


def _resolve(node: Any, root: dict) -> Any:
    if isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/"):
        target: Any = root
        for part in node["$ref"][2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                return node
            target = target[part]
        return target
    return node


def _fixed(node: Any, root: dict) -> bool:
    node = _resolve(node, root)
    if not isinstance(node, dict):
        return False
    if "const" in node:
        return True
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) == 1:
        return True
    subs = node.get("allOf")
    return isinstance(subs, list) and any(_fixed(sub, root) for sub in subs)


def _require(node: dict, name: str) -> None:
    required = node.get("required")
    if not isinstance(required, list):
        required = []
    if name not in required:
        node["required"] = [*required, name]


def _tighten(node: Any, root: dict, max_string_chars: int) -> None:
    if isinstance(node, list):
        for item in node:
            _tighten(item, root, max_string_chars)
        return
    if not isinstance(node, dict):
        return
    properties = node.get("properties")
    if isinstance(properties, dict):
        for name, sub in properties.items():
            if _fixed(sub, root):
                _require(node, name)
    discriminator = node.get("discriminator")
    if isinstance(discriminator, dict) and isinstance(discriminator.get("propertyName"), str):
        name = discriminator["propertyName"]
        for key in ("oneOf", "anyOf"):
            for variant in node.get(key) or []:
                target = _resolve(variant, root)
                properties = target.get("properties") if isinstance(target, dict) else None
                if isinstance(properties, dict) and name in properties:
                    _require(target, name)
    if node.get("type") == "string" and not any(
        key in node for key in ("maxLength", "enum", "const", "pattern", "format")
    ):
        # Bounded, and printable: JSON forbids raw control characters inside strings, and a
        # byte-level vocabulary can offer them as single tokens. Quotes and backslashes are left
        # out too, so the model never has to produce an escape sequence.
        node["maxLength"] = max_string_chars
        node["pattern"] = f"^[^\\u0000-\\u001f\"\\\\]{{0,{max_string_chars}}}$"
    for key, value in node.items():
        if key not in ("const", "enum", "default", "examples"):
            _tighten(value, root, max_string_chars)


def grammar_schema(schema: dict[str, Any], *, max_string_chars: int = DEFAULT_MAX_STRING_CHARS) -> dict[str, Any]:
    """A tightened copy of ``schema`` for grammar compilation (the input is not modified)."""
    out = copy.deepcopy(schema)
    _tighten(out, out, max_string_chars)
    return out
