"""Action-schema compilation and validation.

Owns: compiling the advertised action schema with jsonschema (Draft 2020-12) where only internal
references (``#...``) are allowed and nothing is ever fetched, validating actions into at most four
content-free issues ``{keyword, instance_path, schema_path}``, the schema shown to the policy, and
the action-schema digest. Messages never echo schema or action content.
"""

from __future__ import annotations

import copy
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource, Unresolvable
from referencing.jsonschema import DRAFT202012

from kiln.core.canonical import compact_json, digest_json
from kiln.core.errors import InvalidActionSchema

MAX_ISSUES = 4
MAX_POINTER_BYTES = 192
ISSUES_OMITTED = "additional issues omitted"

# Keywords whose value is a map of name -> subschema, a list of subschemas, or one subschema.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SCHEMA_SINGLE = frozenset(
    {
        "items",
        "not",
        "if",
        "then",
        "else",
        "additionalProperties",
        "contains",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
        "additionalItems",
        "contentSchema",
    }
)
_REF_KEYWORDS = ("$ref", "$dynamicRef")


def _escape(token: object) -> str:
    return str(token).replace("~", "~0").replace("/", "~1")


def json_pointer(parts: Any) -> str:
    """JSON Pointer of a path, ``$`` for the root, cut to at most 192 UTF-8 bytes."""
    items = list(parts)
    if not items:
        return "$"
    pointer = "".join("/" + _escape(p) for p in items)
    raw = pointer.encode("utf-8")
    if len(raw) > MAX_POINTER_BYTES:
        pointer = raw[: MAX_POINTER_BYTES - 3].decode("utf-8", errors="ignore") + "..."
    return pointer


def _schema_error(reason: str) -> InvalidActionSchema:
    return InvalidActionSchema(f"the advertised action schema does not compile: {reason}")


def _collect_refs(node: Any, path: list[Any], refs: list[tuple[str, str]]) -> None:
    """Walk subschemas only (never ``const``/``enum``/``default`` data) collecting references."""
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise _schema_error(f"a subschema at {json_pointer(path)} is not an object or boolean")
    if "$id" in node and path:
        raise _schema_error(f"embedded $id at {json_pointer(path)} is not supported")
    for keyword in _REF_KEYWORDS:
        if keyword in node:
            ref = node[keyword]
            if not isinstance(ref, str):
                raise _schema_error(f"{keyword} at {json_pointer(path)} is not a string")
            refs.append((keyword, ref))
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _collect_refs(sub, [*path, key, name], refs)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for index, sub in enumerate(value):
                _collect_refs(sub, [*path, key, index], refs)
        elif key in _SCHEMA_SINGLE:
            _collect_refs(value, [*path, key], refs)


class ActionValidator:
    """A compiled action schema; build with :meth:`compile`."""

    def __init__(self, schema: dict[str, Any], validator: Draft202012Validator) -> None:
        self.schema = schema
        self._validator = validator
        self.action_schema_sha256: str = digest_json(schema)

    @classmethod
    def compile(cls, action_schema: dict) -> "ActionValidator":
        """Compile ``action_schema`` or raise ``InvalidActionSchema`` (no network or file access)."""
        if not isinstance(action_schema, dict):
            raise _schema_error("it is not a JSON object")
        try:
            compact_json(action_schema)
        except (TypeError, ValueError):
            raise _schema_error("it is not finite JSON") from None
        dialect = action_schema.get("$schema")
        if dialect is not None and dialect not in (
            "https://json-schema.org/draft/2020-12/schema",
            "https://json-schema.org/draft/2020-12/schema#",
        ):
            raise _schema_error("only the JSON Schema 2020-12 dialect is supported")
        root_id = action_schema.get("$id", "")
        if not isinstance(root_id, str):
            raise _schema_error("$id is not a string")
        refs: list[tuple[str, str]] = []
        _collect_refs(action_schema, [], refs)
        for keyword, ref in refs:
            if not ref.startswith("#"):
                raise _schema_error(f"{keyword} points outside the schema (external references are never fetched)")
        try:
            Draft202012Validator.check_schema(action_schema)
        except SchemaError as exc:
            raise _schema_error(
                f"keyword {exc.validator!r} fails the 2020-12 meta-schema at {json_pointer(exc.absolute_path)}"
            ) from None
        resource = Resource.from_contents(action_schema, default_specification=DRAFT202012)
        # A Registry built without ``retrieve`` raises NoSuchResource for any URI it does not
        # hold: nothing is ever fetched.
        registry: Registry = Registry().with_resource(root_id, resource)
        resolver = registry.resolver(base_uri=root_id)
        for keyword, ref in refs:
            if keyword == "$dynamicRef":
                continue  # resolved dynamically; its static target must still exist below
            try:
                resolver.lookup(ref)
            except (Unresolvable, NoSuchResource, KeyError, LookupError, TypeError, ValueError):
                raise _schema_error(f"{keyword} names a location that does not exist") from None
        validator = Draft202012Validator(action_schema, registry=registry)
        return cls(action_schema, validator)

    def issues(self, action: object) -> tuple[list[dict[str, str]], bool]:
        """All issues, sorted and cut to four: ``(issues, truncated)``."""
        found: list[dict[str, str]] = []
        try:
            for error in self._validator.iter_errors(action):
                found.append(
                    {
                        "keyword": str(error.validator),
                        "instance_path": json_pointer(error.absolute_path),
                        "schema_path": json_pointer(error.absolute_schema_path),
                    }
                )
        except (Unresolvable, NoSuchResource, RecursionError):
            found.append({"keyword": "$ref", "instance_path": "$", "schema_path": "$"})
        found.sort(key=lambda i: (i["instance_path"], i["schema_path"], i["keyword"]))
        return found[:MAX_ISSUES], len(found) > MAX_ISSUES

    def validate(self, action: object) -> list[dict]:
        """``[]`` when valid, else at most four ``{keyword, instance_path, schema_path}`` issues."""
        return self.issues(action)[0]

    def is_valid(self, action: object) -> bool:
        return self._validator.is_valid(action)


def describe_issues(issues: list[dict], truncated: bool) -> str:
    """A content-free message for ``ACTION_SCHEMA_VALIDATION_FAILED``."""
    parts = [f"{i['keyword']} at {i['instance_path']} (schema {i['schema_path']})" for i in issues]
    text = "action does not match the action schema: " + "; ".join(parts)
    if truncated:
        text += f"; {ISSUES_OMITTED}"
    return text


# Keywords whose values are data (never subschemas): schema rewrites leave them alone.
SCHEMA_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def resolve_local_ref(node: Any, root: dict) -> Any:
    """The subschema a local ``{"$ref": "#/..."}`` points at inside ``root`` (``node`` itself when
    it is no such reference or the target does not exist)."""
    if isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/"):
        target: Any = root
        for part in node["$ref"][2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return node
            target = target[part]
        return target
    return node


def policy_action_schema(action_schema: dict) -> dict:
    """The schema shown to the policy: without the inherited optional top-level ``metadata``."""
    shown = copy.deepcopy(action_schema)
    properties = shown.get("properties")
    required = shown.get("required") or []
    if isinstance(properties, dict) and "metadata" in properties and "metadata" not in required:
        del properties["metadata"]
    return shown
