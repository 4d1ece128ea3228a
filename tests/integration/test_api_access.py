"""API access: a non-loopback bind needs a bearer token (refused without one), /healthz stays open,
and the Task API catalog route against a real openenv TaskProvider server."""

from __future__ import annotations

from typing import Any

import pytest

from api.app import create_app
from kiln.core.errors import KilnError
from kiln.core.settings import Settings
from tests.integration.test_api_helpers import asgi_client, unreachable_url
from tests.support.servers import serve_module

TOKEN = "kiln-test-token-7f3a9c"
# A request that passes access control and fails validation without needing Temporal.
PROBE = ("/v1/openenv/tasks", {"environment_urls": ["http://127.0.0.1:9"], "limit": 0})


def test_remote_bind_without_token_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_API_TOKEN", raising=False)
    for host in ("0.0.0.0", "192.0.2.10", "::"):
        with pytest.raises(KilnError) as refused:
            create_app(Settings(api_host=host))
        assert refused.value.code == "api_configuration_invalid"
        assert "KILN_API_TOKEN" in (refused.value.hint or "")
    monkeypatch.setenv("KILN_API_TOKEN", "   ")
    with pytest.raises(KilnError):
        create_app(Settings(api_host="0.0.0.0"))
    for host in ("127.0.0.1", "localhost", "::1"):
        create_app(Settings(api_host=host))  # loopback needs no token


async def test_remote_bind_requires_the_bearer_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_API_TOKEN", TOKEN)
    app = create_app(Settings(api_host="0.0.0.0"))
    assert TOKEN not in repr(app.user_middleware)
    path, body = PROBE
    async with asgi_client(app) as http:
        assert (await http.get("/healthz")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                        {"Authorization": f"Bearer {TOKEN}x"}):
            for method, route in (("POST", path), ("GET", "/v1/openenv/runs"), ("GET", "/docs"),
                                  ("GET", "/openapi.json")):
                response = await http.request(method, route, json=body if method == "POST" else None,
                                              headers=headers)
                assert response.status_code == 401, (headers, route)
                assert response.json()["code"] == "unauthorized"
                assert response.headers["www-authenticate"] == "Bearer"
                assert TOKEN not in response.text
        ok = await http.post(path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 400 and ok.json()["code"] == "openenv_invalid_task_page"
        docs = await http.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
        assert docs.status_code == 200
        assert "/v1/openenv/runs/{run_id}/artifacts/{name}" in docs.json()["paths"]


@pytest.fixture(scope="module")
def taskbank() -> Any:
    with serve_module("examples.envs.taskbank.server") as base_url:
        yield base_url


async def test_task_catalog_route(taskbank: str, kiln_settings: Any) -> None:
    async with asgi_client(create_app(kiln_settings())) as http:
        response = await http.post(
            "/v1/openenv/tasks",
            json={"environments": [taskbank], "split": "TRAIN", "start": 1, "limit": 50},
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["schema"] == "kiln.openenv-task-catalog.v1"
        assert len(body["catalogs"]) == 1
        entry = body["catalogs"][0]
        assert entry["base_url"] == taskbank
        catalog = entry["catalog"]
        assert (catalog["selected_split"], catalog["num_tasks"], catalog["start"], catalog["stop"]) == ("train", 3, 1, 3)
        assert [row["id"] for row in catalog["tasks"]] == ["t1", "t2"]

        for limit in (0, 201):
            bad = await http.post("/v1/openenv/tasks", json={"environment_urls": [taskbank], "limit": limit})
            assert (bad.status_code, bad.json()["code"]) == (400, "openenv_invalid_task_page")
        split = await http.post("/v1/openenv/tasks", json={"environment_urls": [taskbank], "split": "nope"})
        assert (split.status_code, split.json()["code"]) == (400, "openenv_invalid_task_selection")
        extra = await http.post("/v1/openenv/tasks", json={"environment_urls": [taskbank], "page": 2})
        assert (extra.status_code, extra.json()["code"]) == (400, "openenv_invalid_request")
        down = await http.post("/v1/openenv/tasks", json={"environment_urls": [unreachable_url()]})
        assert down.status_code == 502
        assert down.json()["code"] == "openenv_task_catalog_failed"
        assert down.json()["details"]["cause"] == "environment_unavailable"
        inspected = await http.post("/v1/openenv/inspect", json={"environment_urls": [taskbank]})
        assert inspected.status_code == 200
        assert inspected.json()["schema"] == "kiln.openenv-inspection.v1"
        assert inspected.json()["environments"][0]["identity"]["base_url"] == taskbank
        gone = await http.post("/v1/openenv/inspect", json={"environment_urls": [unreachable_url()]})
        assert (gone.status_code, gone.json()["code"]) == (502, "openenv_inspection_failed")
