"""Canonical discovery digests, identity object and drift labels."""

import copy
import json

from kiln.core.canonical import digest_json
from kiln.core.openenv.discovery import build_identity, discovery_digest, identity_differences
from kiln.core.openenv.urls import normalize_url

METADATA = {"name": "counter", "description": "Counts", "readme_content": None, "version": "1",
            "author": None, "documentation_url": None}
SCHEMA = {"action": {"type": "object", "properties": {"amount": {"type": "integer"}}},
          "observation": {"type": "object"}, "state": {"type": "object"}}
OPENAPI = {"openapi": "3.1.0", "info": {"title": "OpenEnv", "version": "1.0.0"}, "paths": {"/health": {}}}


def test_canonical_vector_and_key_order():
    a = json.loads('{"z":[{"b":2,"a":1}],"a":{"nested":true}}')
    b = json.loads('{ "a" : {"nested": true},\n "z": [ {"a": 1, "b": 2} ] }')
    assert digest_json(a) == digest_json(b) == (
        "sha256:8c9d210f72f7cf830065c9b60747192282be51534dc6c217e7af1ba7151c9696"
    )
    a["z"][0]["c"] = None  # any added field changes it
    assert digest_json(a) != digest_json(b)


def _inspection(metadata=METADATA, schema=SCHEMA, openapi=OPENAPI, envs=("counter",)):
    url = normalize_url("127.0.0.1:8000")
    identity = build_identity(url, metadata=metadata, schema=schema, environments=list(envs), openapi=openapi)
    return {"identity": identity, "schema": schema}


def test_identity_fields():
    identity = _inspection()["identity"]
    assert list(identity) == ["schema", "client_profile", "base_url", "websocket_url", "authentication",
                              "openapi_version", "environments", "metadata", "schema_sha256", "discovery_sha256"]
    assert identity["schema"] == "kiln.openenv-identity.v1"
    assert identity["client_profile"] == "openenv-http/1.x"
    assert identity["websocket_url"] == "ws://127.0.0.1:8000/ws"
    assert identity["authentication"] == "none"
    assert identity["openapi_version"] == "1.0.0"
    assert identity["schema_sha256"] == digest_json(SCHEMA)
    assert identity["discovery_sha256"] == digest_json({
        "schema": "kiln.openenv-discovery.v1", "metadata": METADATA, "environment_schema": SCHEMA,
        "environments": ["counter"], "openapi": OPENAPI})


def test_openapi_path_change_moves_only_discovery_digest():
    first = _inspection()
    changed = copy.deepcopy(OPENAPI)
    changed["paths"]["/web"] = {}
    second = _inspection(openapi=changed)
    assert identity_differences(first, second) == ["identity.discovery_sha256"]
    assert first["identity"]["schema_sha256"] == second["identity"]["schema_sha256"]


def test_drift_example_labels():
    first = _inspection()
    metadata = dict(METADATA, description="Counts differently")
    schema = copy.deepcopy(SCHEMA)
    schema["action"]["properties"]["amount"]["maximum"] = 5
    second = _inspection(metadata=metadata, schema=schema)
    assert identity_differences(first, second) == [
        "identity.metadata", "identity.schema_sha256", "identity.discovery_sha256", "schema.action"]
    assert identity_differences(first, copy.deepcopy(first)) == []


def test_legacy_identity_without_discovery_digest():
    first = _inspection()
    del first["identity"]["discovery_sha256"]
    assert identity_differences(first, _inspection()) == []


def test_int_float_bool_are_different_values():
    schema = copy.deepcopy(SCHEMA)
    schema["action"]["properties"]["amount"]["minimum"] = 1
    other = copy.deepcopy(schema)
    other["action"]["properties"]["amount"]["minimum"] = 1.0
    assert "schema.action" in identity_differences(_inspection(schema=schema), _inspection(schema=other))
    assert discovery_digest(METADATA, schema, [], None) != discovery_digest(METADATA, other, [], None)
