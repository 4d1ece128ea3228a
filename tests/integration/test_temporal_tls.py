"""Temporal over TLS and mTLS with Kiln's connection settings (``KILN_TEMPORAL_TLS_*``).

A real TLS terminator (Python ``ssl``, ALPN h2, client certificates required and checked against
a test CA) forwards to the session's Temporal dev server, so the client must present the
configured certificate and verify the server against the configured CA. Certificates are made
by the test with ``cryptography``.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
from pathlib import Path
from typing import Iterator

import pytest
from pydantic import SecretStr

cryptography = pytest.importorskip("cryptography")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from kiln.core.errors import TemporalConfigInvalid, TemporalUnavailable  # noqa: E402
from kiln.core.settings import Settings  # noqa: E402
from workers.client import connect_client, connect_with_retry, temporal_tls  # noqa: E402


def _cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple | None, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer if issuer else (subject, key)
    builder = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("kiln-test-ca", ca_key, None, ca=True)
    _write(root / "ca", ca)
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        _write(root / name, _cert(name, key, (ca.subject, ca_key), ca=False), key)
    other_key = ec.generate_private_key(ec.SECP256R1())  # a client cert from a CA the server does not trust
    _write(root / "stranger", _cert("stranger", other_key, None, ca=True), other_key)
    return root


class TlsTerminator:
    """Listens with TLS (client certificate required), forwards plaintext to ``target``."""

    def __init__(self, pki: Path, target: str) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.pem"))
        self.context.load_cert_chain(str(pki / "server.pem"), str(pki / "server.key"))
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.context.set_alpn_protocols(["h2"])
        self.target_host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.handshakes_ok = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.context))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes_ok += 1
        up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def terminator(pki: Path, temporal_server: str) -> Iterator[TlsTerminator]:
    proxy = TlsTerminator(pki, temporal_server)
    try:
        yield proxy
    finally:
        proxy.close()


async def _namespace(settings: Settings) -> str:
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest

    client = await connect_client(settings)
    described = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"))
    return described.namespace_info.name


@pytest.mark.timeout(60)
def test_mtls_connection_with_kiln_settings(pki: Path, terminator: TlsTerminator) -> None:
    settings = Settings(
        temporal_address=f"127.0.0.1:{terminator.port}", temporal_tls_ca=pki / "ca.pem",
        temporal_tls_cert=pki / "client.pem", temporal_tls_key=pki / "client.key",
        temporal_api_key=SecretStr("kiln-test-api-key"),
    )
    before = terminator.handshakes_ok
    assert asyncio.run(_namespace(settings)) == "default"
    assert terminator.handshakes_ok > before  # it really went through the TLS terminator


@pytest.mark.timeout(60)
def test_mtls_refuses_missing_or_untrusted_client_certificates(pki: Path, terminator: TlsTerminator) -> None:
    address = f"127.0.0.1:{terminator.port}"
    for extra in ({}, {"temporal_tls_cert": pki / "stranger.pem", "temporal_tls_key": pki / "stranger.key"}):
        settings = Settings(temporal_address=address, temporal_tls_ca=pki / "ca.pem", **extra)
        with pytest.raises(TemporalUnavailable) as refused:
            asyncio.run(connect_with_retry(settings, timeout_s=1.0))
        assert address in refused.value.message
    # Without the CA the client does not trust the server's certificate.
    untrusting = Settings(temporal_address=address, temporal_tls_cert=pki / "client.pem",
                          temporal_tls_key=pki / "client.key")
    with pytest.raises(TemporalUnavailable):
        asyncio.run(connect_with_retry(untrusting, timeout_s=1.0))


def test_tls_settings_errors_name_the_variable_and_never_the_secret(pki: Path, tmp_path: Path) -> None:
    half = Settings(temporal_address="x:1", temporal_tls_cert=pki / "client.pem")
    with pytest.raises(TemporalConfigInvalid, match="KILN_TEMPORAL_TLS_CERT and KILN_TEMPORAL_TLS_KEY"):
        temporal_tls(half)
    missing = Settings(temporal_address="x:1", temporal_tls_ca=tmp_path / "nope.pem")
    with pytest.raises(TemporalConfigInvalid) as err:
        temporal_tls(missing)
    assert err.value.code == "temporal_config_invalid" and f"KILN_TEMPORAL_TLS_CA={tmp_path / 'nope.pem'}" in err.value.message
    key_text = (pki / "client.key").read_text()
    assert temporal_tls(Settings(temporal_address="x:1", temporal_api_key=SecretStr("k"))) is True
    assert temporal_tls(Settings(temporal_address="x:1")) is False
    secret = Settings(temporal_address="x:1", temporal_api_key=SecretStr("top-secret-key"),
                      temporal_tls_cert=pki / "client.pem", temporal_tls_key=pki / "client.key")
    assert "top-secret-key" not in repr(secret) and "top-secret-key" not in str(secret.model_dump())
    assert key_text not in repr(secret)


def test_empty_temporal_tls_variables_mean_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KILN_TEMPORAL_API_KEY", "KILN_TEMPORAL_TLS_CERT", "KILN_TEMPORAL_TLS_KEY", "KILN_TEMPORAL_TLS_CA"):
        monkeypatch.setenv(var, "")
    settings = Settings()
    assert (settings.temporal_api_key, settings.temporal_tls_cert, settings.temporal_tls_ca) == (None, None, None)
    assert temporal_tls(settings) is False
