"""References to stored objects: :class:`ObjectRef` (``uri``, ``sha256``, ``bytes``) and the
content address of a blob. Pure (no boto3): :class:`ObjectRef` is what crosses Temporal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.canonical import hex_of, is_digest

BLOB_PREFIX = "blobs/sha256/"


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
