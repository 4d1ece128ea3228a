"""A loopback TCP proxy in front of a real environment whose new connections can be held.

Chaos tests use it to freeze a run at an exact point (discovery, revalidation) without touching
Kiln: while the gate is closed, every new connection is accepted and parked; ``open()`` lets the
parked ones and all later ones through to the real server. Bytes are forwarded unchanged (HTTP
and WebSocket alike). With ``ws_delay_s`` every chunk the server sends on a WebSocket connection
reaches the client that much later (a slow environment: the upgrade, reset and step answers
arrive late; plain HTTP such as /health is not delayed, even on a socket that later upgrades). Stopped by ``close()``; everything runs on daemon
threads of this process.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


class GatedProxy:
    """``url`` forwards to ``target_url``; ``hold()``/``open()`` close and open the gate."""

    def __init__(self, target_url: str, ws_delay_s: float = 0.0) -> None:
        self.ws_delay_s = ws_delay_s
        parts = urlsplit(target_url)
        self.target = (parts.hostname or LOOPBACK, parts.port or 80)
        self.path = parts.path.rstrip("/")
        self._gate = threading.Event()
        self._gate.set()
        self._closed = threading.Event()
        self.parked = 0  # connections that arrived while the gate was closed
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((LOOPBACK, 0))
        self.listener.listen(128)
        self.url = f"http://{LOOPBACK}:{self.listener.getsockname()[1]}{self.path}"
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._gate.clear()

    def open(self) -> None:
        self._gate.set()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self._track(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if not self._gate.is_set():
            with self._lock:
                self.parked += 1
            while not self._gate.wait(0.1):
                if self._closed.is_set():
                    return
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            with contextlib.suppress(OSError):
                client.close()
            return
        upstream.settimeout(None)
        self._track(upstream)
        # A connection may start as plain HTTP (Kiln's /health probe) and then upgrade on the same
        # socket: the delay starts with the first request that asks for a WebSocket upgrade.
        delay = [0.0]
        threading.Thread(target=self._pump, args=(upstream, client, delay), daemon=True).start()
        self._pump(client, upstream, None, delay)

    def _pump(self, source: socket.socket, sink: socket.socket, delay: list[float] | None,
              upgrade: list[float] | None = None) -> None:
        """Forward ``source`` → ``sink``. Server side: sleep ``delay[0]`` before each chunk. Client
        side: set ``upgrade[0]`` to ``ws_delay_s`` once a chunk asks for a WebSocket upgrade."""
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if upgrade is not None and self.ws_delay_s and b"upgrade: websocket" in data.lower():
                    upgrade[0] = self.ws_delay_s
                if delay is not None and delay[0]:
                    time.sleep(delay[0])
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._gate.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()
