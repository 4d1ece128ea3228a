"""A 1-session counter server (the real ``openenv`` ``create_app``) that counts its own refusals.

An ASGI wrapper around the example counter app counts every ``CAPACITY_REACHED`` error frame the
server sends on ``/ws`` (the brute-force count the capacity figures are checked against) and answers
``GET /_refusals`` with ``{"refusals": N}``. The server itself is untouched: the wrapper only reads
outgoing frames. Run: ``python -m tests.support.refusal_counting_server --port P``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn

from examples.envs import build_example_app


class RefusalCounter:
    """ASGI app: ``inner`` plus a count of the ``CAPACITY_REACHED`` frames it sent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.refusals = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") == "/_refusals":
            body = json.dumps({"refusals": self.refusals}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] != "websocket":
            await self.inner(scope, receive, send)
            return

        async def counting_send(message: dict) -> None:
            text = message.get("text") if message.get("type") == "websocket.send" else None
            if isinstance(text, str) and "CAPACITY_REACHED" in text:
                self.refusals += 1
            await send(message)

        await self.inner(scope, receive, counting_send)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = RefusalCounter(build_example_app("counter", max_concurrent_envs=1))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
