"""A Temporal outage answers 503 ``temporal_unavailable`` (retryable) on every route that needs
Temporal — never a 500 — and the CLI's client waits it out for a repeatable request.

A real Temporal dev server is started, used, stopped (the outage), and started again on the same
port with the same db file (the recovery).
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from kiln.client.http import ApiClient
from kiln.core.errors import KilnError
from kiln.core.settings import Settings
from kiln.devstack import start_temporal
from tests.integration.test_api_helpers import serve_api
from tests.support.stack import start_test_temporal

pytestmark = pytest.mark.timeout(180)

RUN = "/v1/openenv/runs"


def _routes(run_id: str) -> list[tuple[str, str, dict]]:
    rollout = {"kind": "rollout", "environment_urls": ["http://127.0.0.1:9"], "groups": 1, "group_size": 2}
    return [
        ("GET", RUN, {}),
        ("GET", f"{RUN}?state=running", {}),
        ("GET", f"{RUN}/{run_id}", {}),
        ("POST", f"{RUN}/{run_id}/cancel", {}),
        ("DELETE", f"{RUN}/{run_id}", {}),
        ("GET", f"{RUN}/{run_id}/artifacts", {}),
        ("GET", f"{RUN}/{run_id}/artifacts/adapter/adapter_model.safetensors", {}),
        ("GET", f"{RUN}/{run_id}/metrics", {}),
        ("GET", f"{RUN}/{run_id}/episodes", {}),
        ("POST", f"{RUN}?preflight=false", {"json": rollout}),
    ]


def test_every_route_answers_503_during_an_outage_and_the_cli_waits_it_out(tmp_path: Path) -> None:
    proc, address = start_test_temporal(tmp_path)
    port = int(address.rsplit(":", 1)[1])
    settings = Settings(home=tmp_path / "home", temporal_address=address, s3_endpoint="http://127.0.0.1:9")
    restarted: list = []
    try:
        with serve_api(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
            run_id = str(uuid.uuid4())
            assert http.get(RUN).status_code == 200  # connected while Temporal is up
            assert http.get(f"{RUN}/{run_id}").json()["code"] == "openenv_run_not_found"
            proc.stop()
            for method, path, kwargs in _routes(run_id):
                started = time.monotonic()
                response = http.request(method, path, **kwargs)
                waited = time.monotonic() - started
                body = response.json()
                assert (response.status_code, body["code"], body["retryable"]) == (
                    503, "temporal_unavailable", True), (method, path, response.text)
                assert response.headers["Retry-After"] == "5"
                assert "RPCError" not in response.text and "tcp connect" not in response.text
                assert waited < 15, (method, path, waited)  # a bounded wait, not the SDK's long retry

            # The CLI's client: a GET issued during the outage is retried until Temporal is back.
            def restart() -> None:
                time.sleep(3.0)
                restarted.append(
                    start_temporal(tmp_path / "temporal", port=port, ui_port=0, log_dir=tmp_path / "logs",
                                   headless=True)
                )

            thread = threading.Thread(target=restart)
            thread.start()
            cli = ApiClient(url, outage_wait_s=90)
            started = time.monotonic()
            with pytest.raises(KilnError) as answered:
                cli.status(run_id)
            thread.join()
            assert answered.value.code == "openenv_run_not_found"  # Temporal answered again
            assert time.monotonic() - started >= 3.0
            # Without a wait budget the outage surfaces at once, with its documented code.
            restarted[0].stop()
            with pytest.raises(KilnError) as refused:
                ApiClient(url, outage_wait_s=0).status(run_id)
            assert (refused.value.code, refused.value.retryable) == ("temporal_unavailable", True)
    finally:
        proc.stop()
        for again in restarted:
            again.stop()
