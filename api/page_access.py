"""Browser access to the run pages when the API needs a bearer token.

Open ``/runs?token=<KILN_API_TOKEN>`` once: the API answers with a redirect to the same page
without the token in the address and sets an HttpOnly, SameSite=Strict cookie ``kiln_token``.
Afterwards, for GET/HEAD requests only, the cookie stands in for a missing ``Authorization``
header (``api.access.BearerAccess`` still checks it). State-changing requests (POST, DELETE)
never accept the cookie, so a page on another site cannot act with it.
"""

from __future__ import annotations

from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, quote, unquote, urlencode

from api.access import ASGIApp, Receive, Scope, Send

COOKIE = "kiln_token"
READ_METHODS = frozenset({"GET", "HEAD"})


def _cookie_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"cookie":
            jar: SimpleCookie = SimpleCookie()
            try:
                jar.load(value.decode("latin-1"))
            except Exception:  # noqa: BLE001 - a malformed cookie is no cookie
                return None
            if COOKIE in jar:
                return jar[COOKIE].value
    return None


class TokenCookie:
    """ASGI middleware (outside ``BearerAccess``): ``?token=`` → cookie; cookie → bearer header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in READ_METHODS:
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        token = next((v for k, v in query if k == "token"), None)
        if token is not None and (path == "/runs" or path.startswith("/runs/")):
            rest = urlencode([(k, v) for k, v in query if k != "token"])
            location = quote(path) + (f"?{rest}" if rest else "")
            cookie = f"{COOKIE}={quote(token, safe='')}; HttpOnly; SameSite=Strict; Path=/"
            await send(
                {
                    "type": "http.response.start",
                    "status": 303,
                    "headers": [
                        (b"location", location.encode("latin-1")),
                        (b"set-cookie", cookie.encode("latin-1")),
                        (b"cache-control", b"no-store"),
                        (b"content-length", b"0"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or [])
        if not any(name == b"authorization" for name, _ in headers):
            cookie_token = _cookie_token(headers)
            if cookie_token:
                headers.append((b"authorization", f"Bearer {unquote(cookie_token)}".encode("latin-1")))
                scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)
