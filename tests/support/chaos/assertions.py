"""What the chaos tests assert and report: known-bug markers, published artifacts intact in S3,
no manifest after a failure, and the recovery figures ``tests/chaos/conftest.py`` prints."""

from __future__ import annotations

import hashlib
import json
from typing import Any


class BugReproduced(AssertionError):
    """Raised by the assertion that shows a known product bug (``xfail(raises=BugReproduced)``),
    so that any other failure of such a test still fails the suite."""


def expect_fixed(condition: bool, message: str) -> None:
    """Assert a behaviour a known product bug breaks (raises :class:`BugReproduced`)."""
    if not condition:
        raise BugReproduced(message)


def sha256_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_uri(store: Any, uri: str) -> bytes:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return store.client.get_object(Bucket=bucket, Key=key)["Body"].read()


def _text_diff(name: str, ours: bytes, theirs: bytes, limit: int = 40) -> str:
    import difflib

    if len(ours) > 200_000 or len(theirs) > 200_000 or name.endswith(".safetensors"):
        return f"--- {name}: {len(ours)} vs {len(theirs)} bytes (binary)"
    lines = difflib.unified_diff(
        ours.decode("utf-8", "replace").splitlines(), theirs.decode("utf-8", "replace").splitlines(),
        "reference/" + name, "disturbed/" + name, lineterm="", n=1,
    )
    return "\n".join(list(lines)[:limit])


def verify_published(store: Any, run_id: str, status: dict[str, Any]) -> dict[str, Any]:
    """Exactly one manifest for the run, equal to what status names; every listed object intact."""
    from kiln.core.artifacts.manifest import manifest_key

    key = manifest_key(run_id)
    keys = [k for k in store.list_keys(f"runs/{run_id}/") if k.endswith("manifest.json")]
    assert keys == [key], f"expected exactly one manifest for {run_id}, found {keys}"
    data = store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read()
    assert status["manifest"]["sha256"] == sha256_of(data), "the manifest in S3 is not the one status names"
    manifest = json.loads(data)
    assert {a["name"] for a in manifest["artifacts"]} == {a["name"] for a in status["artifacts"]}
    for entry in manifest["artifacts"]:
        blob = read_uri(store, entry["uri"])
        assert len(blob) == entry["bytes"] and sha256_of(blob) == entry["sha256"], entry["name"]
    return manifest


def manifest_absent(store: Any, run_id: str) -> bool:
    from kiln.core.artifacts.manifest import manifest_key

    return not store.exists(manifest_key(run_id))


FIGURES: list[dict[str, Any]] = []


def record(case: str, **figures: Any) -> None:
    """Keep (and print, visible with ``pytest -s``) one case's recovery figures."""
    entry = {"case": case, **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in figures.items()}}
    FIGURES.append(entry)
    print(f"\n[chaos] {json.dumps(entry, default=str)}", flush=True)
