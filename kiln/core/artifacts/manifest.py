"""Run manifests: the one JSON document that lists every artifact a run published.

This module owns the manifest's shape (schema ``kiln.run-manifest.v1``), where it lives
(``runs/<run_id>/manifest.json``), its byte form (``pretty_json``: sorted keys, stable bytes) and
re-verification of every listed object against the store. Building and validating are pure;
only :func:`verify_manifest_against_store` does I/O, through the store it is given. Publication
itself is a conditional put (``S3Store.put_if_absent``) of :func:`manifest_bytes`.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from kiln.core.canonical import is_digest, pretty_json
from kiln.core.errors import ArtifactIntegrityFailed, ArtifactNotFound, KilnError

if TYPE_CHECKING:
    from kiln.core.artifacts.store import S3Store

__all__ = [
    "MANIFEST_SCHEMA",
    "ARTIFACT_FIELDS",
    "manifest_key",
    "build_manifest",
    "validate_manifest",
    "manifest_bytes",
    "parse_manifest",
    "verify_manifest_against_store",
]

MANIFEST_SCHEMA = "kiln.run-manifest.v1"
ARTIFACT_FIELDS = ("name", "uri", "sha256", "bytes", "media_type")
_RESERVED = ("schema", "run_id", "artifacts")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")


def manifest_key(run_id: str) -> str:
    """``runs/<run_id>/manifest.json``."""
    _check_run_id(run_id)
    return f"runs/{run_id}/manifest.json"


def _check_run_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise ValueError(f"invalid run id for a manifest key: {run_id!r}")


def _check_artifact(entry: Any, index: int) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise ValueError(f"artifact #{index} is not an object")
    missing = [f for f in ARTIFACT_FIELDS if f not in entry]
    extra = sorted(set(entry) - set(ARTIFACT_FIELDS))
    if missing or extra:
        raise ValueError(f"artifact #{index}: missing fields {missing}, unknown fields {extra}")
    name, uri, digest, size, media = (entry[f] for f in ARTIFACT_FIELDS)
    if not isinstance(name, str) or not name:
        raise ValueError(f"artifact #{index}: name must be a non-empty string")
    if not isinstance(uri, str) or not uri.startswith("s3://") or "/" not in uri[5:]:
        raise ValueError(f"artifact {name!r}: uri must be s3://bucket/key, got {uri!r}")
    if not is_digest(digest):
        raise ValueError(f"artifact {name!r}: sha256 must be 'sha256:<hex>', got {digest!r}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"artifact {name!r}: bytes must be a non-negative int, got {size!r}")
    if not isinstance(media, str) or not media:
        raise ValueError(f"artifact {name!r}: media_type must be a non-empty string")
    return {f: entry[f] for f in ARTIFACT_FIELDS}


def _check_artifacts(artifacts: Any) -> list[dict[str, Any]]:
    if not isinstance(artifacts, list):
        raise ValueError("artifacts must be a list")
    checked = [_check_artifact(a, i) for i, a in enumerate(artifacts)]
    names = [a["name"] for a in checked]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"artifact names must be unique; repeated: {dupes}")
    return sorted(checked, key=lambda a: a["name"])


def build_manifest(run_id: str, artifacts: list[dict], extra: dict) -> dict:
    """The manifest dict: ``schema``, ``run_id``, ``artifacts`` (sorted by name), plus ``extra``.

    ``extra``'s keys are merged at the top level (they must not be ``schema``/``run_id``/
    ``artifacts``) and must be JSON-serialisable.
    """
    _check_run_id(run_id)
    extra = dict(extra or {})
    clash = [k for k in _RESERVED if k in extra]
    if clash:
        raise ValueError(f"extra must not set reserved manifest keys {clash}")
    manifest = {**extra, "schema": MANIFEST_SCHEMA, "run_id": run_id, "artifacts": _check_artifacts(artifacts)}
    pretty_json(manifest)  # fail now, not at publication, if something is not JSON
    return manifest


def validate_manifest(manifest: Any) -> dict:
    """Check a manifest's structure (schema, run id, artifacts); returns it unchanged."""
    if not isinstance(manifest, dict):
        raise ValueError("a manifest is a JSON object")
    if manifest.get("schema") != MANIFEST_SCHEMA:
        raise ValueError(f"unknown manifest schema {manifest.get('schema')!r}")
    _check_run_id(manifest.get("run_id"))  # type: ignore[arg-type]  # any JSON value: the check refuses a non-str
    ordered = _check_artifacts(manifest.get("artifacts"))
    if [a["name"] for a in ordered] != [a["name"] for a in manifest["artifacts"]]:
        raise ValueError("manifest artifacts must be sorted by name")
    return manifest


def manifest_bytes(manifest: dict) -> bytes:
    """The published byte form (``pretty_json``: sorted keys, byte-stable)."""
    return pretty_json(validate_manifest(manifest))


def parse_manifest(data: bytes) -> dict:
    """Parse and validate published manifest bytes."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"manifest is not valid JSON: {exc}") from exc
    return validate_manifest(value)


def verify_manifest_against_store(manifest: dict, store: S3Store) -> None:
    """Re-read and re-hash every listed object; ArtifactIntegrityFailed names the first bad one."""
    from kiln.core.artifacts.store import ObjectRef

    validate_manifest(manifest)
    for entry in manifest["artifacts"]:
        ref = ObjectRef(uri=entry["uri"], sha256=entry["sha256"], bytes=entry["bytes"])
        try:
            for _ in store.iter_verified(ref, chunk_size=1024 * 1024):
                pass
        except (ArtifactIntegrityFailed, ArtifactNotFound) as exc:
            raise ArtifactIntegrityFailed(
                f"artifact {entry['name']!r} of run {manifest['run_id']!r} failed verification: {exc.message}",
                details={"artifact": entry["name"], "uri": entry["uri"], "cause": exc.code},
            ) from exc
        except KilnError:
            raise


def verified_manifest(raw: bytes, run_id: str, expected_sha256: str | None) -> dict:
    """The one integrity check of served manifest bytes (API and CLI): they hash to the digest
    the run recorded (when known), parse as a valid manifest, and name this run."""
    from kiln.core.canonical import sha256_bytes

    digest = sha256_bytes(raw)
    if expected_sha256 is not None and digest != expected_sha256:
        raise ArtifactIntegrityFailed(
            f"the manifest of run {run_id} does not hash to the digest the run recorded",
            details={"expected": expected_sha256, "actual": digest},
        )
    try:
        document = parse_manifest(raw)
    except ValueError as err:
        raise ArtifactIntegrityFailed(f"the manifest of run {run_id} is invalid: {err}") from None
    if document["run_id"] != run_id:
        raise ArtifactIntegrityFailed(f"the manifest of run {run_id} names another run")
    return document
