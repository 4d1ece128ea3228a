"""S3Store against a real SeaweedFS: verified round trips, corruption, conditional puts, outages."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.core.artifacts.manifest import (
    build_manifest,
    manifest_bytes,
    manifest_key,
    parse_manifest,
    verify_manifest_against_store,
)
from kiln.core.artifacts.store import ObjectRef, S3Store
from kiln.core.errors import (
    ArtifactIntegrityFailed,
    ArtifactNotFound,
    ArtifactPublicationFailed,
    StorageUnavailable,
)
from kiln.devstack.processes import free_port
from tests.support.stack import assert_nothing_listening, start_test_seaweedfs

BUCKET = "kiln-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[tuple[str, str, str]]:
    proc, endpoint, ak, sk = start_test_seaweedfs(tmp_path_factory.mktemp("s3"), bucket=BUCKET)
    try:
        yield endpoint, ak, sk
    finally:
        proc.stop()
        assert_nothing_listening(proc)


@pytest.fixture()
def store(s3) -> S3Store:
    endpoint, ak, sk = s3
    return S3Store(endpoint=endpoint, access_key=ak, secret_key=sk, bucket=BUCKET)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_put_get_round_trip_with_hashlib_digests(store: S3Store) -> None:
    data = os.urandom(300_000)
    ref = store.put_blob(data)
    assert ref.sha256 == _digest(data)
    assert ref.bytes == len(data)
    assert ref.uri == f"s3://{BUCKET}/blobs/sha256/{hashlib.sha256(data).hexdigest()}"
    assert store.get_bytes(ref) == data
    assert store.put_blob(data) == ref  # idempotent
    assert b"".join(store.iter_verified(ref, chunk_size=7000)) == data
    assert ObjectRef.from_dict(ref.to_dict()) == ref
    assert store.exists(ref.key)
    assert ref.key in store.list_keys("blobs/sha256/")


def test_empty_blob(store: S3Store) -> None:
    ref = store.put_blob(b"")
    assert ref.bytes == 0 and store.get_bytes(ref) == b""


def test_put_file_and_get_to_file(store: S3Store, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1_500_000))
    ref = store.put_file(src)
    assert ref.sha256 == _digest(src.read_bytes())
    dst = tmp_path / "out" / "dst.bin"
    store.get_to_file(ref, dst)
    assert dst.read_bytes() == src.read_bytes()
    assert [p.name for p in dst.parent.iterdir()] == ["dst.bin"]  # no staging leftovers


def test_put_file_multipart_with_part_checksums(store: S3Store, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 * 1024 * 1024 + 123))
    ref = store.put_file(src, multipart_threshold=5 * 1024 * 1024, part_size=5 * 1024 * 1024)
    assert ref.sha256 == _digest(src.read_bytes())
    assert ref.bytes == src.stat().st_size
    assert store.get_bytes(ref) == src.read_bytes()


def test_corrupted_object_is_detected(store: S3Store, tmp_path: Path) -> None:
    data = b"the real bytes " * 100
    ref = store.put_blob(data)
    # Overwrite behind the store's back: same size, different content.
    store.client.put_object(Bucket=BUCKET, Key=ref.key, Body=b"X" + data[1:])
    with pytest.raises(ArtifactIntegrityFailed) as info:
        store.get_bytes(ref)
    assert ref.uri in info.value.message and info.value.code == "openenv_artifact_integrity_failed"
    with pytest.raises(ArtifactIntegrityFailed):
        store.get_to_file(ref, tmp_path / "never.bin")
    assert not (tmp_path / "never.bin").exists()
    assert list(tmp_path.iterdir()) == []
    # Different size is caught before any byte is returned.
    store.client.put_object(Bucket=BUCKET, Key=ref.key, Body=data + b"!")
    with pytest.raises(ArtifactIntegrityFailed, match="bytes, expected"):
        store.get_bytes(ref)
    # Re-putting the content heals the content-addressed key.
    assert store.put_blob(data) == ref
    assert store.get_bytes(ref) == data


def test_missing_object(store: S3Store) -> None:
    data = b"never stored " + os.urandom(8)
    ref = ObjectRef(uri=f"s3://{BUCKET}/blobs/sha256/{hashlib.sha256(data).hexdigest()}",
                    sha256=_digest(data), bytes=len(data))
    with pytest.raises(ArtifactNotFound):
        store.get_bytes(ref)
    assert store.get_key(ref.key) is None
    assert not store.exists(ref.key)


def test_get_many_reads_in_order_and_raises_the_first_failure(store: S3Store) -> None:
    blobs = [f"group {n} ".encode() * (n + 1) for n in range(20)]
    refs = [store.put_blob(data) for data in blobs]
    assert store.get_many(refs) == blobs
    assert store.get_many(refs[:1]) == blobs[:1] and store.get_many([]) == []
    assert store.get_keys([refs[3].key, "no/such/key", refs[0].key]) == [blobs[3], None, blobs[0]]
    # Two bad refs: the error is the first one's in the given order, as a loop would raise it.
    missing = b"never stored " + os.urandom(8)
    absent = ObjectRef(uri=f"s3://{BUCKET}/blobs/sha256/{hashlib.sha256(missing).hexdigest()}",
                       sha256=_digest(missing), bytes=len(missing))
    wrong = ObjectRef(uri=refs[5].uri, sha256=refs[6].sha256, bytes=refs[5].bytes)
    with pytest.raises(ArtifactIntegrityFailed) as info:
        store.get_many([*refs[:4], wrong, *refs[7:], absent])
    assert refs[5].uri in info.value.message
    with pytest.raises(ArtifactNotFound):
        store.get_many([*refs[:4], absent, *refs[7:], wrong])


def test_put_if_absent_uses_conditional_put(store: S3Store) -> None:
    key = f"runs/r-{os.urandom(4).hex()}/manifest.json"
    assert store.put_if_absent(key, b"first") is True
    assert store.put_if_absent(key, b"first") is False
    with pytest.raises(ArtifactPublicationFailed, match="different content"):
        store.put_if_absent(key, b"second")
    assert store.get_key(key) == b"first"
    # The server itself enforces it (412), not only the store's read-back.
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as info:
        store.client.put_object(Bucket=BUCKET, Key=key, Body=b"third", IfNoneMatch="*")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412


def test_manifest_publication_and_verification(store: S3Store) -> None:
    a = store.put_blob(b"adapter weights")
    b = store.put_blob(b"receipt json")
    run_id = f"run-{os.urandom(4).hex()}"
    manifest = build_manifest(
        run_id,
        [
            {"name": "receipt.json", **b.to_dict(), "media_type": "application/json"},
            {"name": "adapter.safetensors", **a.to_dict(), "media_type": "application/octet-stream"},
        ],
        {"status": "succeeded"},
    )
    assert store.put_if_absent(manifest_key(run_id), manifest_bytes(manifest)) is True
    loaded = parse_manifest(store.get_key(manifest_key(run_id)))
    assert loaded == manifest
    verify_manifest_against_store(loaded, store)
    store.client.put_object(Bucket=BUCKET, Key=a.key, Body=b"adapter weightz")
    with pytest.raises(ArtifactIntegrityFailed, match="adapter.safetensors") as info:
        verify_manifest_against_store(loaded, store)
    assert info.value.details["artifact"] == "adapter.safetensors"


def test_wrong_credentials_are_refused(s3) -> None:
    endpoint, ak, _ = s3
    bad = S3Store(endpoint=endpoint, access_key=ak, secret_key="wrong-secret-value", bucket=BUCKET)
    with pytest.raises(StorageUnavailable) as info:
        bad.put_blob(b"x")
    assert "wrong-secret-value" not in str(info.value)
    assert info.value.retryable is False


def test_storage_unavailable_on_closed_port_is_bounded() -> None:
    port = free_port()
    store = S3Store(endpoint=f"http://127.0.0.1:{port}", access_key="ak",
                    secret_key="super-secret-value", bucket=BUCKET, connect_timeout_s=1,
                    read_timeout_s=2, max_attempts=2)
    t0 = time.monotonic()
    for call in (lambda: store.put_blob(b"x"), lambda: store.list_keys(""),
                 lambda: store.get_key("k"), lambda: store.exists("k")):
        with pytest.raises(StorageUnavailable) as info:
            call()
        assert f"127.0.0.1:{port}" in str(info.value)
        assert "super-secret-value" not in str(info.value)
        assert info.value.retryable is True
    assert time.monotonic() - t0 < 15


def test_server_validates_the_sha256_checksum(store: S3Store) -> None:
    import base64

    from botocore.exceptions import ClientError

    wrong = base64.b64encode(hashlib.sha256(b"other bytes").digest()).decode()
    with pytest.raises(ClientError) as info:
        store.client.put_object(Bucket=BUCKET, Key="checksum-probe", Body=b"bytes",
                                ChecksumSHA256=wrong)
    assert info.value.response["Error"]["Code"] == "BadDigest"
    assert not store.exists("checksum-probe")
