"""Run manifests and the retained-byte budget (pure)."""

from __future__ import annotations

import hashlib

import pytest

from kiln.core.artifacts.budget import RetainedBudget
from kiln.core.artifacts.manifest import (
    MANIFEST_SCHEMA,
    build_manifest,
    manifest_bytes,
    manifest_key,
    parse_manifest,
    validate_manifest,
)
from kiln.core.artifacts.store import ObjectRef, blob_key
from kiln.core.canonical import pretty_json
from kiln.core.errors import RetainedBudgetExceeded


def _artifact(name: str, data: bytes, media: str = "application/octet-stream") -> dict:
    hexd = hashlib.sha256(data).hexdigest()
    return {"name": name, "uri": f"s3://kiln/blobs/sha256/{hexd}", "sha256": f"sha256:{hexd}",
            "bytes": len(data), "media_type": media}


def test_manifest_key() -> None:
    assert manifest_key("run-1") == "runs/run-1/manifest.json"
    for bad in ("", "../x", "a/b", "a b"):
        with pytest.raises(ValueError):
            manifest_key(bad)


def test_build_sorts_by_name_and_is_byte_stable() -> None:
    arts = [_artifact("z.json", b"z"), _artifact("a.bin", b"a")]
    m1 = build_manifest("run-1", arts, {"status": "succeeded"})
    m2 = build_manifest("run-1", list(reversed(arts)), {"status": "succeeded"})
    assert m1["schema"] == MANIFEST_SCHEMA and m1["run_id"] == "run-1"
    assert [a["name"] for a in m1["artifacts"]] == ["a.bin", "z.json"]
    assert m1["status"] == "succeeded"
    assert manifest_bytes(m1) == manifest_bytes(m2) == pretty_json(m1)
    assert parse_manifest(manifest_bytes(m1)) == m1


def test_build_rejects_bad_input() -> None:
    a = _artifact("a", b"a")
    with pytest.raises(ValueError, match="unique"):
        build_manifest("r", [a, dict(a)], {})
    with pytest.raises(ValueError, match="reserved"):
        build_manifest("r", [a], {"artifacts": []})
    with pytest.raises(ValueError, match="sha256"):
        build_manifest("r", [{**a, "sha256": "md5:00"}], {})
    with pytest.raises(ValueError, match="bytes"):
        build_manifest("r", [{**a, "bytes": -1}], {})
    with pytest.raises(ValueError, match="missing"):
        build_manifest("r", [{k: v for k, v in a.items() if k != "media_type"}], {})
    with pytest.raises(ValueError, match="uri"):
        build_manifest("r", [{**a, "uri": "http://x/y"}], {})
    with pytest.raises(ValueError):
        build_manifest("r", [a], {"x": float("nan")})


def test_validate_rejects_unsorted_and_unknown_schema() -> None:
    m = build_manifest("r", [_artifact("a", b"a"), _artifact("b", b"b")], {})
    with pytest.raises(ValueError, match="sorted"):
        validate_manifest({**m, "artifacts": list(reversed(m["artifacts"]))})
    with pytest.raises(ValueError, match="schema"):
        validate_manifest({**m, "schema": "other"})
    with pytest.raises(ValueError, match="JSON"):
        parse_manifest(b"{not json")


def test_object_ref_round_trip_and_validation() -> None:
    data = b"hello"
    hexd = hashlib.sha256(data).hexdigest()
    ref = ObjectRef(uri=f"s3://kiln/{blob_key('sha256:' + hexd)}", sha256=f"sha256:{hexd}", bytes=5)
    assert ref.bucket == "kiln" and ref.key == f"blobs/sha256/{hexd}"
    assert ObjectRef.from_dict(ref.to_dict()) == ref
    with pytest.raises(ValueError):
        ObjectRef(uri="s3://kiln", sha256=ref.sha256, bytes=5)
    with pytest.raises(ValueError):
        ObjectRef(uri=ref.uri, sha256="sha256:xyz", bytes=5)
    with pytest.raises(ValueError):
        ObjectRef(uri=ref.uri, sha256=ref.sha256, bytes=-1)


def test_retained_budget() -> None:
    budget = RetainedBudget(limit_bytes=100)
    budget.charge(60, "group 0")
    budget.charge(40, "group 1")
    assert budget.used == 100 and budget.remaining == 0
    with pytest.raises(RetainedBudgetExceeded) as info:
        budget.charge(1, "adapter.safetensors")
    assert "adapter.safetensors" in info.value.message and "100" in info.value.message
    assert info.value.details == {"what": "adapter.safetensors", "bytes": 1, "used": 100,
                                  "limit": 100}
    assert budget.used == 100
    with pytest.raises(ValueError):
        budget.charge(-1, "x")
    assert RetainedBudget().limit_bytes == 512 * 1024 * 1024
