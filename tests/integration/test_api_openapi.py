"""The OpenAPI document is complete, and the real API answers what it says.

- every operation documents a schema for its success answer (and the run routes name ``RunView``
  / ``RunList``);
- schemathesis ``response_schema_conformance``, a few schema-valid requests per operation against
  the real app (uvicorn, real Temporal dev server, SeaweedFS and a control worker), plus the
  real answers about one run that failed at discovery: every answer matches its documented schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import response_schema_conformance

from api.app import create_app
from kiln.core.settings import Settings
from tests.integration.test_api_fuzz import _ControlWorker
from tests.integration.test_api_helpers import NO_PREFLIGHT, TINY_ROLLOUT, serve_api, unreachable_url

EXAMPLES = 2  # per operation: conformance, not fuzzing (test_api_fuzz fuzzes)


def _success_schemas(document: dict[str, Any]) -> dict[str, list[str]]:
    """``{"METHOD path": [status codes of 2xx answers that document a body schema]}``."""
    found: dict[str, list[str]] = {}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            found[f"{method.upper()} {path}"] = [
                status
                for status, answer in operation["responses"].items()
                if status.startswith("2") and any("schema" in c for c in answer.get("content", {}).values())
            ]
    return found


@pytest.mark.timeout(60)
def test_every_operation_documents_its_success_schema(tmp_path: Path) -> None:
    document = create_app(Settings(home=tmp_path)).openapi()
    found = _success_schemas(document)
    assert len(found) == 15, sorted(found)
    assert [label for label, statuses in found.items() if not statuses] == []
    assert sorted(found["POST /v1/openenv/runs"]) == ["200", "202"]  # a replay answers 200

    def ref(label: str, status: str = "200") -> str:
        method, path = label.split(" ", 1)
        content = document["paths"][path][method.lower()]["responses"][status]["content"]
        return content["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]

    assert ref("GET /v1/openenv/runs/{run_id}") == "RunView"
    assert ref("POST /v1/openenv/runs", "202") == "RunView"
    assert ref("POST /v1/openenv/runs/{run_id}/cancel") == "RunView"
    assert ref("GET /v1/openenv/runs") == "RunList"
    assert ref("POST /v1/train/grpo", "202") == "RunView"
    view = document["components"]["schemas"]["RunView"]["properties"]
    assert {"phase", "progress", "failure", "temporal_ui", "in_flight", "status_source"} <= set(view)


@pytest.mark.slow
@pytest.mark.timeout(600)  # the session fixtures (tiny model, servers) may be built here
def test_answers_conform_to_the_documented_schemas(kiln_settings: Any) -> None:
    app_settings = kiln_settings()
    checked: dict[str, int] = {}
    with _ControlWorker(app_settings), serve_api(app_settings) as base_url:
        document = httpx.get(f"{base_url}/openapi.json", timeout=30).json()
        schema = schemathesis.openapi.from_dict(document)
        session = requests.Session()

        # One real run: it fails at discovery (nothing listens), so its status, the listing and a
        # refused cancel are real answers about a real run.
        created = session.post(
            f"{base_url}/v1/openenv/runs", params=NO_PREFLIGHT,
            json={**TINY_ROLLOUT, "environment_urls": [unreachable_url()]}, timeout=60,
        )
        assert created.status_code == 202, created.text
        run_id = created.json()["run_id"]

        for operation in [result.ok() for result in schema.get_all_operations()]:
            if operation.path.endswith("/training/preflight"):
                continue  # a valid body waits for a gpu worker (test_api_fuzz covers its refusals)

            @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case: Any) -> None:
                if "run_id" in (case.path_parameters or {}):
                    case.path_parameters["run_id"] = run_id
                response = case.call(base_url=base_url, session=session, timeout=60)
                assert response.status_code != 500, response.text
                case.validate_response(response, checks=[response_schema_conformance])
                checked[operation.label] = checked.get(operation.label, 0) + 1

            run()
    assert len(checked) == 14, sorted(checked)
    assert sum(checked.values()) >= 14
