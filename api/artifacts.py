"""Serving a run's published artifacts: only what its manifest declares, only verified bytes.

The manifest (``runs/<id>/manifest.json``, write-once) is the only source of names, locations,
sizes and digests. Before a single response header is sent, the declared object is copied from S3
into a private spool file while its size and SHA-256 are checked (``S3Store.iter_verified``); a
missing, resized or altered object answers 409 ``openenv_artifact_integrity_failed``. The response
then streams that verified spool, so drifted bytes are never served.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from kiln.core.artifacts.manifest import manifest_key, verified_manifest
from kiln.core.artifacts.store import ObjectRef, S3Store
from kiln.core.canonical import sha256_bytes
from kiln.core.errors import ArtifactIntegrityFailed, ArtifactNotFound, KilnError

MAX_ARTIFACT_BYTES = 256 * 1024 * 1024
SPOOL_MEMORY_BYTES = 8 * 1024 * 1024
STREAM_CHUNK = 256 * 1024
_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class PublishedManifest:
    """The manifest bytes exactly as published, their digest, and the parsed document."""

    raw: bytes
    sha256: str
    document: dict[str, Any]

    def entry(self, name: str) -> dict[str, Any]:
        for item in self.document["artifacts"]:
            if item["name"] == name:
                return item
        raise ArtifactNotFound(
            f"run {self.document['run_id']} declares no artifact named {name!r}",
            hint="GET /v1/openenv/runs/{run_id}/artifacts lists the declared names",
            details={"name": name},
        )


@dataclass
class VerifiedArtifact:
    """An artifact's verified bytes in a spool file, with the headers that describe them."""

    entry: dict[str, Any]
    spool: IO[bytes]

    def chunks(self) -> Iterator[bytes]:
        try:
            self.spool.seek(0)
            while chunk := self.spool.read(STREAM_CHUNK):
                yield chunk
        finally:
            self.spool.close()


def download_filename(run_id: str, name: str) -> str:
    """``openenv-<run>-<name>`` with every character outside ``[A-Za-z0-9._-]`` as ``_``."""
    return _UNSAFE_FILENAME.sub("_", f"openenv-{run_id}-{name}")


def artifact_headers(run_id: str, entry: dict[str, Any]) -> dict[str, str]:
    return {
        "Content-Length": str(entry["bytes"]),
        "Content-Type": entry["media_type"],
        "ETag": f'"{entry["sha256"]}"',
        "Cache-Control": "private, no-store",
        "X-Content-Type-Options": "nosniff",
        "Content-Disposition": f'attachment; filename="{download_filename(run_id, entry["name"])}"',
    }


class ArtifactService:
    """Reads manifests and verified artifact bytes from the store (boto3 runs in threads)."""

    def __init__(self, store: S3Store) -> None:
        self.store = store

    async def manifest(self, run_id: str, expected_sha256: str | None = None) -> PublishedManifest:
        """The run's published manifest; 404 when none was published, 409 when it is corrupt."""
        raw = await asyncio.to_thread(self.store.get_key, manifest_key(run_id))
        if raw is None:
            raise ArtifactNotFound(
                f"run {run_id} has published no artifacts",
                hint="artifacts appear when the run completes",
            )
        document = verified_manifest(raw, run_id, expected_sha256)
        return PublishedManifest(raw=raw, sha256=sha256_bytes(raw), document=document)

    async def verified(self, manifest: PublishedManifest, name: str) -> VerifiedArtifact:
        """Copy artifact ``name`` into a spool file, checking size and SHA-256 on the way."""
        entry = manifest.entry(name)
        if entry["bytes"] > MAX_ARTIFACT_BYTES:
            raise ArtifactIntegrityFailed(
                f"artifact {name!r} is {entry['bytes']} bytes, over the 256 MiB download limit",
                details={"name": name},
            )
        ref = ObjectRef(uri=entry["uri"], sha256=entry["sha256"], bytes=entry["bytes"])
        spool = await asyncio.to_thread(self._spool, ref, name)
        return VerifiedArtifact(entry=entry, spool=spool)

    def _spool(self, ref: ObjectRef, name: str) -> IO[bytes]:
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)
        try:
            for chunk in self.store.iter_verified(ref, chunk_size=STREAM_CHUNK):
                spool.write(chunk)
        except (ArtifactIntegrityFailed, ArtifactNotFound) as err:
            spool.close()
            raise ArtifactIntegrityFailed(
                f"artifact {name!r} failed verification against its manifest: {err.message}",
                hint="the stored object drifted from what the run published; nothing was served",
                details={"name": name, "expected_sha256": ref.sha256, "expected_bytes": ref.bytes},
            ) from None
        except KilnError:
            spool.close()
            raise
        return spool
