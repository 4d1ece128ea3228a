"""The embedded SeaweedFS's security material, written afresh at every start (all files 0600).

Owns:

- ``s3-identities.json`` (``weed -s3.config``): the one S3 identity, Kiln's key pair;
- ``tls/``: a throw-away CA and one certificate for the SeaweedFS components (SAN 127.0.0.1 and
  localhost), used for mutual TLS on every internal gRPC port and on the master, volume and filer
  HTTP ports (HTTPS that requires a client certificate signed by that CA);
- ``security.toml`` (read by ``weed`` from its working directory): those TLS settings plus JWT
  signing keys for volume and filer reads and writes.

So a local process that does not hold the S3 keys can neither reach objects through the internal
ports nor call the master's admin endpoints (collection delete, volume grow): only the S3 port
answers plain HTTP, and only to signed requests.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path

from kiln.core.home import make_private_dir, write_private

_GRPC_ROLES = ("master", "volume", "filer", "s3", "client", "admin", "msg_broker")
_HTTPS_ROLES = ("master", "volume", "filer")
_JWT_SECTIONS = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")


@dataclass(frozen=True)
class SeaweedSecurity:
    """Paths of the written material; :meth:`client_context` talks HTTPS to the components."""

    identities: Path
    security_toml: Path
    ca: Path
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.cert), str(self.key))
        return context


def _certificates(tls_dir: Path) -> tuple[Path, Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple | None) -> x509.Certificate:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer_name, issuer_key = issuer or (subject, key)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        )
        if issuer is not None:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            ).add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    make_private_dir(tls_dir)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("kiln-embedded-seaweedfs-ca", ca_key, None)
    node_key = ec.generate_private_key(ec.SECP256R1())
    node = build("kiln-embedded-seaweedfs", node_key, (ca.subject, ca_key))
    pem = serialization.Encoding.PEM
    paths = (tls_dir / "ca.pem", tls_dir / "node.pem", tls_dir / "node.key")
    write_private(paths[0], ca.public_bytes(pem))
    write_private(paths[1], node.public_bytes(pem))
    write_private(
        paths[2],
        node_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return paths


def write_security(data_dir: Path, *, access_key: str, secret_key: str) -> SeaweedSecurity:
    """Write the identity file, fresh certificates and ``security.toml`` under ``data_dir``."""
    identities = data_dir / "s3-identities.json"
    config = {
        "identities": [
            {
                "name": "kiln",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }
    write_private(identities, json.dumps(config, indent=2) + "\n")
    ca, cert, key = _certificates(data_dir / "tls")
    pair = [f'cert = "{cert}"', f'key = "{key}"']
    lines = [
        "# Written by Kiln at every start of the embedded SeaweedFS; all keys are fresh.",
        "[grpc]",
        f'ca = "{ca}"',
        "",
    ]
    for role in _GRPC_ROLES:
        lines += [f"[grpc.{role}]", *pair, ""]
    for role in _HTTPS_ROLES:
        lines += [f"[https.{role}]", *pair, f'ca = "{ca}"', ""]
    lines += ["[https.client]", "enabled = true", *pair, f'ca = "{ca}"', ""]
    for section in _JWT_SECTIONS:
        lines += [f"[{section}]", f'key = "{secrets.token_hex(32)}"', "expires_after_seconds = 60", ""]
    security_toml = data_dir / "security.toml"
    write_private(security_toml, "\n".join(lines))
    return SeaweedSecurity(identities, security_toml, ca, cert, key)
