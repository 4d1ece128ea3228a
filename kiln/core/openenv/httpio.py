"""Bounded, redirect-free HTTP for environment servers.

Owns: building the httpx client (no redirects, no proxies from the environment, connect/request
timeouts), status-only health checks, and capped JSON reads (2 MiB by Content-Length and while
streaming). Every failure names the method, the full route URL and the reason, never a body or
a credential.
"""

from __future__ import annotations

import ssl
from functools import lru_cache
from typing import Any

import httpx

from kiln.core import boundedjson
from kiln.core.errors import EnvironmentProtocolError, EnvironmentUnavailable
from kiln.core.openenv.credentials import bearer_headers, contains_token

MAX_BODY_BYTES = 2 * 1024 * 1024
RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


@lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    # Building an SSL context costs milliseconds; one shared context keeps health checks cheap.
    return ssl.create_default_context()


def make_client(*, bearer_token: str | None, connect_timeout_s: float, timeout_s: float) -> httpx.AsyncClient:
    """An httpx client that never follows redirects nor reads proxy settings from the environment."""
    return httpx.AsyncClient(
        follow_redirects=False,
        trust_env=False,
        verify=_ssl_context(),
        timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
        headers={"User-Agent": "kiln-openenv/1", **bearer_headers(bearer_token)},
    )


def describe_transport_error(exc: BaseException, timeout_s: float, connect_timeout_s: float) -> str:
    """A short, secret-free reason for an httpx transport failure."""
    if isinstance(exc, httpx.ConnectTimeout):
        return f"connect timed out after {connect_timeout_s:g}s"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out after {timeout_s:g}s"
    if isinstance(exc, httpx.ConnectError):
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ConnectionRefusedError):
                return "connection refused"
            cause = cause.__cause__ or cause.__context__
        text = str(exc).lower()
        if "refused" in text:
            return "connection refused"
        if "name or service" in text or "nodename" in text or "resolve" in text:
            return "host name could not be resolved"
        return "connection failed"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "connection closed or malformed HTTP response"
    if isinstance(exc, httpx.HTTPError):
        return f"transport error ({type(exc).__name__})"
    return f"transport error ({type(exc).__name__})"


def status_error(method: str, url: str, status: int, location: str | None = None) -> EnvironmentUnavailable:
    """``EnvironmentUnavailable`` for an unusable HTTP status (retryable only for R10's set)."""
    if 300 <= status < 400:
        reason = f"HTTP {status} redirect refused (redirects are never followed)"
    else:
        reason = f"HTTP {status}"
    return EnvironmentUnavailable(
        f"{method} {url}: {reason}",
        retryable=status in RETRYABLE_STATUSES,
        details={"http_status": status, "url": url},
    )


async def check_health(
    client: httpx.AsyncClient, health_url: str, *, timeout_s: float, connect_timeout_s: float
) -> None:
    """Status-only health check: exactly 200 or ``EnvironmentUnavailable``; the body is ignored."""
    try:
        async with client.stream("GET", health_url) as response:
            status = response.status_code
    except httpx.HTTPError as exc:
        raise EnvironmentUnavailable(
            f"GET {health_url}: {describe_transport_error(exc, timeout_s, connect_timeout_s)}",
            details={"url": health_url},
        ) from None
    if status != 200:
        raise status_error("GET", health_url, status)


def parse_json_body(body: bytes, method: str, url: str) -> Any:
    """Strict, bounded JSON (UTF-8, finite numbers, nesting <= ``boundedjson.MAX_DEPTH``) or
    ``EnvironmentProtocolError`` without echoing the body."""
    try:
        return boundedjson.loads(body)
    except boundedjson.JsonBoundsError as exc:
        raise EnvironmentProtocolError(
            f"{method} {url}: response breaks Kiln's JSON bounds ({exc.reason})",
            details={"url": url},
        ) from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise EnvironmentProtocolError(
            f"{method} {url}: response body is not valid JSON", details={"url": url}
        ) from None


async def request_json(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    json_body: Any = None,
    bearer_token: str | None,
    timeout_s: float,
    connect_timeout_s: float,
    cap_bytes: int = MAX_BODY_BYTES,
    ok_statuses: tuple[int, ...] = (),
) -> tuple[int, Any]:
    """Send one request, read at most ``cap_bytes`` and parse JSON.

    Returns ``(status, value)`` for 2xx or for a status listed in ``ok_statuses`` (whose value is
    ``None``); any other status raises ``EnvironmentUnavailable``. Bodies are checked for the raw
    bearer token before parsing (reflection).
    """
    try:
        async with client.stream(method, url, json=json_body) as response:
            status = response.status_code
            if not (200 <= status < 300):
                if status in ok_statuses:
                    return status, None
                raise status_error(method, url, status)
            declared = response.headers.get("content-length")
            if declared is not None:
                try:
                    declared_n = int(declared)
                except ValueError:
                    raise EnvironmentProtocolError(f"{method} {url}: invalid Content-Length header") from None
                if declared_n > cap_bytes:
                    raise EnvironmentProtocolError(
                        f"{method} {url}: response body of {declared_n} bytes exceeds the {cap_bytes}-byte limit",
                        details={"url": url, "limit_bytes": cap_bytes},
                    )
            chunks: list[bytes] = []
            total = 0
            async for chunk in response.aiter_bytes():
                total += len(chunk)
                if total > cap_bytes:
                    raise EnvironmentProtocolError(
                        f"{method} {url}: response body exceeds the {cap_bytes}-byte limit",
                        details={"url": url, "limit_bytes": cap_bytes},
                    )
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise EnvironmentUnavailable(
            f"{method} {url}: {describe_transport_error(exc, timeout_s, connect_timeout_s)}",
            details={"url": url},
        ) from None
    body = b"".join(chunks)
    if contains_token(body, bearer_token):
        raise EnvironmentProtocolError(
            f"{method} {url}: the response reflected the bearer credential",
            details={"url": url, "reason": "credential_reflected"},
        )
    return status, parse_json_body(body, method, url)
