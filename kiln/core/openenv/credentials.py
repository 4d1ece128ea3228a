"""Bearer credentials for environment servers.

Owns: token validation, the ``Authorization`` header, the "bearer over plain http only on
loopback" rule, credential env-var names, reflection detection and redaction. Token values never
appear in an exception message, a log line or a ``repr``.
"""

from __future__ import annotations

import os
import re

from kiln.core.errors import InvalidCredential
from kiln.core.openenv.urls import EnvironmentUrl, is_loopback_host

REDACTED = "[redacted]"
MAX_ENV_NAME_CHARS = 128
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def validate_bearer_token(token: str) -> str:
    """Non-empty, no whitespace anywhere, no control characters. Returns the token."""
    if not isinstance(token, str) or token == "":
        raise InvalidCredential("bearer token is empty")
    for ch in token:
        if ch.isspace():
            raise InvalidCredential("bearer token contains whitespace")
        code = ord(ch)
        if code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0:
            raise InvalidCredential("bearer token contains control characters")
    try:
        token.encode("latin-1")
    except UnicodeEncodeError:
        raise InvalidCredential("bearer token is not representable in an HTTP header") from None
    return token


def require_token_transport(url: EnvironmentUrl, token: str | None) -> None:
    """A bearer token over plain ``http`` is refused unless the host is loopback."""
    if token is None:
        return
    if url.scheme != "https" and not is_loopback_host(url.host):
        raise InvalidCredential(
            f"refusing to send a bearer credential to {url.origin} over plain http",
            hint="use https:// for remote environments that need a credential",
        )


def prepare_token(url: EnvironmentUrl, token: str | None) -> str | None:
    """Validate ``token`` and its transport for ``url``; ``None`` means no authentication."""
    if token is None:
        return None
    validate_bearer_token(token)
    require_token_transport(url, token)
    return token


def bearer_headers(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}`` or ``{}``."""
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def authentication_label(token: str | None) -> str:
    """What the identity records: ``none`` or ``bearer`` (never the value)."""
    return "none" if token is None else "bearer"


def contains_token(data: str | bytes, token: str | None) -> bool:
    """True when ``data`` contains the raw token bytes (reflection)."""
    if not token:
        return False
    needle = token.encode("utf-8")
    raw = data.encode("utf-8", errors="surrogatepass") if isinstance(data, str) else data
    return needle in raw


def redact(text: str, token: str | None) -> str:
    """Replace every occurrence of ``token`` in ``text`` by a redaction marker."""
    if not token or not text:
        return text
    return text.replace(token, REDACTED)


def validate_env_name(name: str) -> str:
    """``[A-Za-z_][A-Za-z0-9_]*``, at most 128 characters. Never echoed in messages."""
    if not isinstance(name, str) or not name:
        raise InvalidCredential("credential environment-variable name is empty")
    if len(name) > MAX_ENV_NAME_CHARS or not _ENV_NAME_RE.match(name):
        raise InvalidCredential(
            "credential environment-variable name is invalid",
            hint="use [A-Za-z_][A-Za-z0-9_]* with at most 128 characters",
        )
    return name


def read_token_from_env(name: str, environ: dict[str, str] | None = None) -> str:
    """Read and validate the token held by environment variable ``name`` (just before use)."""
    validate_env_name(name)
    source = os.environ if environ is None else environ
    value = source.get(name)
    if not value:
        raise InvalidCredential("a configured credential variable is unset or empty")
    return validate_bearer_token(value)


def parse_credential_env_args(
    names: list[str], url_count: int, *, flag: str = "--credential-env", validate: bool = True
) -> list[str | None]:
    """CLI slots: one value per URL (``-`` = public) or none at all."""
    if not names:
        return [None] * url_count
    if len(names) != url_count:
        raise InvalidCredential(
            f"got {len(names)} {flag} values for {url_count} environment URLs",
            hint="pass one per URL in order, '-' for a public environment",
        )
    return [None if n == "-" else (validate_env_name(n) if validate else n) for n in names]


def origin_matches(credential_origin: str, url: EnvironmentUrl) -> bool:
    """The credential's canonical origin must equal the URL's origin exactly."""
    return credential_origin == url.origin
