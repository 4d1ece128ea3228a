"""The embedded SeaweedFS is closed: only S3 with Kiln's key pair reads or writes objects.

The filer, volume and master HTTP ports listen on loopback for ``weed``'s own components; an
anonymous request to the filer or a master-assigned volume write must be refused (401), while
S3 with the configured (non-default) keys works and a wrong secret is refused.
"""

from __future__ import annotations

import json
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from kiln.artifacts.store import S3Store
from tests.support.stack import start_test_seaweedfs

BUCKET = "kiln-auth"


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str, str]]:
    root = tmp_path_factory.mktemp("seaweed-auth")
    proc, endpoint, access, secret = start_test_seaweedfs(root, bucket=BUCKET)
    try:
        yield root / "seaweedfs", endpoint, access, secret
    finally:
        proc.stop()


def _status(method: str, url: str, data: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.timeout(120)
def test_filer_and_volume_refuse_anonymous_requests(seaweed: tuple[Path, str, str, str]) -> None:
    data_dir, endpoint, access, secret = seaweed
    ports = json.loads((data_dir / "ports.json").read_text())
    store = S3Store(endpoint=endpoint, access_key=access, secret_key=secret, bucket=BUCKET)
    store.client.put_object(Bucket=BUCKET, Key="runs/r1/a.txt", Body=b"kiln bytes")
    filer = f"http://127.0.0.1:{ports['filer']}"
    path = f"/buckets/{BUCKET}/runs/r1/a.txt"
    # Anonymous write, read, delete and listing through the filer: all refused.
    assert _status("PUT", f"{filer}/buckets/{BUCKET}/anon.txt", b"x") == 401
    assert _status("GET", filer + path) == 401
    assert _status("DELETE", filer + path) == 401
    assert _status("GET", f"{filer}/buckets/{BUCKET}/") == 401
    # A file id from the master cannot be written on the volume server without a JWT.
    master = f"http://127.0.0.1:{ports['master']}"
    with urllib.request.urlopen(f"{master}/dir/assign", timeout=10) as resp:
        assigned = json.loads(resp.read())
    assert _status("PUT", f"http://{assigned['url']}/{assigned['fid']}", b"x") == 401
    # The object is intact, readable with the keys, and no anonymous object appeared.
    assert store.client.get_object(Bucket=BUCKET, Key="runs/r1/a.txt")["Body"].read() == b"kiln bytes"
    assert store.list_keys("") == ["runs/r1/a.txt"]


@pytest.mark.timeout(120)
def test_s3_needs_the_configured_keys(seaweed: tuple[Path, str, str, str]) -> None:
    data_dir, endpoint, access, secret = seaweed
    assert secret != "kiln-secret-key"  # not the settings default
    assert _status("PUT", f"{endpoint}/{BUCKET}/anon.txt", b"x") == 403
    wrong = S3Store(endpoint=endpoint, access_key=access, secret_key=secret + "-wrong", bucket=BUCKET,
                    max_attempts=1)
    with pytest.raises(Exception) as refused:
        wrong.client.put_object(Bucket=BUCKET, Key="wrong.txt", Body=b"x")
    assert "SignatureDoesNotMatch" in str(refused.value) or "AccessDenied" in str(refused.value)
    store = S3Store(endpoint=endpoint, access_key=access, secret_key=secret, bucket=BUCKET)
    assert not store.exists("wrong.txt") and not store.exists("anon.txt")
    # The secrets live in files only this user can read.
    for name in ("security.toml", "s3-identities.json"):
        mode = stat.S_IMODE((data_dir / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    identities = json.loads((data_dir / "s3-identities.json").read_text())["identities"]
    assert [c["accessKey"] for i in identities for c in i["credentials"]] == [access]
