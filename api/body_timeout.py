"""ASGI middleware: a request body must arrive within a bounded time (no slow-loris bodies).

The body of one request has ``timeout_s`` in all (``path_timeouts`` may give a path, such as the
dataset upload, longer) and at most ``idle_s`` between two chunks. Past either bound the API
answers 408 ``request_body_timeout`` with ``Connection: close`` and stops reading, so the server
closes the connection. Only the body is timed: once it is complete (or the client disconnected),
``receive`` is passed through untouched (a streaming response waits on it for a disconnect).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from api.access import ASGIApp, BodyBound, Receive, Scope, Send
from api.access import _send_error as send_error
from kiln.core.errors import RequestBodyTimeout
from kiln.core.telemetry.prometheus import count_error

Message = dict[str, Any]
BODY_TIMEOUT_S = 30.0
BODY_IDLE_S = 10.0


class _TimedOut(Exception):
    pass


class BodyTimeout(BodyBound):
    def __init__(
        self,
        app: ASGIApp,
        timeout_s: float = BODY_TIMEOUT_S,
        idle_s: float = BODY_IDLE_S,
        path_timeouts: dict[str, float] | None = None,
    ) -> None:
        super().__init__(app, timeout_s, path_timeouts)
        self.idle_s = idle_s

    async def bounded(self, scope: Scope, receive: Receive, send: Send, bound: float) -> None:
        total = bound
        deadline = time.monotonic() + total
        body_done = False
        started = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            wait = min(self.idle_s, deadline - time.monotonic())
            try:
                if wait <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), wait)
            except TimeoutError:
                raise _TimedOut from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except _TimedOut:
            if started:  # nothing sensible can be sent any more; the server drops the connection
                raise
            await _send_timeout(send, total, self.idle_s)


async def _send_timeout(send: Send, total: float, idle_s: float) -> None:
    error = RequestBodyTimeout(
        f"the request body did not arrive in time (at most {total:g}s in all, {idle_s:g}s between chunks)",
        hint="send the whole body at once, promptly; retry on a faster connection",
    )
    count_error(error.code)
    await send_error(send, error.http_status, error.to_dict(), [(b"connection", b"close")])
