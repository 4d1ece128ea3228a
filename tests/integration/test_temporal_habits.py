"""Temporal habits, against the real dev server, workers and API:

- a run started with the Temporal client under a workflow id a user chose (not a UUID) is a run id
  everywhere: status, follow, the run page and its data, the listing, cancel;
- its ``KilnEnvironment`` search attribute holds the normalised URL, and the final details in the
  Web UI carry the outcome;
- a run started on a task queue no worker polls (``kiln-gpu``-style mistake) says so
  (``no worker polls task queue … for this run``), its follow ends with ``run_unclaimed``, and a
  cancel says it cannot take effect yet.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from kiln.client import Client, RunNotCancellable, RunUnclaimed
from kiln.core.search_attributes import ENVIRONMENT
from tests.integration.test_api_helpers import TINY_ROLLOUT, serve_api
from tests.support.kiln_workers import running_workers
from workflows.names import KILN_ENVIRONMENT, WORKFLOW_NAME

pytestmark = pytest.mark.asyncio


def _typed_url(url: str) -> str:
    """The URL as a user might type it: upper-case scheme and host, a trailing slash."""
    scheme, rest = url.split("://", 1)
    return f"{scheme.upper()}://{rest.replace('127.0.0.1', 'LOCALHOST')}/"


@pytest.mark.timeout(300)
async def test_a_user_given_workflow_id_is_a_run_id_everywhere(kiln_settings: Any, counter_env_url: str) -> None:
    settings = kiln_settings()
    run_id = f"my-run-{uuid.uuid4().hex[:6]}"
    port = counter_env_url.rsplit(":", 1)[1]
    async with running_workers(settings) as temporal:
        handle = await temporal.start_workflow(
            WORKFLOW_NAME, {**TINY_ROLLOUT, "environment_urls": [_typed_url(counter_env_url)]},
            id=run_id, task_queue=settings.control_task_queue,
        )
        with serve_api(settings) as url, Client(url) as kiln:
            final = await asyncio.to_thread(kiln.wait, run_id, poll_s=0.3, timeout_s=240)
            assert (final.run_id, final.state, final.progress.rollouts_completed) == (run_id, "completed", 2)
            assert (await asyncio.to_thread(kiln.status, run_id)).manifest == final.manifest
            listed = await asyncio.to_thread(kiln.runs)
            assert [r.environment for r in listed.runs if r.run_id == run_id] == [f"http://localhost:{port}"]
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                page = await http.get(f"/runs/{run_id}")
                assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
                metrics = await http.get(f"/v1/openenv/runs/{run_id}/metrics")
                assert metrics.status_code == 200 and metrics.json()["run_id"] == run_id
                missing = await http.get("/v1/openenv/runs/no-such-run-xyz")
                assert missing.status_code == 404 and missing.json()["code"] == "openenv_run_not_found"
            with pytest.raises(RunNotCancellable):
                await asyncio.to_thread(kiln.cancel, run_id)

        description = await handle.describe()
        assert description.typed_search_attributes.get(KILN_ENVIRONMENT) == f"http://localhost:{port}"
        assert ENVIRONMENT == "KilnEnvironment"
        metadata = await handle.query("__temporal_workflow_metadata")
        details = metadata.current_details
        assert details.startswith("**phase** completed · **groups** 1/1 · **rollouts** 2/2"), details


@pytest.mark.timeout(180)
async def test_a_run_on_a_queue_no_worker_polls_says_so_and_its_follow_ends(
    kiln_settings: Any, counter_env_url: str
) -> None:
    settings = kiln_settings()
    queue = f"kiln-gpu-{uuid.uuid4().hex[:6]}"
    run_id = f"lost-run-{uuid.uuid4().hex[:6]}"
    async with running_workers(settings) as temporal:
        handle = await temporal.start_workflow(
            WORKFLOW_NAME, {**TINY_ROLLOUT, "environment_urls": [counter_env_url]}, id=run_id, task_queue=queue,
        )
        try:
            with serve_api(settings) as url, Client(url) as kiln:
                expected = f"no worker polls task queue {queue} for this run"
                view = await asyncio.to_thread(kiln.status, run_id)
                assert (view.state, view.unclaimed) == ("running", expected)
                with pytest.raises(RunUnclaimed) as info:
                    await asyncio.to_thread(lambda: list(kiln.follow(run_id, poll_s=0.2, timeout_s=60)))
                assert info.value.code == "run_unclaimed" and info.value.message == expected
                assert "kiln-control" in (info.value.hint or "")
                cancelled = await asyncio.to_thread(kiln.cancel, run_id)
                assert cancelled.cancel_requested and cancelled.unclaimed == expected
        finally:
            await handle.terminate(reason="test cleanup")
