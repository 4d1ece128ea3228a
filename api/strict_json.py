"""ASGI middleware: every JSON request body is checked against Kiln's JSON bounds before a route.

FastAPI's own parser accepts ``NaN``/``Infinity``/``1e999``, 5000-digit integers (then fails with
an opaque 400) and nesting deep enough to crash serialization. This middleware parses each
``application/json`` body once with :mod:`kiln.core.boundedjson` and answers 400
``openenv_invalid_request`` naming the JSON path of the first violation; syntax errors are left to
FastAPI (which answers the same code). The body is replayed unchanged to the app.
"""

from __future__ import annotations

import json

from api.access import ASGIApp, Receive, Scope, Send, _send_error, forward_with_body
from kiln.core import boundedjson
from kiln.core.errors import InvalidRequest


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers") or []:
        if name == b"content-type":
            media = value.decode("latin-1").split(";")[0].strip().lower()
            return media == "application/json" or media.endswith("+json")
    return False


class StrictJson:
    """Refuse JSON bodies that break :mod:`kiln.core.boundedjson` bounds (400, envelope)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = _problem(body)
        if problem is not None:
            await _send_error(send, 400, problem.to_dict(), [])
            return
        await forward_with_body(self.app, scope, body, receive, send)


def _problem(body: bytes) -> InvalidRequest | None:
    if not body.strip():
        return None
    try:
        boundedjson.loads(body)
    except boundedjson.JsonBoundsError as exc:
        return InvalidRequest(
            f"invalid request: {exc}",
            hint="send finite numbers, integers of at most "
            f"{boundedjson.MAX_INT_DIGITS} digits and at most {boundedjson.MAX_DEPTH} nesting levels",
        )
    except UnicodeDecodeError:
        return InvalidRequest("invalid request: the JSON body is not UTF-8")
    except (json.JSONDecodeError, ValueError):
        return None  # FastAPI reports syntax errors with the same code
    return None
