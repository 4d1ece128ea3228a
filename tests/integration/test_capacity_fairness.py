"""Capacity never holds a gpu slot (issue 14): a run whose environment is full waits in workflow
timers, so runs on other environments go on at their normal pace.

Real Temporal, SeaweedFS, workers (2 gpu slots) and ``openenv`` counter servers; the "full"
environment is a 1-session server whose only session this test holds open.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from kiln.openenv.session import open_session_and_reset
from kiln.openenv.urls import normalize_url
from tests.support.kiln_workers import running_workers
from tests.support.servers import serve_example_env
from workflows.options import WORKFLOW_NAME
from tests.support.waiting import workflow_result

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(420)]

# Run B: big enough that its solo time (~1-2 s here) is not dominated by scheduling noise.
SMALL = {"kind": "rollout", "groups": 2, "group_size": 2, "max_steps": 4, "max_action_tokens": 32}
TINY = {"kind": "rollout", "groups": 1, "group_size": 2, "max_steps": 1, "max_action_tokens": 8}


async def _run(client: Any, settings: Any, request: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    started = time.monotonic()
    handle = await client.start_workflow(
        WORKFLOW_NAME, request, id=str(uuid.uuid4()), task_queue=settings.control_task_queue
    )
    try:
        final = await workflow_result(handle)
    except WorkflowFailureError:
        status = await handle.query("status")
        raise AssertionError(f"run {handle.id} ended {status['state']}: {status['failure']}") from None
    return time.monotonic() - started, final


async def _wait_collecting(handle: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await handle.query("status"))["phase"] != "collection":
        assert time.monotonic() < deadline, "run A never reached collection"
        await asyncio.sleep(0.2)


async def test_head_of_line_run_b_is_not_blocked_by_a_full_environment(kiln_settings: Any) -> None:
    settings = kiln_settings()
    with serve_example_env("counter", max_concurrent_envs=1) as full_url, serve_example_env("counter") as free_url:
        holder, _, _ = await open_session_and_reset(normalize_url(full_url), {"seed": 1}, capacity_wait_s=5)
        try:
            async with running_workers(settings) as client:
                await _run(client, settings, {**SMALL, "environment_urls": [free_url]})  # warm-up
                solo, final = await _run(client, settings, {**SMALL, "environment_urls": [free_url]})
                assert final["state"] == "completed"
                # What the environment granted is in status (never in the artifacts).
                granted = final["environment_capacity"][free_url]
                assert granted["sessions_granted_max"] >= 2 and granted["waves"] == 2  # 2 groups, 1 wave each

                a = await client.start_workflow(
                    WORKFLOW_NAME,
                    {"kind": "rollout", "groups": 2, "group_size": 2, "max_steps": 2, "max_action_tokens": 16,
                     "capacity_wait_seconds": 15, "environment_urls": [full_url]},
                    id=str(uuid.uuid4()),
                    task_queue=settings.control_task_queue,
                )
                await _wait_collecting(a)
                await asyncio.sleep(2.0)  # A's groups are now refused and backing off
                shared, final_b = await _run(client, settings, {**SMALL, "environment_urls": [free_url]})
                print(f"\nrun B solo {solo:.2f}s, while A waits for capacity {shared:.2f}s ({shared / solo:.2f}x)")
                assert final_b["state"] == "completed"
                assert shared <= 2.0 * solo
                assert (await a.query("status"))["phase"] == "collection"  # A is still waiting

                with pytest.raises(WorkflowFailureError):
                    await workflow_result(a)
                failure = (await a.query("status"))["failure"]
                assert failure["code"] == "environment_capacity_exhausted"
                assert "group_size 2" in failure["message"] and "max_sessions 1" in failure["message"]
                assert failure["details"]["sessions_granted_max"] == 0
                assert failure["details"]["max_sessions_advertised"] == 1
                assert 15.0 <= failure["details"]["waited_s"] < 30.0
        finally:
            await holder.close()


async def test_forty_small_runs_with_a_blocked_environment_present(kiln_settings: Any) -> None:
    settings = kiln_settings(max_active_runs=8, max_tracked_runs=64)
    with serve_example_env("counter", max_concurrent_envs=1) as full_url, serve_example_env("counter") as free_url:
        holder, _, _ = await open_session_and_reset(normalize_url(full_url), {"seed": 1}, capacity_wait_s=5)
        try:
            async with running_workers(settings) as client:
                await _run(client, settings, {**TINY, "environment_urls": [free_url]})  # warm-up

                async def forty() -> float:
                    started = time.monotonic()
                    finals = await asyncio.gather(
                        *(_run(client, settings, {**TINY, "environment_urls": [free_url], "seed_start": i}) for i in range(40))
                    )
                    assert all(final["state"] == "completed" for _, final in finals)
                    return time.monotonic() - started

                alone = await forty()
                blocked = await client.start_workflow(
                    WORKFLOW_NAME,
                    {**TINY, "groups": 4, "capacity_wait_seconds": 600, "environment_urls": [full_url]},
                    id=str(uuid.uuid4()),
                    task_queue=settings.control_task_queue,
                )
                await _wait_collecting(blocked)
                with_blocked = await forty()
                print(f"\n40 runs alone {alone:.1f}s, with a blocked environment {with_blocked:.1f}s "
                      f"({with_blocked / alone:.2f}x)")
                assert with_blocked <= 3.0 * alone
                assert (await blocked.query("status"))["phase"] == "collection"
                # Cancelled while waiting for capacity (in a timer): it ends cancelled, quickly.
                await blocked.cancel()
                with pytest.raises(WorkflowFailureError):
                    await workflow_result(blocked)
                assert (await blocked.query("status"))["state"] == "cancelled"
        finally:
            await holder.close()
