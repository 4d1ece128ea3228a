"""The S3 object store Kiln keeps every large artifact in (boto3, path-style addressing).

This module owns the store's construction and how bytes get into S3-compatible storage
(SeaweedFS, MinIO, AWS); its reads are :mod:`kiln.core.artifacts.reads`, its error mapping
:mod:`kiln.core.artifacts.s3_errors`, :class:`ObjectRef` :mod:`kiln.core.artifacts.refs`:

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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
import botocore.exceptions as bce
from botocore.config import Config

from kiln.core.artifacts.outage import OUTAGE_WAIT_S, patient
from kiln.core.artifacts.reads import READ_CHUNK, StoreReads
from kiln.core.artifacts.refs import BLOB_PREFIX, ObjectRef, blob_key
from kiln.core.artifacts.s3_errors import error_code, http_status
from kiln.core.canonical import sha256_bytes
from kiln.core.errors import ArtifactIntegrityFailed, ArtifactPublicationFailed, StorageUnavailable
from kiln.core.telemetry.prometheus import S3_BYTES_WRITTEN

if TYPE_CHECKING:
    from kiln.core.settings import Settings

__all__ = ["ObjectRef", "S3Store", "BLOB_PREFIX", "blob_key"]

MULTIPART_THRESHOLD = 64 * 1024 * 1024
MULTIPART_CHUNK = 16 * 1024 * 1024
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 15.0  # the longest one request waits for a byte (a 16 MiB part's answer included)
TRIES = 2  # botocore's tries of one request (total, not retries)


def _b64_sha256(raw_digest: bytes) -> str:
    return base64.b64encode(raw_digest).decode("ascii")


class S3Store(StoreReads):
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

    # ------------------------------------------------------------------------------------ bucket

    @patient
    def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist (idempotent, tolerant of a concurrent create)."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except bce.ClientError as exc:
            if http_status(exc) not in (404, 400) and error_code(exc) not in ("NoSuchBucket", "404"):
                raise self._map(exc, "head bucket") from exc
        except Exception as exc:
            raise self._map(exc, "head bucket") from exc
        try:
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            if self.region and self.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
            self._client.create_bucket(**kwargs)
        except bce.ClientError as exc:
            if error_code(exc) in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
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

    def _put_checked(self, key: str, data: bytes, **conditions: str) -> None:
        """One ``put_object`` of ``data`` at ``key`` with the SHA-256 checksum the server verifies
        (``conditions``: e.g. ``IfNoneMatch``); the caller maps the client's errors."""
        self._client.put_object(
            Bucket=self.bucket,
            Key=key,
            Body=data,
            ChecksumSHA256=_b64_sha256(hashlib.sha256(data).digest()),
            **conditions,
        )

    @patient
    def put_key(self, key: str, data: bytes, *, action: str = "put") -> None:
        """Write ``data`` at ``key`` (overwriting), with a SHA-256 checksum the server verifies.

        For mutable pointers only (e.g. a promoted adapter name); artifacts use :meth:`put_blob`.
        """
        data = bytes(data)
        try:
            self._put_checked(key, data)
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
            while chunk := fh.read(READ_CHUNK):
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
            self._put_checked(key, data, IfNoneMatch="*")
            S3_BYTES_WRITTEN.inc(len(data))
            return True
        except bce.ClientError as exc:
            if http_status(exc) not in (412, 409) and error_code(exc) not in (
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
