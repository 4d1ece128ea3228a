"""Who may call the API, and how much they may send.

- Bearer access: when the API binds a non-loopback host, every route except ``/healthz`` needs
  ``Authorization: Bearer <KILN_API_TOKEN>`` (compared in constant time). Building the app for a
  non-loopback host without a token is refused. The host is the one the server really binds: under
  uvicorn it is read from uvicorn's own ``Config`` (``bound_host``), never only from
  ``KILN_API_HOST``; an unknown bind counts as remote. The token is never logged or echoed.
- Loopback only: an app served without a token answers only loopback clients (defence in depth).
- Body limit: request bodies over 1 MiB are refused (413) before any route parses them, using
  Content-Length when given and counting streamed bytes otherwise.
"""

from __future__ import annotations

import hmac
import inspect
import json
from typing import Any, Awaitable, Callable

from kiln.core.openenv.urls import is_loopback_host

from kiln.core.errors import RequestTooLarge, Unauthorized
from kiln.core.access_rule import configured_token, required_token

__all__ = ["configured_token", "required_token", "bound_host", "BearerAccess", "BodyBound", "BodyLimit", "LoopbackOnly"]

MAX_BODY_BYTES = 1024 * 1024
OPEN_PATHS = frozenset({"/healthz"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def bound_host() -> str | None:
    """The host the uvicorn server loading this app will bind, read from its ``Config``.

    ``uvicorn --factory`` calls the factory from ``uvicorn.Config.load``; that ``Config`` (host,
    unix socket, inherited fd) is the truth about the bind. ``None`` when the app is not being
    loaded by uvicorn, or binds an inherited file descriptor (unknown address).
    """
    frame = inspect.currentframe()
    while frame is not None:
        config = frame.f_locals.get("self")
        if config is not None and type(config).__name__ == "Config" and type(config).__module__.startswith("uvicorn"):
            if getattr(config, "uds", None):
                return "127.0.0.1"  # a unix socket is local by construction
            if getattr(config, "fd", None) is not None:
                return None
            return str(config.host)
        frame = frame.f_back
    return None


class LoopbackOnly:
    """ASGI middleware of a token-less app: only loopback clients are answered (401 otherwise)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client") or ("", 0)
        if scope["type"] == "http" and not is_loopback_host(str(client[0])):
            await _refuse(
                send,
                "this Kiln API has no access token and only answers loopback clients",
                hint="set KILN_API_TOKEN on the server and send 'Authorization: Bearer <token>'",
            )
            return
        await self.app(scope, receive, send)


def bearer_matches(header: str | None, token: str) -> bool:
    """Constant-time check of an ``Authorization`` header against ``Bearer <token>``."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode("utf-8"), token.encode("utf-8"))


async def _send_error(send: Send, status: int, body: dict[str, Any], extra: list[tuple[bytes, bytes]]) -> None:
    raw = json.dumps(body).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": raw})


async def _refuse(send: Send, message: str, *, hint: str) -> None:
    """A 401 ``unauthorized`` answer with a Bearer challenge."""
    error = Unauthorized(message, hint=hint)
    await _send_error(send, 401, error.to_dict(), [(b"www-authenticate", b"Bearer")])


class SecretToken:
    """A token whose ``repr``/``str`` never show the value (middleware kwargs get printed)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "SecretToken([redacted])"

    __str__ = __repr__


class BearerAccess:
    """ASGI middleware: every HTTP route except ``OPEN_PATHS`` needs the bearer token."""

    def __init__(self, app: ASGIApp, token: SecretToken) -> None:
        self.app = app
        self._token = token

    def __repr__(self) -> str:  # never shows the token
        return "BearerAccess(token=[redacted])"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        if not bearer_matches(header, self._token.reveal()):
            await _refuse(send, "missing or wrong bearer token", hint="send 'Authorization: Bearer <KILN_API_TOKEN>'")
            return
        await self.app(scope, receive, send)


class BodyBound:
    """Base of the ASGI middlewares that bound an HTTP request's body: ``default`` for every path,
    ``per_path`` for some (the dataset upload); other scopes (lifespan) pass through untouched."""

    def __init__(self, app: ASGIApp, default: float, per_path: dict[str, float] | None = None) -> None:
        self.app = app
        self.default = default
        self.per_path = dict(per_path or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.bounded(scope, receive, send, self.per_path.get(scope.get("path", ""), self.default))

    async def bounded(self, scope: Scope, receive: Receive, send: Send, bound: float) -> None:
        """Serve one HTTP request under ``bound`` (this path's)."""
        raise NotImplementedError


class BodyLimit(BodyBound):
    """ASGI middleware: refuse request bodies over ``limit`` bytes with 413.

    The body (at most ``limit`` bytes) is read up front and replayed to the app, so a route never
    sees a partial body and an oversize one is refused before any parsing.
    """

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES, path_limits: dict[str, int] | None = None) -> None:
        super().__init__(app, limit, dict(path_limits or {}))

    async def bounded(self, scope: Scope, receive: Receive, send: Send, bound: float) -> None:
        limit = int(bound)
        too_large = RequestTooLarge(f"request body is larger than {limit} bytes")
        for name, value in scope.get("headers") or []:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = limit + 1
                if declared > limit:
                    await _send_error(send, 413, too_large.to_dict(), [])
                    return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > limit:
                await _send_error(send, 413, too_large.to_dict(), [])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        await forward_with_body(self.app, scope, body, receive, send)


async def forward_with_body(app: Any, scope: Any, body: bytes, receive: Any, send: Any) -> None:
    """Call ``app`` with a request body that was already read (delivered once, then ``receive``)."""
    delivered = False

    async def replay() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    await app(scope, replay, send)
