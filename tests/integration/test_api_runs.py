"""REST runs: exactly-once submission, replay/conflict, listing, status, cancellation, error envelope.

Real app (ASGI), real Temporal dev server, real control workers in-process.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from api.app import create_app
from api.runs import run_id_for
from kiln.core.contracts import parse_run_request
from tests.integration.test_api_helpers import (
    NO_PREFLIGHT,
    TINY_ROLLOUT,
    BlackHole,
    asgi_client,
    unreachable_url,
    wait_for,
)
from tests.support.kiln_workers import running_workers

pytestmark = pytest.mark.asyncio


async def test_twenty_concurrent_identical_submissions_make_one_run(kiln_settings: Any) -> None:
    settings = kiln_settings()
    key = f"api-once-{uuid.uuid4().hex}"
    request = {**TINY_ROLLOUT, "environment_urls": [unreachable_url()], "idempotency_key": key}
    expected_id = run_id_for(parse_run_request(request))
    async with running_workers(settings, roles=("control",)) as client:
        async with asgi_client(create_app(settings, client=client)) as http:
            responses = await asyncio.gather(
                *(http.post("/v1/openenv/runs", params=NO_PREFLIGHT, json=request) for _ in range(20))
            )
            codes = sorted(r.status_code for r in responses)
            assert codes == [200] * 19 + [202], [r.text for r in responses if r.status_code >= 400]
            assert {r.json()["run_id"] for r in responses} == {expected_id}

            executions = [e async for e in client.list_workflows(f"WorkflowId = '{expected_id}'")]
            assert len(executions) == 1

            # Same key, different body: conflict, no new work.
            changed = await http.post("/v1/openenv/runs", params=NO_PREFLIGHT, json={**request, "max_steps": 3})
            assert changed.status_code == 409
            assert changed.json()["code"] == "openenv_run_idempotency_conflict"

            # The run fails at discovery (nothing listens); the key stays bound to it.
            failed = await wait_for(http, expected_id, lambda s: s["state"] == "failed")
            assert failed["failure"]["code"] == "environment_unavailable"
            assert failed["failure"]["stage"] == "discovery"
            replay = await http.post("/v1/openenv/runs", params=NO_PREFLIGHT, json=request)
            assert replay.status_code == 200
            assert replay.json()["run_id"] == expected_id and replay.json()["state"] == "failed"
            executions = [e async for e in client.list_workflows(f"WorkflowId = '{expected_id}'")]
            assert len(executions) == 1

            # A finished run cannot be cancelled (both spellings).
            for method, path in (("POST", f"/v1/openenv/runs/{expected_id}/cancel"),
                                 ("DELETE", f"/v1/openenv/runs/{expected_id}")):
                refused = await http.request(method, path)
                assert refused.status_code == 409
                assert refused.json()["code"] == "openenv_run_not_cancellable"
                assert refused.json()["details"] == {"state": "failed"}

            # Listing: newest first, filtered by state.
            failed_list = (await http.get("/v1/openenv/runs", params={"state": "failed"})).json()
            assert failed_list["schema"] == "kiln.openenv-run-list.v1"
            assert expected_id in [r["run_id"] for r in failed_list["runs"]]
            assert all(r["state"] == "failed" for r in failed_list["runs"])
            row = next(r for r in failed_list["runs"] if r["run_id"] == expected_id)
            assert row["failure_code"] == "environment_unavailable"  # the outcome memo
            running = (await http.get("/v1/openenv/runs", params={"state": "running"})).json()
            assert expected_id not in [r["run_id"] for r in running["runs"]]
            everything = (await http.get("/v1/openenv/runs")).json()["runs"]
            starts = [r["started_at"] for r in everything]
            assert starts == sorted(starts, reverse=True)
            bad = await http.get("/v1/openenv/runs", params={"state": "sleeping"})
            assert bad.status_code == 400 and bad.json()["code"] == "openenv_invalid_request"


async def test_submissions_without_key_are_distinct_runs(kiln_settings: Any) -> None:
    settings = kiln_settings()
    request = {**TINY_ROLLOUT, "environment_urls": [unreachable_url()]}
    async with running_workers(settings, roles=("control",)) as client:
        async with asgi_client(create_app(settings, client=client)) as http:
            first = await http.post("/v1/openenv/runs", params=NO_PREFLIGHT, json=request)
            second = await http.post("/v1/openenv/runs", params=NO_PREFLIGHT, json=request)
            assert (first.status_code, second.status_code) == (202, 202)
            assert first.json()["run_id"] != second.json()["run_id"]
            for response in (first, second):
                uuid.UUID(response.json()["run_id"])
                await wait_for(http, response.json()["run_id"], lambda s: s["state"] == "failed")


async def test_cancel_running_run_ends_cancelled(kiln_settings: Any) -> None:
    settings = kiln_settings()
    hole = BlackHole()
    request = {**TINY_ROLLOUT, "environment_urls": [hole.url]}
    try:
        async with running_workers(settings, roles=("control",)) as client:
            async with asgi_client(create_app(settings, client=client)) as http:
                created = await http.post("/v1/openenv/runs", params=NO_PREFLIGHT, json=request)
                assert created.status_code == 202
                run_id = created.json()["run_id"]
                # Discovery hangs on the black hole: the run is running, in discovery.
                await wait_for(http, run_id, lambda s: s["phase"] == "discovery")

                cancelled = await http.post(f"/v1/openenv/runs/{run_id}/cancel")
                assert cancelled.status_code == 200
                assert cancelled.json()["cancel_requested"] is True
                final = await wait_for(
                    http, run_id, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout_s=30
                )
                # A cancelled run published nothing.
                missing = await http.get(f"/v1/openenv/runs/{run_id}/artifacts")
                assert missing.status_code == 404
                assert missing.json()["code"] == "openenv_artifact_not_found"
                assert final["state"] == "cancelled", final.get("failure")
                assert final["phase"] == "cancelled" and final["failure"] is None
                assert final["progress"]["groups_completed"] == 0

                again = await http.delete(f"/v1/openenv/runs/{run_id}")
                assert again.status_code == 409
                assert again.json()["code"] == "openenv_run_not_cancellable"
                assert again.json()["details"] == {"state": "cancelled"}
                listed = (await http.get("/v1/openenv/runs", params={"state": "cancelled"})).json()
                assert run_id in [r["run_id"] for r in listed["runs"]]
    finally:
        hole.close()


async def test_not_found_and_request_errors_use_the_envelope(kiln_settings: Any) -> None:
    settings = kiln_settings()
    async with asgi_client(create_app(settings)) as http:
        unknown = str(uuid.uuid4())
        for method, path in (
            ("GET", f"/v1/openenv/runs/{unknown}"),
            ("POST", f"/v1/openenv/runs/{unknown}/cancel"),
            ("DELETE", f"/v1/openenv/runs/{unknown}"),
            ("GET", f"/v1/openenv/runs/{unknown}/artifacts"),
            ("GET", "/v1/openenv/runs/not-a-run-id"),
        ):
            response = await http.request(method, path)
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["code"] == "openenv_run_not_found"

        route = await http.get("/v1/openenv/nothing-here")
        assert (route.status_code, route.json()["code"]) == (404, "not_found")
        method = await http.put("/v1/openenv/runs")
        assert (method.status_code, method.json()["code"]) == (405, "method_not_allowed")

        extra = await http.post(
            "/v1/openenv/runs", json={"environment_urls": ["http://127.0.0.1:9"], "surprise": 1}
        )
        assert extra.status_code == 400
        assert extra.json()["code"] == "openenv_invalid_request"
        assert "surprise" in extra.json()["message"]
        bounds = await http.post("/v1/openenv/runs", json={"environment_urls": ["http://127.0.0.1:9"], "groups": 0})
        assert bounds.status_code == 400 and "groups" in bounds.json()["message"]
        rollout_with_adapter = await http.post(
            "/v1/openenv/runs",
            json={"environment_urls": ["http://127.0.0.1:9"], "output_adapter": "x"},
        )
        assert rollout_with_adapter.status_code == 400
        remote = await http.post("/v1/openenv/runs", json={"environment_urls": ["http://example.com:80"]})
        assert (remote.status_code, remote.json()["code"]) == (403, "openenv_remote_environment_forbidden")

        big = b'{"environment_urls": ["http://127.0.0.1:9"], "reset_options": {"x": "' + b"a" * (1024 * 1024) + b'"}}'
        too_large = await http.post(
            "/v1/openenv/runs", content=big, headers={"content-type": "application/json"}
        )
        assert too_large.status_code == 413
        assert too_large.json()["code"] == "openenv_request_too_large"
        not_json = await http.post(
            "/v1/openenv/runs", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert (not_json.status_code, not_json.json()["code"]) == (400, "openenv_invalid_request")
