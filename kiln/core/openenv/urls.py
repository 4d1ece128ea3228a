"""Environment URL normalisation and the loopback-only host rule.

Owns: turning user text into an ``EnvironmentUrl`` (base URL, WebSocket URL, origin, host) and
deciding whether a host counts as loopback. Nothing here touches the network.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from kiln.core.errors import InvalidUrl, RemoteEnvironmentForbidden

_DEFAULT_PORTS = {"http": 80, "https": 443}
_WS_SCHEMES = {"http": "ws", "https": "wss"}


@dataclass(frozen=True)
class EnvironmentUrl:
    """A normalised OpenEnv server address."""

    base_url: str  # normalised, no trailing slash
    websocket_url: str  # ws(s)://.../ws
    origin: str  # scheme://host[:port], default ports omitted
    host: str  # lower-case host, IPv6 without brackets

    @property
    def scheme(self) -> str:
        return self.base_url.split("://", 1)[0]

    def route(self, path: str) -> str:
        """Absolute URL of ``path`` (``"/health"``) under the base URL."""
        return self.base_url + "/" + path.lstrip("/")

    def __str__(self) -> str:
        return self.base_url


def _invalid(text: str, reason: str, fix: str) -> InvalidUrl:
    shown = text if len(text) <= 200 else text[:200] + "..."
    # Never echo userinfo/query (they may hold secrets): show only what precedes them.
    for marker in ("@", "?", "#"):
        if marker in shown:
            shown = "<redacted>"
            break
    return InvalidUrl(f"environment URL {shown!r} is invalid: {reason}", hint=fix)


def normalize_url(text: str) -> EnvironmentUrl:
    """Normalise an environment URL; raise ``InvalidUrl`` naming the problem and the fix."""
    if not isinstance(text, str):
        raise InvalidUrl("environment URL must be a string", hint="pass e.g. http://127.0.0.1:8000")
    raw = text.strip()
    if not raw.strip("/"):
        raise _invalid(text, "it is empty", "pass e.g. http://127.0.0.1:8000")
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in raw):
        raise _invalid(text, "it contains whitespace or control characters", "remove them")
    if "://" not in raw:
        raw = "http://" + raw
    try:
        parts = urlsplit(raw)
    except ValueError:
        raise _invalid(text, "it does not parse as a URL", "pass e.g. http://127.0.0.1:8000") from None
    scheme = parts.scheme.lower()
    if scheme not in _WS_SCHEMES:
        raise _invalid(text, f"scheme {scheme!r} is not http or https", "use http:// or https://")
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        raise _invalid(text, "it contains credentials (userinfo)", "configure a bearer credential instead")
    if parts.query or "?" in raw:
        raise _invalid(text, "it contains a query string", "remove everything from '?'")
    if parts.fragment or "#" in raw:
        raise _invalid(text, "it contains a fragment", "remove everything from '#'")
    host = (parts.hostname or "").lower()
    if not host:
        raise _invalid(text, "it has no host", "pass e.g. http://127.0.0.1:8000")
    try:
        port = parts.port
    except ValueError:
        raise _invalid(text, "its port is not a number in 0..65535", "fix the port") from None
    if port == 0:
        raise _invalid(text, "port 0 is not a valid server port", "fix the port")
    host_text = f"[{host}]" if ":" in host else host
    netloc = host_text if port is None else f"{host_text}:{port}"
    path = parts.path
    while path.endswith("/"):
        path = path[:-1]
    if path and not path.startswith("/"):
        path = "/" + path
    base_url = f"{scheme}://{netloc}{path}"
    websocket_url = f"{_WS_SCHEMES[scheme]}://{netloc}{path}/ws"
    origin_port = None if port is None or port == _DEFAULT_PORTS[scheme] else port
    origin = f"{scheme}://{host_text}" + ("" if origin_port is None else f":{origin_port}")
    return EnvironmentUrl(base_url=base_url, websocket_url=websocket_url, origin=origin, host=host)


def is_loopback_host(host: str) -> bool:
    """``localhost`` (any case) or an IP literal (bracketed IPv6 allowed) that is loopback."""
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def require_allowed_host(url: EnvironmentUrl, *, allow_remote: bool) -> None:
    """Refuse non-loopback hosts unless remote environments are allowed by configuration."""
    if allow_remote or is_loopback_host(url.host):
        return
    raise RemoteEnvironmentForbidden(
        f"environment {url.base_url} is not on a loopback host; remote environments are disabled",
        hint="set KILN_ALLOW_REMOTE_ENVIRONMENTS=true or use localhost/127.0.0.1/[::1]",
    )


def coerce_url(url: str | EnvironmentUrl) -> EnvironmentUrl:
    """Accept either an already-normalised ``EnvironmentUrl`` or text."""
    return url if isinstance(url, EnvironmentUrl) else normalize_url(url)
