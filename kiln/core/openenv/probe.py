"""The status-only ``/health`` probe that precedes every WebSocket upgrade.

Owns: one ``GET {base}/health`` on a raw non-blocking socket (no HTTP client construction, which
dominated session-open cost), requiring exactly status 200 and ignoring the body. For plain
``http`` the keep-alive connection is handed back so the upgrade can reuse it (one TCP connection
per session instead of two); ``https`` probes over asyncio streams with TLS and never reuse.
Redirects are never followed (any non-200 fails). The bearer token is sent, never reported.
"""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

from kiln.core.errors import EnvironmentUnavailable
from kiln.core.openenv.credentials import bearer_headers
from kiln.core.openenv.httpio import _ssl_context, status_error
from kiln.core.openenv.urls import EnvironmentUrl

MAX_HEADER_BYTES = 64 * 1024
MAX_REUSED_BODY_BYTES = 64 * 1024


def _request(url: EnvironmentUrl, token: str | None) -> tuple[str, int, bytes]:
    parts = urlsplit(url.base_url)
    host = parts.hostname or url.host
    port = parts.port or (443 if parts.scheme == "https" else 80)
    netloc = parts.netloc
    lines = [
        f"GET {parts.path}/health HTTP/1.1",
        f"Host: {netloc}",
        "User-Agent: kiln-openenv/1",
        "Accept: */*",
        *(f"{k}: {v}" for k, v in bearer_headers(token).items()),
        "",
        "",
    ]
    return host, port, "\r\n".join(lines).encode("latin-1")


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    status_parts = lines[0].split(" ", 2)
    if len(status_parts) < 2 or not status_parts[0].startswith("HTTP/1.") or not status_parts[1].isdigit():
        raise ValueError("bad status line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return int(status_parts[1]), headers


async def _connect(host: str, port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError | None = None
    for family, type_, proto, _, address in infos:
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
        except BaseException:
            sock.close()
            raise
    raise last or OSError("no address")


def _fail(health_url: str, reason: str) -> EnvironmentUnavailable:
    return EnvironmentUnavailable(f"GET {health_url}: {reason}", details={"url": health_url})


async def health_probe(
    url: EnvironmentUrl,
    *,
    bearer_token: str | None,
    connect_timeout_s: float,
    timeout_s: float,
    keep_socket: bool = True,
) -> socket.socket | None:
    """Require ``GET /health`` == 200; return the reusable socket (plain http) or ``None``."""
    health_url = url.route("/health")
    host, port, request = _request(url, bearer_token)
    if url.scheme == "https":
        await _probe_tls(health_url, host, port, request, connect_timeout_s, timeout_s)
        return None
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(connect_timeout_s):
            sock = await _connect(host, port)
    except TimeoutError:
        raise _fail(health_url, f"connect timed out after {connect_timeout_s:g}s") from None
    except ConnectionRefusedError:
        raise _fail(health_url, "connection refused") from None
    except socket.gaierror:
        raise _fail(health_url, "host name could not be resolved") from None
    except OSError as exc:
        raise _fail(health_url, f"connection failed ({type(exc).__name__})") from None
    reusable = False
    try:
        async with asyncio.timeout(timeout_s):
            await loop.sock_sendall(sock, request)
            buffer = b""
            while b"\r\n\r\n" not in buffer:
                chunk = await loop.sock_recv(sock, 65536)
                if not chunk:
                    raise ConnectionResetError("closed before the status line")
                buffer += chunk
                if len(buffer) > MAX_HEADER_BYTES and b"\r\n\r\n" not in buffer:
                    raise ValueError("oversized response head")
            head, _, body = buffer.partition(b"\r\n\r\n")
            status, headers = _parse_head(head)
            if status != 200:
                raise status_error("GET", health_url, status)
            length = headers.get("content-length", "")
            if (
                keep_socket
                and length.isdigit()
                and int(length) <= MAX_REUSED_BODY_BYTES
                and "close" not in headers.get("connection", "").lower()
                and "transfer-encoding" not in headers
            ):
                remaining = int(length) - len(body)
                while remaining > 0:
                    chunk = await loop.sock_recv(sock, remaining)
                    if not chunk:
                        break
                    remaining -= len(chunk)
                reusable = remaining == 0
    except EnvironmentUnavailable:
        sock.close()
        raise
    except TimeoutError:
        sock.close()
        raise _fail(health_url, f"timed out after {timeout_s:g}s") from None
    except (OSError, ValueError) as exc:
        sock.close()
        raise _fail(health_url, f"malformed or closed HTTP response ({type(exc).__name__})") from None
    except BaseException:
        sock.close()
        raise
    if not reusable:
        sock.close()
        return None
    return sock


async def _probe_tls(
    health_url: str, host: str, port: int, request: bytes, connect_timeout_s: float, timeout_s: float
) -> None:
    try:
        async with asyncio.timeout(connect_timeout_s):
            reader, writer = await asyncio.open_connection(host, port, ssl=_ssl_context(), server_hostname=host)
    except TimeoutError:
        raise _fail(health_url, f"connect timed out after {connect_timeout_s:g}s") from None
    except ConnectionRefusedError:
        raise _fail(health_url, "connection refused") from None
    except OSError as exc:
        raise _fail(health_url, f"connection failed ({type(exc).__name__})") from None
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(request)
            await writer.drain()
            line = await reader.readline()
        status, _ = _parse_head(line.rstrip(b"\r\n"))
    except TimeoutError:
        raise _fail(health_url, f"timed out after {timeout_s:g}s") from None
    except (OSError, ValueError) as exc:
        raise _fail(health_url, f"malformed or closed HTTP response ({type(exc).__name__})") from None
    finally:
        writer.close()
    if status != 200:
        raise status_error("GET", health_url, status)
