"""Environment sessions from the test side: hold or probe WebSocket sessions on an environment,
wait until none is left open, and a stalled HTTP server (:class:`SlowHealthServer`)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading
import time
from typing import Any

from tests.support.chaos.stack import LOOPBACK


def ws_url(base_url: str) -> str:
    return base_url.replace("http://", "ws://", 1).rstrip("/") + "/ws"


def _ws_connect(base_url: str) -> Any:
    from websockets.sync.client import connect as ws_connect

    return ws_connect(ws_url(base_url), open_timeout=10, close_timeout=2, proxy=None)


def _reset_reply(sock: Any, seed: int) -> dict[str, Any]:
    sock.send(json.dumps({"type": "reset", "data": {"seed": seed}}))
    return json.loads(sock.recv(timeout=10))


def probe_sessions(base_url: str, sessions: int) -> tuple[int, bool]:
    """Open ``sessions`` + 1 WebSocket sessions at once and reset each.

    Returns (how many of the first ``sessions`` got an observation, whether the extra one was
    refused with CAPACITY_REACHED). ``(sessions, True)`` means no other session is open there.
    """
    accepted = 0
    refused = False
    with contextlib.ExitStack() as opened:
        for index in range(sessions + 1):
            sock = opened.enter_context(_ws_connect(base_url))
            if index < sessions:
                with contextlib.suppress(Exception):
                    accepted += _reset_reply(sock, index).get("type") == "observation"
            else:
                # A refused session is told so at once (CAPACITY_REACHED), then closed.
                with contextlib.suppress(Exception):
                    reply = json.loads(sock.recv(timeout=2))
                    refused = (reply.get("data") or {}).get("code") == "CAPACITY_REACHED"
    return accepted, refused


async def wait_env_idle(base_url: str, sessions: int, *, timeout_s: float = 15.0) -> float:
    """Wait until exactly ``sessions`` sessions can be opened (none leaked); returns seconds waited."""
    started = time.monotonic()
    last: tuple[int, bool] = (0, False)
    while time.monotonic() - started < timeout_s:
        last = await asyncio.to_thread(probe_sessions, base_url, sessions)
        if last == (sessions, True):
            return time.monotonic() - started
        await asyncio.sleep(0.25)
    raise AssertionError(
        f"{base_url} still has sessions open after {timeout_s}s: "
        f"{last[0]}/{sessions} accepted, extra refused={last[1]}"
    )


class SessionHolder:
    """Holds one WebSocket session (reset done) on an environment until :meth:`release`."""

    def __init__(self, base_url: str) -> None:
        self.sock = _ws_connect(base_url).__enter__()
        reply = _reset_reply(self.sock, 12345)
        assert reply.get("type") == "observation", reply

    def release(self) -> None:
        with contextlib.suppress(Exception):
            self.sock.__exit__(None, None, None)


class SlowHealthServer:
    """A loopback HTTP server whose every GET sleeps ``delay_s`` (a stalled environment)."""

    def __init__(self, delay_s: float = 60.0) -> None:
        self.requests = 0
        self._stop = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer.requests += 1
                outer._stop.wait(delay_s)
                with contextlib.suppress(OSError):
                    self.send_response(503)
                    self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{LOOPBACK}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)
