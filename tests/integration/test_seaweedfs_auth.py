"""The embedded SeaweedFS is closed: only S3 with Kiln's key pair reads or writes objects.

The filer, volume and master ports listen on loopback for ``weed``'s own components, with mutual
TLS (a CA made at every start) and JWTs: plain HTTP, HTTPS without the client certificate, and
— even with the certificate — filer reads/writes and volume writes without a JWT are refused; the
master's admin endpoint (collection delete) is unreachable without the certificate and the data
stays intact; S3 with the configured (non-default) keys works and a wrong secret is refused.
"""

from __future__ import annotations

import json
import ssl
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from kiln.core.artifacts.store import S3Store
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


def _status(method: str, url: str, data: bytes | None = None, context: ssl.SSLContext | None = None) -> int | str:
    """The HTTP status, or ``"refused"`` when no HTTP answer came (TLS handshake refused, reset)."""
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, ssl.SSLError, ConnectionError):
        return "refused"


def _contexts(data_dir: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(trusts the server but has no client certificate, holds the client certificate)."""
    tls = data_dir / "tls"
    anonymous = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    holder = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    holder.load_cert_chain(str(tls / "node.pem"), str(tls / "node.key"))
    return anonymous, holder


@pytest.mark.timeout(120)
def test_internal_ports_refuse_anonymous_requests(seaweed: tuple[Path, str, str, str]) -> None:
    data_dir, endpoint, access, secret = seaweed
    ports = json.loads((data_dir / "ports.json").read_text())
    store = S3Store(endpoint=endpoint, access_key=access, secret_key=secret, bucket=BUCKET)
    store.client.put_object(Bucket=BUCKET, Key="runs/r1/a.txt", Body=b"kiln bytes")
    anonymous, holder = _contexts(data_dir)
    path = f"/buckets/{BUCKET}/runs/r1/a.txt"
    for port in (ports["filer"], ports["master"], ports["volume"]):
        # Plain HTTP gets no service; HTTPS without the client certificate fails the handshake.
        assert _status("GET", f"http://127.0.0.1:{port}/") in (400, "refused"), port
        assert _status("GET", f"https://127.0.0.1:{port}/", context=anonymous) == "refused", port
    filer = f"https://127.0.0.1:{ports['filer']}"
    assert _status("PUT", f"{filer}/buckets/{BUCKET}/anon.txt", b"x", anonymous) == "refused"
    assert _status("DELETE", filer + path, context=anonymous) == "refused"
    # Even holding the certificate, the filer wants a JWT for reads, writes, deletes and listings.
    assert _status("PUT", f"{filer}/buckets/{BUCKET}/anon.txt", b"x", holder) == 401
    assert _status("GET", filer + path, context=holder) == 401
    assert _status("DELETE", filer + path, context=holder) == 401
    assert _status("GET", f"{filer}/buckets/{BUCKET}/", context=holder) == 401
    master = f"https://127.0.0.1:{ports['master']}"
    # The master's admin endpoint that deletes a bucket's data is out of reach without the certificate.
    assert _status("GET", f"{master}/col/delete?collection={BUCKET}", context=anonymous) == "refused"
    assert _status("GET", f"http://127.0.0.1:{ports['master']}/col/delete?collection={BUCKET}") in (400, "refused")
    # A file id from the master cannot be written on the volume server without a JWT.
    with urllib.request.urlopen(f"{master}/dir/assign", timeout=10, context=holder) as resp:
        assigned = json.loads(resp.read())
    assert _status("PUT", f"https://{assigned['url']}/{assigned['fid']}", b"x", holder) == 401
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
    for name in ("security.toml", "s3-identities.json", "tls/ca.pem", "tls/node.pem", "tls/node.key"):
        mode = stat.S_IMODE((data_dir / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    identities = json.loads((data_dir / "s3-identities.json").read_text())["identities"]
    assert [c["accessKey"] for i in identities for c in i["credentials"]] == [access]
