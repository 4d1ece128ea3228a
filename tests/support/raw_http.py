"""A raw HTTP/1.1 GET over a socket: the request target is sent byte for byte.

httpx (and browsers) normalise ``..`` segments away before sending, so a path-traversal test
through them never reaches the server's handler. This helper does not normalise anything.
"""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlsplit


def raw_get(base_url: str, target: str, timeout_s: float = 30.0) -> tuple[int, Any]:
    """``GET target`` exactly as given; returns (status, parsed JSON body or raw bytes)."""
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = (
        f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
        "Accept: application/json\r\n\r\n"
    ).encode("latin-1")
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)
