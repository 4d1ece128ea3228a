"""HTTP hygiene of the API: a slow request body is cut off in bounded time (408, connection
closed), 405 answers carry ``Allow``, enumerated query parameters are enums in the OpenAPI
document, and ``/healthz`` stays 200 while naming what is down.

The slow-loris cases use real sockets against the app served by uvicorn.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from api.app import create_app
from kiln.core.settings import Settings
from tests.integration.test_api_helpers import asgi_client, serve_api

BODY_TIMEOUT_S = 3.0


def _open_post(url: str, length: int) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(
        f"POST /v1/openenv/runs HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n".encode()
    )
    sock.setblocking(False)
    return sock


def _read_until_closed(sock: socket.socket, received: bytearray) -> bool:
    """Read what is there; True once the server has closed the connection."""
    while True:
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True
        if not chunk:
            return True
        received += chunk


@pytest.mark.timeout(90)
def test_a_slow_loris_body_is_answered_408_and_closed_in_bounded_time(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, temporal_address="127.0.0.1:9", api_body_timeout_s=BODY_TIMEOUT_S)
    with serve_api(settings) as url:
        # One client trickles a byte a second; twenty more sent half a body and went quiet.
        loris = _open_post(url, 1000)
        quiet = []
        for _ in range(20):
            sock = _open_post(url, 1000)
            sock.send(b'{"kind": "rollout"')
            quiet.append(sock)
        started = time.monotonic()
        received = bytearray()
        closed_after = None
        for _ in range(25):  # bounded: 25 bytes at most, ~1 s apart
            try:
                loris.send(b" ")
            except (BrokenPipeError, ConnectionResetError):
                pass
            if _read_until_closed(loris, received):
                closed_after = time.monotonic() - started
                break
            time.sleep(1.0)
        loris.close()
        assert closed_after is not None, "the trickling connection was never closed"
        assert 1.0 <= closed_after <= BODY_TIMEOUT_S + 6, closed_after  # bounded, not open for 25 s
        head, _, body = bytes(received).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), received
        assert b"connection: close" in head.lower()
        assert b'"code":"request_body_timeout"' in body.replace(b" ", b"")
        # The quiet ones were closed too (by then they had waited longer than the bound).
        deadline = time.monotonic() + 10
        still_open = list(quiet)
        while still_open and time.monotonic() < deadline:
            still_open = [sock for sock in still_open if not _read_until_closed(sock, bytearray())]
            time.sleep(0.2)
        for sock in quiet:
            sock.close()
        assert still_open == []


@pytest.fixture()
def app(tmp_path: Path):  # noqa: ANN201 - a FastAPI app
    return create_app(Settings(home=tmp_path, temporal_address="127.0.0.1:9", s3_endpoint="http://127.0.0.1:9"))


@pytest.mark.asyncio
@pytest.mark.parametrize("method, path, allow", [
    ("PUT", "/v1/openenv/runs/abc", "GET, DELETE"),
    ("PATCH", "/v1/openenv/runs", "GET, POST"),
    ("GET", "/v1/openenv/runs/abc/cancel", "POST"),
    ("POST", "/healthz", "GET"),
    ("DELETE", "/v1/datasets", "PUT"),
])
async def test_405_names_the_allowed_methods(app, method: str, path: str, allow: str) -> None:  # noqa: ANN001
    async with asgi_client(app) as http:
        response = await http.request(method, path)
    assert response.status_code == 405
    assert response.headers["Allow"] == allow
    assert response.json()["code"] == "method_not_allowed"
    assert response.json()["hint"] == f"use {allow}"


@pytest.mark.asyncio
async def test_the_run_state_filter_is_an_enum_in_openapi(app) -> None:  # noqa: ANN001
    async with asgi_client(app) as http:
        document = (await http.get("/openapi.json")).json()
    (state,) = [p for p in document["paths"]["/v1/openenv/runs"]["get"]["parameters"] if p["name"] == "state"]
    branches = state["schema"].get("anyOf", [state["schema"]])
    enums = [branch["enum"] for branch in branches if "enum" in branch]
    assert enums == [["running", "completed", "failed", "cancelled", "terminated"]]


@pytest.mark.asyncio
async def test_healthz_stays_200_and_names_an_unreachable_temporal(app) -> None:  # noqa: ANN001
    async with asgi_client(app) as http:
        started = time.monotonic()
        response = await http.get("/healthz")
        waited = time.monotonic() - started
    assert response.status_code == 200
    assert response.json() == {"status": "degraded", "components": {
        "temporal": {"connection": "unreachable"}, "s3": {"connection": "unreachable"}}}
    assert waited < 10


@pytest.mark.asyncio
async def test_healthz_names_the_embedded_temporals_exposure(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "serve.json").write_text(
        '{"temporal_exposure": "open_to_local_users", "components": {"temporal": {"state": "running", "pid": 7}}}')
    app = create_app(Settings(home=tmp_path, temporal_address="127.0.0.1:9", s3_endpoint="http://127.0.0.1:9"))
    async with asgi_client(app) as http:
        response = await http.get("/healthz")
    assert response.json()["components"]["temporal"] == {
        "state": "running", "connection": "unreachable", "exposure": "open_to_local_users"}
