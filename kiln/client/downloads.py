"""Verified, atomic downloads of a run's artifacts (``Client.download`` and ``kiln openenv
artifact``/``rollout --output`` use these).

A download trusts nothing but the run's current manifest: its bytes must hash to the digest the run
recorded, the artifact's URL is the canonical path built from the declared name, and the declared
size and SHA-256 are rechecked on the streamed bytes. Bytes are staged beside the target, fsynced,
and published atomically (never over an existing file unless forced); a failed download leaves no
file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

from kiln.core.artifacts.manifest import verified_manifest
from kiln.client.http import ApiClient, artifact_path
from kiln.core.errors import ArtifactIntegrityFailed, ArtifactNotFound, OutputExists

DOWNLOAD_RECEIPT_SCHEMA = "kiln.openenv-artifact-download.v1"
MAX_DOWNLOAD_BYTES = 256 * 1024 * 1024
_CHUNK = 256 * 1024


def current_manifest(api: ApiClient, run_id: str) -> dict[str, Any]:
    """The run's manifest, checked against the manifest digest the run itself recorded."""
    status = api.status(run_id)
    if status.manifest is None:
        raise ArtifactNotFound(
            f"run {run_id} is {status.state} and has published no artifacts",
            hint="artifacts appear when the run completes",
        )
    return verified_manifest(api.manifest_bytes(run_id), run_id, status.manifest.sha256)


def manifest_entry(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    for entry in manifest["artifacts"]:
        if entry["name"] == name:
            return entry
    raise ArtifactNotFound(
        f"run {manifest['run_id']} declares no artifact named {name!r}",
        hint="declared: " + ", ".join(e["name"] for e in manifest["artifacts"]),
    )


def _check_target(output: Path, force: bool) -> None:
    if output.is_dir():
        raise OutputExists(f"{output} is a directory", hint="give a file path to --output")
    if output.exists() and not force:
        raise OutputExists(f"{output} already exists", hint="pass --force to replace it")


def _check_headers(response: Any, entry: dict[str, Any]) -> None:
    headers = response.headers
    problems = []
    if headers.get("content-length") != str(entry["bytes"]):
        problems.append(f"Content-Length {headers.get('content-length')!r} != {entry['bytes']}")
    if headers.get("etag") != f'"{entry["sha256"]}"':
        problems.append(f"ETag {headers.get('etag')!r} != the manifest digest")
    if "no-store" not in (headers.get("cache-control") or ""):
        problems.append("Cache-Control lacks no-store")
    if (headers.get("x-content-type-options") or "").lower() != "nosniff":
        problems.append("X-Content-Type-Options is not nosniff")
    if (headers.get("content-encoding") or "identity").lower() != "identity":
        problems.append(f"Content-Encoding {headers.get('content-encoding')!r} is not identity")
    if problems:
        raise ArtifactIntegrityFailed(
            f"artifact {entry['name']!r}: the response does not match the manifest: " + "; ".join(problems)
        )


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(staged: Path, output: Path, force: bool) -> None:
    """Atomically move ``staged`` to ``output`` (``link`` refuses an existing target)."""
    if force:
        os.replace(staged, output)
    else:
        try:
            os.link(staged, output)
        except FileExistsError:
            raise OutputExists(f"{output} already exists", hint="pass --force to replace it") from None
        staged.unlink()
    _fsync_dir(output.parent)


def download_entry(
    api: ApiClient, run_id: str, entry: dict[str, Any], output: Path, *, force: bool = False
) -> dict[str, Any]:
    """Stream one manifest entry to ``output``, verified; returns the download receipt."""
    output = Path(output).absolute()
    _check_target(output, force)
    if entry["bytes"] > MAX_DOWNLOAD_BYTES:
        raise ArtifactIntegrityFailed(f"artifact {entry['name']!r} is over the 256 MiB download limit")
    source = artifact_path(run_id, entry["name"])
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = output.parent / f".{output.name}.{uuid.uuid4().hex[:12]}.part"
    try:
        hasher = hashlib.sha256()
        seen = 0
        with api.stream(source) as response, open(staged, "xb") as fh:
            if response.status_code != 200:
                raise ArtifactIntegrityFailed(f"GET {source} answered HTTP {response.status_code}")
            _check_headers(response, entry)
            for chunk in response.iter_raw(_CHUNK):
                seen += len(chunk)
                if seen > entry["bytes"]:
                    raise ArtifactIntegrityFailed(
                        f"artifact {entry['name']!r}: more bytes than the manifest's {entry['bytes']}"
                    )
                hasher.update(chunk)
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        digest = "sha256:" + hasher.hexdigest()
        if seen != entry["bytes"] or digest != entry["sha256"]:
            raise ArtifactIntegrityFailed(
                f"artifact {entry['name']!r}: received {seen} bytes hashing to {digest}, "
                f"the manifest declares {entry['bytes']} bytes and {entry['sha256']}"
            )
        _publish(staged, output, force)
    finally:
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
    return {
        "schema": DOWNLOAD_RECEIPT_SCHEMA,
        "run_id": run_id,
        "kind": entry["name"],
        "source_url": source,
        "output_path": str(output),
        "sha256": entry["sha256"],
        "bytes": entry["bytes"],
    }


def download_artifact(api: ApiClient, run_id: str, name: str, output: Path, *, force: bool = False) -> dict[str, Any]:
    """Download artifact ``name`` of ``run_id`` to ``output`` (verified, atomic)."""
    _check_target(Path(output), force)
    entry = manifest_entry(current_manifest(api, run_id), name)
    return download_entry(api, run_id, entry, Path(output), force=force)


def download_run_outputs(
    api: ApiClient, run_id: str, mapping: dict[str, Path], *, force: bool = False
) -> list[dict[str, Any]]:
    """Download several artifacts (manifest name → local path) from one manifest.

    Every target is checked before any byte is fetched, so a refused overwrite downloads nothing.
    """
    targets = {name: Path(path) for name, path in mapping.items()}
    for path in targets.values():
        _check_target(path, force)
    manifest = current_manifest(api, run_id)
    entries = {name: manifest_entry(manifest, name) for name in targets}
    return [download_entry(api, run_id, entries[name], targets[name], force=force) for name in targets]


def download_run(api: ApiClient, run_id: str, folder: Path, *, force: bool = False) -> list[dict[str, Any]]:
    """``manifest.json`` and every artifact of ``run_id`` into ``folder`` at their manifest names
    (each verified, atomic). Every target is checked before any byte is fetched."""
    folder = Path(folder)
    manifest = current_manifest(api, run_id)
    targets = [(entry, folder / entry["name"]) for entry in manifest["artifacts"]]
    for entry, path in targets:
        if ".." in Path(entry["name"]).parts or Path(entry["name"]).is_absolute():
            raise ArtifactIntegrityFailed(f"artifact name {entry['name']!r} escapes the run folder")
        _check_target(path, force)
    _check_target(folder / "manifest.json", force)
    receipts = [download_entry(api, run_id, entry, path, force=force) for entry, path in targets]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_bytes(api.manifest_bytes(run_id))
    return receipts
