"""A loopback TCP proxy in front of a real environment whose new connections can be held.

Chaos tests use it to freeze a run at an exact point (discovery, revalidation) without touching
Kiln: while the gate is closed, every new connection is accepted and parked; ``open()`` lets the
parked ones and all later ones through to the real server. Bytes are forwarded unchanged (HTTP
and WebSocket alike). Stopped by ``close()``; everything runs on daemon threads of this process.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


class GatedProxy:
    """``url`` forwards to ``target_url``; ``hold()``/``open()`` close and open the gate."""

    def __init__(self, target_url: str) -> None:
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
        threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
        self._pump(client, upstream)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
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
