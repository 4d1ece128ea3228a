"""The S3 object store Kiln keeps every large artifact in (boto3, path-style addressing).

This module owns how bytes get into and out of S3-compatible storage (SeaweedFS, MinIO, AWS):

- content-addressed blobs under ``blobs/sha256/<hex>``, uploaded with the SHA-256 checksum so
  the server rejects corrupted uploads; big files go up as multipart with per-part checksums;
- verified reads: size and digest are checked against the :class:`ObjectRef` on every read, and a
  mismatch raises :class:`~kiln.core.errors.ArtifactIntegrityFailed`;
- conditional publication (``If-None-Match: *``) for manifests and other write-once keys;
- error mapping: connection failures and 5xx become retryable
  :class:`~kiln.core.errors.StorageUnavailable` naming the endpoint (never the secret key);
- bounded calls: every request has a connect and a read timeout (:data:`CONNECT_TIMEOUT_S`,
  :data:`READ_TIMEOUT_S`) and botocore tries it :data:`TRIES` times, so a frozen store (accepting
  connections, answering nothing) gives ``storage_unavailable`` within about 30 s; a worker's
  store then rides the outage out (:mod:`kiln.core.artifacts.outage`).

Only :class:`ObjectRef` (``uri``, ``sha256``, ``bytes``) crosses Temporal; it is tiny.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import boto3
import botocore.exceptions as bce
from botocore.config import Config

from kiln.core.artifacts.outage import OUTAGE_WAIT_S, patient
from kiln.core.canonical import hex_of, is_digest, sha256_bytes
from kiln.core.telemetry.prometheus import S3_BYTES_WRITTEN
from kiln.core.errors import (
    ArtifactIntegrityFailed,
    ArtifactNotFound,
    ArtifactPublicationFailed,
    StorageUnavailable,
)

if TYPE_CHECKING:
    from kiln.core.settings import Settings

__all__ = ["ObjectRef", "S3Store", "BLOB_PREFIX", "blob_key"]

BLOB_PREFIX = "blobs/sha256/"
MULTIPART_THRESHOLD = 64 * 1024 * 1024
MULTIPART_CHUNK = 16 * 1024 * 1024
_READ_CHUNK = 1024 * 1024
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 15.0  # the longest one request waits for a byte (a 16 MiB part's answer included)
TRIES = 2  # botocore's tries of one request (total, not retries)


def blob_key(digest: str) -> str:
    """The content-addressed key of a ``sha256:<hex>`` digest."""
    return BLOB_PREFIX + hex_of(digest)


@dataclass(frozen=True)
class ObjectRef:
    """A reference to one stored object: where it is, its digest and its size in bytes."""

    uri: str  # s3://bucket/key
    sha256: str  # "sha256:<hex>" of the bytes
    bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or not self.uri.startswith("s3://"):
            raise ValueError(f"ObjectRef.uri must be an s3:// URI, got {self.uri!r}")
        bucket, _, key = self.uri[len("s3://") :].partition("/")
        if not bucket or not key:
            raise ValueError(f"ObjectRef.uri must name a bucket and a key, got {self.uri!r}")
        if not is_digest(self.sha256):
            raise ValueError(f"ObjectRef.sha256 must be 'sha256:<64 hex>', got {self.sha256!r}")
        if not isinstance(self.bytes, int) or isinstance(self.bytes, bool) or self.bytes < 0:
            raise ValueError(f"ObjectRef.bytes must be a non-negative int, got {self.bytes!r}")

    @property
    def bucket(self) -> str:
        return self.uri[len("s3://") :].partition("/")[0]

    @property
    def key(self) -> str:
        return self.uri[len("s3://") :].partition("/")[2]

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "sha256": self.sha256, "bytes": self.bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ObjectRef:
        return cls(uri=str(data["uri"]), sha256=str(data["sha256"]), bytes=int(data["bytes"]))


def _b64_sha256(raw_digest: bytes) -> str:
    return base64.b64encode(raw_digest).decode("ascii")


class S3Store:
    """A bucket on an S3-compatible endpoint, with verified reads and content-addressed writes."""

    def __init__(
        self,
        *,
        endpoint: str,
        access_key: str,
        secret_key: str,
        bucket: str,
        region: str = "us-east-1",
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_attempts: int = TRIES,
        outage_wait_s: float = 0,
    ) -> None:
        """``outage_wait_s`` > 0: every call rides a retryable outage out for that long
        (:func:`kiln.core.artifacts.outage.ride_out`)."""
        self.endpoint = endpoint
        self.bucket = bucket
        self.region = region
        self.outage_wait_s = float(outage_wait_s)
        self._credentials = (access_key, secret_key)
        self._probe_client: Any = None
        config = Config(
            region_name=region,
            s3={"addressing_style": "path"},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"total_max_attempts": max_attempts, "mode": "standard"},  # tries, not retries
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            signature_version="s3v4",
        )
        session = boto3.session.Session()
        self._client = session.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=config,
        )

    def __repr__(self) -> str:  # never shows credentials
        return f"S3Store(endpoint={self.endpoint!r}, bucket={self.bucket!r})"

    @classmethod
    def from_settings(cls, settings: Settings, *, outage_wait: bool = False) -> S3Store:
        """The configured store; ``outage_wait`` (workers): calls wait out an outage for
        :data:`~kiln.core.artifacts.outage.OUTAGE_WAIT_S`; without it (the API) they fail at once."""
        access_key, secret_key = settings.s3_key_pair()
        return cls(
            endpoint=settings.effective_s3_endpoint,
            access_key=access_key,
            secret_key=secret_key,
            bucket=settings.s3_bucket,
            region=settings.s3_region,
            outage_wait_s=OUTAGE_WAIT_S if outage_wait else 0,
        )

    def impatient(self) -> S3Store:
        """This store (same client) with calls that never wait out an outage: best-effort writes."""
        if self.outage_wait_s <= 0:
            return self
        view = copy.copy(self)
        view.outage_wait_s = 0
        return view

    def probe_client(self, timeout_s: float) -> Any:
        """A client of this endpoint for one bounded probe (1 try, ``timeout_s`` to connect and
        to read), made once."""
        if self._probe_client is None:
            config = Config(
                region_name=self.region,
                s3={"addressing_style": "path"},
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
                retries={"total_max_attempts": 1, "mode": "standard"},
                signature_version="s3v4",
            )
            self._probe_client = boto3.session.Session().client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=self._credentials[0],
                aws_secret_access_key=self._credentials[1],
                config=config,
            )
        return self._probe_client

    @property
    def client(self) -> Any:
        """The underlying boto3 client (for tests and tools; domain code uses the methods)."""
        return self._client

    def uri_for(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # ----------------------------------------------------------------------------- error mapping

    def _unavailable(self, exc: BaseException, action: str) -> StorageUnavailable:
        return StorageUnavailable(
            f"S3 storage at {self.endpoint} is unavailable ({action}): {type(exc).__name__}: {_safe(exc)}",
            hint="check that the S3 server is running and KILN_S3_ENDPOINT is right",
            details={"endpoint": self.endpoint, "bucket": self.bucket},
        )

    def _map(self, exc: BaseException, action: str, key: str | None = None) -> Exception:
        """Turn a botocore failure into a KilnError (or return it unchanged if unknown)."""
        if isinstance(
            exc,
            (
                bce.EndpointConnectionError,
                bce.ConnectTimeoutError,
                bce.ReadTimeoutError,
                bce.ConnectionClosedError,
                bce.ConnectionError,
                bce.HTTPClientError,
            ),
        ):
            return self._unavailable(exc, action)
        if isinstance(exc, bce.ClientError):
            code = _error_code(exc)
            status = _status(exc)
            where = f"s3://{self.bucket}/{key}" if key else f"bucket {self.bucket!r}"
            if code in ("NoSuchKey", "NotFound", "404") or status == 404:
                if code == "NoSuchBucket":
                    return ArtifactNotFound(
                        f"bucket {self.bucket!r} does not exist at {self.endpoint}",
                        hint="run ensure_bucket() or create the bucket",
                        details={"endpoint": self.endpoint, "bucket": self.bucket},
                    )
                return ArtifactNotFound(f"{where} not found at {self.endpoint} ({action})", details={"uri": where})
            if code in ("BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"):
                return ArtifactIntegrityFailed(
                    f"the server rejected the upload of {where}: checksum mismatch ({code})",
                    retryable=True,
                    details={"uri": where},
                )
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return StorageUnavailable(
                    f"S3 storage at {self.endpoint} refused the credentials ({action}: {code})",
                    retryable=False,
                    hint="check KILN_S3_ACCESS_KEY and KILN_S3_SECRET_KEY",
                    details={"endpoint": self.endpoint, "bucket": self.bucket},
                )
            if status is not None and status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError"):
                return self._unavailable(exc, action)
        return exc  # type: ignore[return-value]  # a non-storage error passes through unchanged

    # ------------------------------------------------------------------------------------ bucket

    @patient
    def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist (idempotent, tolerant of a concurrent create)."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except bce.ClientError as exc:
            if _status(exc) not in (404, 400) and _error_code(exc) not in ("NoSuchBucket", "404"):
                raise self._map(exc, "head bucket") from exc
        except Exception as exc:
            raise self._map(exc, "head bucket") from exc
        try:
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            if self.region and self.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
            self._client.create_bucket(**kwargs)
        except bce.ClientError as exc:
            if _error_code(exc) in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            raise self._map(exc, "create bucket") from exc
        except Exception as exc:
            raise self._map(exc, "create bucket") from exc

    # ------------------------------------------------------------------------------------ writes

    @patient
    def put_blob(self, data: bytes) -> ObjectRef:
        """Store ``data`` under its content address; idempotent (same key, same bytes)."""
        data = bytes(data)
        digest = sha256_bytes(data)
        key = blob_key(digest)
        self.put_key(key, data, action="put blob")
        return ObjectRef(uri=self.uri_for(key), sha256=digest, bytes=len(data))

    @patient
    def put_key(self, key: str, data: bytes, *, action: str = "put") -> None:
        """Write ``data`` at ``key`` (overwriting), with a SHA-256 checksum the server verifies.

        For mutable pointers only (e.g. a promoted adapter name); artifacts use :meth:`put_blob`.
        """
        data = bytes(data)
        try:
            self._client.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=data,
                ChecksumSHA256=_b64_sha256(hashlib.sha256(data).digest()),
            )
        except Exception as exc:
            raise self._map(exc, action, key) from exc
        S3_BYTES_WRITTEN.inc(len(data))

    @patient
    def put_file(
        self,
        path: Path,
        *,
        multipart_threshold: int = MULTIPART_THRESHOLD,
        part_size: int = MULTIPART_CHUNK,
    ) -> ObjectRef:
        """Stream a file to its content address (multipart with per-part SHA-256 when big)."""
        path = Path(path)
        hasher = hashlib.sha256()
        size = 0
        with open(path, "rb") as fh:
            while chunk := fh.read(_READ_CHUNK):
                hasher.update(chunk)
                size += len(chunk)
        digest = "sha256:" + hasher.hexdigest()
        key = blob_key(digest)
        try:
            if size < multipart_threshold:
                with open(path, "rb") as fh:
                    self._client.put_object(
                        Bucket=self.bucket,
                        Key=key,
                        Body=fh,
                        ContentLength=size,
                        ChecksumSHA256=_b64_sha256(hasher.digest()),
                    )
            else:
                self._multipart_upload(path, key, part_size)
        except (ArtifactIntegrityFailed, StorageUnavailable):
            raise
        except Exception as exc:
            raise self._map(exc, "put file", key) from exc
        self._check_size(key, size)
        S3_BYTES_WRITTEN.inc(size)
        return ObjectRef(uri=self.uri_for(key), sha256=digest, bytes=size)

    def _multipart_upload(self, path: Path, key: str, part_size: int) -> None:
        upload = self._client.create_multipart_upload(Bucket=self.bucket, Key=key, ChecksumAlgorithm="SHA256")
        upload_id = upload["UploadId"]
        parts: list[dict[str, Any]] = []
        try:
            with open(path, "rb") as fh:
                number = 1
                while chunk := fh.read(part_size):
                    checksum = _b64_sha256(hashlib.sha256(chunk).digest())
                    resp = self._client.upload_part(
                        Bucket=self.bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=chunk,
                        ChecksumSHA256=checksum,
                    )
                    parts.append({"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": checksum})
                    number += 1
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - best effort; the original error matters
                pass
            raise

    def _check_size(self, key: str, size: int) -> None:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            raise self._map(exc, "head after put", key) from exc
        if int(head.get("ContentLength", -1)) != size:
            raise ArtifactIntegrityFailed(
                f"s3://{self.bucket}/{key} has {head.get('ContentLength')} bytes after upload, expected {size}",
                retryable=True,
                details={"uri": self.uri_for(key)},
            )

    @patient
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist (``If-None-Match: *``).

        True when written; False when it already holds exactly ``data``;
        :class:`ArtifactPublicationFailed` when it holds different bytes.
        """
        data = bytes(data)
        try:
            self._client.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=data,
                IfNoneMatch="*",
                ChecksumSHA256=_b64_sha256(hashlib.sha256(data).digest()),
            )
            S3_BYTES_WRITTEN.inc(len(data))
            return True
        except bce.ClientError as exc:
            if _status(exc) not in (412, 409) and _error_code(exc) not in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
            ):
                raise self._map(exc, "conditional put", key) from exc
        except Exception as exc:
            raise self._map(exc, "conditional put", key) from exc
        existing = self.get_key(key)
        if existing == data:
            return False
        raise ArtifactPublicationFailed(
            f"s3://{self.bucket}/{key} already exists with different content "
            f"({sha256_bytes(existing) if existing is not None else 'unreadable'} != "
            f"{sha256_bytes(data)})",
            details={"uri": self.uri_for(key)},
        )

    # ------------------------------------------------------------------------------------- reads

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
        return b"".join(self.iter_verified(ref, chunk_size=_READ_CHUNK))

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
                for chunk in self.iter_verified(ref, chunk_size=_READ_CHUNK):
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
            if _error_code(exc) != "NoSuchBucket" and (
                _status(exc) == 404 or _error_code(exc) in ("NoSuchKey", "NotFound")
            ):
                return None
            raise self._map(exc, "get", key) from exc

    @patient
    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=key)
            return True
        except bce.ClientError as exc:
            if _status(exc) == 404 or _error_code(exc) in ("NoSuchKey", "NotFound", "404"):
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


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, bce.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _status(exc: BaseException) -> int | None:
    if isinstance(exc, bce.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if status is not None else None
    return None


def _safe(exc: BaseException) -> str:
    """A short description of ``exc`` (botocore messages never contain the secret key)."""
    text = str(exc)
    return text if len(text) <= 300 else text[:297] + "..."
