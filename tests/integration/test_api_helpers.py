"""Shared helpers of the API/CLI tests (no tests here): serve the real app, hold a black-hole
environment, wait for a run state. The app is always built by ``api.app.create_app``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from api.app import create_app
from tests.support.servers import free_port

# Tests that want a run to fail (or hang) at discovery skip the submit-time /health check.
NO_PREFLIGHT = {"preflight": "false"}

TINY_ROLLOUT = {
    "kind": "rollout",
    "groups": 1,
    "group_size": 2,
    "max_steps": 2,
    "max_action_tokens": 32,
}


@contextlib.contextmanager
def serve_api(settings: Any) -> Iterator[str]:
    """Serve ``create_app(settings)`` with uvicorn on a free loopback port (own thread and loop)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the Kiln API did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class BlackHole:
    """A loopback TCP listener that accepts connections and never answers (a hung environment)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self._held:
            conn.close()


def unreachable_url() -> str:
    """A loopback URL nothing listens on (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


async def wait_for(
    http: httpx.AsyncClient, run_id: str, predicate: Any, timeout_s: float = 90.0
) -> dict[str, Any]:
    """Poll ``GET /v1/openenv/runs/{id}`` until ``predicate(status)``; returns that status."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await http.get(f"/v1/openenv/runs/{run_id}")
        assert response.status_code == 200, response.text
        status = response.json()
        if predicate(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} never reached the expected state: {status}")
        await asyncio.sleep(0.3)


def asgi_client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln.test", timeout=60)
