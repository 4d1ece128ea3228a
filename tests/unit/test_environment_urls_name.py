"""One field, one name: ``environment_urls`` is what the docs teach, what the OpenAPI document
requires, what errors name and what Kiln writes; ``environments`` is still read (older clients)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic_core import to_json

from api.app import create_app
from kiln.core.contracts import parse_run_request
from kiln.core.errors import InvalidRequest
from kiln.core.request_digest import request_digest
from kiln.core.settings import Settings

URL = "http://127.0.0.1:8990"


@pytest.mark.timeout(30)
def test_both_names_read_as_one_request_and_only_the_documented_one_is_written() -> None:
    documented = parse_run_request({"environment_urls": [URL]})
    older = parse_run_request({"environments": [URL]})
    assert documented == older and documented.environment_urls == [URL]
    assert request_digest(documented) == request_digest(older)
    for written in (documented.model_dump(mode="json", by_alias=True), documented.model_dump(mode="json")):
        assert written["environment_urls"] == [URL] and "environments" not in written
    assert b'"environment_urls":["http://127.0.0.1:8990"]' in to_json(documented)  # Temporal's payloads


@pytest.mark.timeout(30)
def test_errors_name_the_documented_field() -> None:
    for body in ({}, {"environment_urls": []}, {"environment_urls": [" "]}):
        with pytest.raises(InvalidRequest) as caught:
            parse_run_request(body)
        assert "environment_urls" in caught.value.message and "environments" not in caught.value.message, body


@pytest.mark.timeout(60)
async def test_the_openapi_document_and_the_api_use_the_documented_name(tmp_path: Path) -> None:
    app = create_app(Settings(home=tmp_path))
    schemas = app.openapi()["components"]["schemas"]
    for model in ("RunRequest", "EnvironmentsBody", "TasksBody"):
        assert "environment_urls" in schemas[model]["required"], model
        assert "environments" not in schemas[model]["properties"], model
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
        refused = await http.post("/v1/openenv/runs", json={"kind": "rollout"})
        assert refused.status_code == 400
        body = refused.json()
        assert body["code"] == "openenv_invalid_request"
        assert "environment_urls" in body["message"] and "environments" not in body["message"]
