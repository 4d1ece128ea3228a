"""How a botocore failure becomes a Kiln error: connection failures, timeouts and 5xx are a
retryable :class:`~kiln.core.errors.StorageUnavailable` naming the endpoint (never the secret key),
404 is :class:`~kiln.core.errors.ArtifactNotFound`, a rejected checksum is
:class:`~kiln.core.errors.ArtifactIntegrityFailed`, refused credentials a non-retryable
``storage_unavailable``. :class:`S3Errors` is the store's base that owns the mapping."""

from __future__ import annotations

import botocore.exceptions as bce

from kiln.core.errors import ArtifactIntegrityFailed, ArtifactNotFound, StorageUnavailable


class S3Errors:
    """The error mapping of a store on ``endpoint``, bucket ``bucket``."""

    endpoint: str
    bucket: str

    def _unavailable(self, exc: BaseException, action: str) -> StorageUnavailable:
        return StorageUnavailable(
            f"S3 storage at {self.endpoint} is unavailable ({action}): {type(exc).__name__}: {safe_text(exc)}",
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
            code = error_code(exc)
            status = http_status(exc)
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


def error_code(exc: BaseException) -> str:
    if isinstance(exc, bce.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def http_status(exc: BaseException) -> int | None:
    if isinstance(exc, bce.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if status is not None else None
    return None


def safe_text(exc: BaseException) -> str:
    """A short description of ``exc`` (botocore messages never contain the secret key)."""
    text = str(exc)
    return text if len(text) <= 300 else text[:297] + "..."
