"""The token rule follows the address the server really binds (issue 14 §6).

Real uvicorn processes started exactly as documented (``uvicorn --factory api.app:app_from_env``),
with KILN_API_HOST unset: the bind comes from uvicorn's own ``--host``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from kiln.core.settings import Settings
from tests.support.servers import free_port, stop_process

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _uvicorn(host: str, port: int, tmp_path: Path, token: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update({"PYTHONPATH": str(ROOT), "KILN_HOME": str(tmp_path)})
    if token is not None:
        env["KILN_API_TOKEN"] = token
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "api.app:app_from_env",
         "--host", host, "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"uvicorn exited: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("uvicorn did not become healthy")


def test_all_interfaces_without_token_is_refused(tmp_path: Path) -> None:
    proc = _uvicorn("0.0.0.0", free_port(), tmp_path, token=None)
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        stop_process(proc)
    assert proc.returncode != 0
    assert "api_configuration_invalid" in output
    assert "0.0.0.0" in output


def test_all_interfaces_with_token_requires_it(tmp_path: Path) -> None:
    port = free_port()
    proc = _uvicorn("0.0.0.0", port, tmp_path, token="s3cret-token-value")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        anonymous = httpx.get(f"{url}/openapi.json", timeout=10)
        assert (anonymous.status_code, anonymous.json()["code"]) == (401, "unauthorized")
        allowed = httpx.get(
            f"{url}/openapi.json", headers={"Authorization": "Bearer s3cret-token-value"}, timeout=10
        )
        assert allowed.status_code == 200
    finally:
        stop_process(proc)


def test_loopback_bind_without_token_serves_loopback(tmp_path: Path) -> None:
    port = free_port()
    proc = _uvicorn("127.0.0.1", port, tmp_path, token=None)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        assert httpx.get(f"{url}/openapi.json", timeout=10).status_code == 200
    finally:
        stop_process(proc)


@pytest.mark.asyncio
async def test_token_less_app_refuses_non_loopback_clients(tmp_path: Path) -> None:
    app = create_app(Settings(home=tmp_path))
    transport = httpx.ASGITransport(app=app, client=("192.0.2.7", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln.test") as http:
        response = await http.get("/openapi.json")
    assert (response.status_code, response.json()["code"]) == (401, "unauthorized")
    local = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
    async with httpx.AsyncClient(transport=local, base_url="http://kiln.test") as http:
        assert (await http.get("/openapi.json")).status_code == 200
