"""Verified reads of a store: every read of an :class:`ObjectRef` checks its size and SHA-256
(a mismatch raises :class:`~kiln.core.errors.ArtifactIntegrityFailed`); raw reads of keys;
listing; many small objects fetched a few at a time in order. :class:`StoreReads` is the read
half of :class:`~kiln.core.artifacts.store.S3Store`."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import botocore.exceptions as bce

from kiln.core.artifacts.outage import patient
from kiln.core.artifacts.refs import ObjectRef
from kiln.core.artifacts.s3_errors import S3Errors, error_code, http_status
from kiln.core.errors import ArtifactIntegrityFailed, ArtifactNotFound

READ_CHUNK = 1024 * 1024


class StoreReads(S3Errors):
    """The reads of a store whose boto3 client is ``_client``."""

    _client: Any
    outage_wait_s: float

    @patient
    def _open(self, ref: ObjectRef) -> tuple[Any, int]:
        try:
            resp = self._client.get_object(Bucket=ref.bucket, Key=ref.key)
        except Exception as exc:
            mapped = self._map(exc, "get", ref.key)
            if isinstance(mapped, ArtifactNotFound):
                mapped = ArtifactNotFound(f"{ref.uri} not found at {self.endpoint}", details={"uri": ref.uri})
            raise mapped from exc
        length = int(resp.get("ContentLength", -1))
        if length != ref.bytes:
            resp["Body"].close()
            raise ArtifactIntegrityFailed(
                f"{ref.uri} holds {length} bytes, expected {ref.bytes}",
                details={"uri": ref.uri, "expected_bytes": ref.bytes, "actual_bytes": length},
            )
        return resp["Body"], length

    def iter_verified(self, ref: ObjectRef, chunk_size: int = 64 * 1024) -> Iterator[bytes]:
        """Yield the object's bytes; raise ArtifactIntegrityFailed at the end on any mismatch."""
        body, _ = self._open(ref)
        hasher = hashlib.sha256()
        seen = 0
        try:
            try:
                for chunk in body.iter_chunks(chunk_size):
                    seen += len(chunk)
                    if seen > ref.bytes:
                        break
                    hasher.update(chunk)
                    yield chunk
            except (bce.ReadTimeoutError, bce.ResponseStreamingError, OSError) as exc:
                raise self._unavailable(exc, f"read {ref.uri}") from exc
        finally:
            body.close()
        actual = "sha256:" + hasher.hexdigest()
        if seen != ref.bytes or actual != ref.sha256:
            raise ArtifactIntegrityFailed(
                f"{ref.uri} failed verification: expected {ref.sha256} ({ref.bytes} bytes), "
                f"read {actual if seen == ref.bytes else 'a different size'} ({seen} bytes)",
                details={"uri": ref.uri, "expected": ref.sha256, "actual": actual},
            )

    @patient
    def get_bytes(self, ref: ObjectRef, *, max_bytes: int = 256 * 1024 * 1024) -> bytes:
        """The object's bytes, verified against ``ref`` (size and SHA-256)."""
        if ref.bytes > max_bytes:
            raise ValueError(f"{ref.uri} is {ref.bytes} bytes, over max_bytes={max_bytes}; use get_to_file")
        return b"".join(self.iter_verified(ref, chunk_size=READ_CHUNK))

    def get_many(self, refs: Sequence[ObjectRef]) -> list[bytes]:
        """``get_bytes`` of every ref, in the order given, ``READ_CONCURRENCY`` fetched at a time
        (many small objects: a run's groups); a failure raises the first failing ref's error."""
        return _fetch_in_order(self.get_bytes, refs)

    def get_keys(self, keys: Sequence[str]) -> list[bytes | None]:
        """``get_key`` of every key, in the order given, fetched like ``get_many``."""
        return _fetch_in_order(self.get_key, keys)

    @patient
    def read_head(self, ref: ObjectRef, max_bytes: int) -> tuple[int, bytes]:
        """``(size, first bytes)`` of the object (at most ``max_bytes`` of it, unverified: a
        check before a run starts, not a read of the artifact); ArtifactNotFound when absent."""
        try:
            resp = self._client.get_object(Bucket=ref.bucket, Key=ref.key, Range=f"bytes=0-{max_bytes - 1}")
            try:
                head = resp["Body"].read()
            finally:
                resp["Body"].close()
        except Exception as exc:
            raise self._map(exc, "get", ref.key) from exc
        whole = str(resp.get("ContentRange") or "").rpartition("/")[2]
        return (int(whole) if whole.isdigit() else int(resp.get("ContentLength", len(head)))), head

    @patient
    def get_to_file(self, ref: ObjectRef, path: Path) -> None:
        """Stream the object to ``path``: staged next to it, verified, fsynced, renamed."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.part")
        try:
            with open(staged, "wb") as fh:
                for chunk in self.iter_verified(ref, chunk_size=READ_CHUNK):
                    fh.write(chunk)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(staged, path)
        finally:
            if staged.exists():
                staged.unlink()

    @patient
    def get_key(self, key: str) -> bytes | None:
        """The raw bytes at ``key`` in this bucket, or None when absent (unverified)."""
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=key)
            try:
                return resp["Body"].read()
            finally:
                resp["Body"].close()
        except Exception as exc:
            if error_code(exc) != "NoSuchBucket" and (
                http_status(exc) == 404 or error_code(exc) in ("NoSuchKey", "NotFound")
            ):
                return None
            raise self._map(exc, "get", key) from exc

    @patient
    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=key)
            return True
        except bce.ClientError as exc:
            if http_status(exc) == 404 or error_code(exc) in ("NoSuchKey", "NotFound", "404"):
                return False
            raise self._map(exc, "head", key) from exc
        except Exception as exc:
            raise self._map(exc, "head", key) from exc

    @patient
    def list_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix``, sorted."""
        keys: list[str] = []
        try:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                keys.extend(item["Key"] for item in page.get("Contents", []) or [])
        except Exception as exc:
            raise self._map(exc, "list", prefix) from exc
        return sorted(keys)


# Reads of many small objects in flight at once (within boto3's pool of 10 connections).
READ_CONCURRENCY = 8
_Item = TypeVar("_Item")
_Fetched = TypeVar("_Fetched")


def _fetch_in_order(fetch: Callable[[_Item], _Fetched], items: Sequence[_Item]) -> list[_Fetched]:
    """``[fetch(item) for item in items]``, run on a few threads; results and the error raised
    (the first failing item's, in order) are those of the loop."""
    if len(items) < 2:
        return [fetch(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(READ_CONCURRENCY, len(items)), thread_name_prefix="s3-read") as pool:
        return list(pool.map(fetch, items))
