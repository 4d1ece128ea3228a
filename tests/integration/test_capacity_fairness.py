"""Capacity never holds a gpu slot: a run whose environment is full waits in workflow timers, so
runs on other environments go on at their normal pace.

Real Temporal, SeaweedFS, workers (2 gpu slots) and ``openenv`` counter servers; the "full"
environment is a 1-session server whose only session this test holds open. The property is read
from the workflow histories (the waiting run's attempts are short and its waits are timers; the
other runs' activities never sat in the queue for a slot), never from a wall-clock ratio of short
runs, which scheduling noise decides.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from kiln.core.openenv.session_open import open_session_and_reset
from kiln.core.openenv.urls import normalize_url
from tests.support.history_spans import RunHistory, run_history
from tests.support.kiln_workers import running_workers
from tests.support.servers import serve_example_env
from tests.support.waiting import workflow_result
from workflows.options import WORKFLOW_NAME

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(420), pytest.mark.slow]

# A capacity wait longer than any bound below: a run whose wait held a gpu slot would make another
# run's activity sit in the queue for about this long.
CAPACITY_WAIT_S = 15
# Generous bounds, far below CAPACITY_WAIT_S: a refused attempt ends within seconds, and a free
# slot is picked up within seconds even on a loaded machine.
SHORT_ATTEMPT_S = 10.0
SHORT_QUEUE_WAIT_S = 10.0

# Small runs next to a blocked one: more than ``max_active_runs`` (8), so some wait for admission
# while the blocked run holds its active slot.
SMALL_RUNS = 10
MAX_ACTIVE_RUNS = 8

SMALL = {"kind": "rollout", "groups": 2, "group_size": 2, "max_steps": 4, "max_action_tokens": 32}
TINY = {"kind": "rollout", "groups": 1, "group_size": 2, "max_steps": 1, "max_action_tokens": 8}


@pytest.fixture(scope="module")
def environments() -> Iterator[tuple[str, str]]:
    """A full environment (1 session, which each test holds open itself) and a free one, shared by
    this module's tests."""
    with serve_example_env("counter", max_concurrent_envs=1) as full_url, serve_example_env("counter") as free_url:
        yield full_url, free_url


async def _run(
    client: Any, settings: Any, request: dict[str, Any], workflow_id: str | None = None
) -> tuple[float, dict[str, Any]]:
    started = time.monotonic()
    handle = await client.start_workflow(
        WORKFLOW_NAME, request, id=workflow_id or str(uuid.uuid4()), task_queue=settings.control_task_queue
    )
    try:
        final = await workflow_result(handle)
    except WorkflowFailureError:
        status = await handle.query("status")
        raise AssertionError(f"run {handle.id} ended {status['state']}: {status['failure']}") from None
    return time.monotonic() - started, final


def _assert_waited_in_timers(history: RunHistory, gpu_queue: str) -> None:
    """The waiting run's gpu attempts were short (refused within seconds) and it waited in timers."""
    gpu = [span for span in history.activities if span.task_queue == gpu_queue]
    assert gpu, "the waiting run never tried its environment"
    assert history.timers_started >= 1
    long_attempts = [(span.activity_type, span.run_s) for span in gpu if span.run_s is not None and span.run_s >= SHORT_ATTEMPT_S]
    assert not long_attempts, f"attempts held a gpu slot while the environment was full: {long_attempts}"


async def _wait_collecting(handle: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await handle.query("status"))["phase"] != "collection":
        assert time.monotonic() < deadline, "run A never reached collection"
        await asyncio.sleep(0.2)


async def test_head_of_line_run_b_is_not_blocked_by_a_full_environment(
    kiln_settings: Any, environments: tuple[str, str]
) -> None:
    settings = kiln_settings()
    full_url, free_url = environments
    holder, _, _ = await open_session_and_reset(normalize_url(full_url), {"seed": 1}, capacity_wait_s=5)
    try:
        async with running_workers(settings) as client:
            solo, final = await _run(client, settings, {**SMALL, "environment_urls": [free_url]})
            assert final["state"] == "completed"
            # What the environment granted is in status (never in the artifacts).
            granted = final["environment_capacity"][free_url]
            assert granted["sessions_granted_max"] >= 2 and granted["waves"] == 2  # 2 groups, 1 wave each

            a = await client.start_workflow(
                WORKFLOW_NAME,
                {"kind": "rollout", "groups": 2, "group_size": 2, "max_steps": 2, "max_action_tokens": 16,
                 "capacity_wait_seconds": CAPACITY_WAIT_S, "environment_urls": [full_url]},
                id=str(uuid.uuid4()),
                task_queue=settings.control_task_queue,
            )
            await _wait_collecting(a)
            await asyncio.sleep(2.0)  # A's groups are now refused and backing off
            b_id = str(uuid.uuid4())
            shared, final_b = await _run(client, settings, {**SMALL, "environment_urls": [free_url]}, workflow_id=b_id)
            print(f"\nrun B solo {solo:.2f}s, while A waits for capacity {shared:.2f}s")
            assert final_b["state"] == "completed"
            assert final_b["progress"]["groups_completed"] == SMALL["groups"]
            assert (await a.query("status"))["phase"] == "collection"  # A is still waiting
            # B never waited for a gpu slot: A's wait was in timers, its attempts short.
            b_history = await run_history(client, b_id)
            b_gpu = [span for span in b_history.activities if span.task_queue == settings.gpu_task_queue]
            assert len(b_gpu) >= SMALL["groups"]
            waits = [span.queue_wait_s for span in b_gpu]
            assert all(wait is not None and wait < SHORT_QUEUE_WAIT_S for wait in waits), waits
            _assert_waited_in_timers(await run_history(client, a.id), settings.gpu_task_queue)

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


async def test_many_small_runs_with_a_blocked_environment_present(
    kiln_settings: Any, environments: tuple[str, str]
) -> None:
    settings = kiln_settings(max_active_runs=MAX_ACTIVE_RUNS, max_tracked_runs=64)
    full_url, free_url = environments
    holder, _, _ = await open_session_and_reset(normalize_url(full_url), {"seed": 1}, capacity_wait_s=5)
    try:
        async with running_workers(settings) as client:
            await _run(client, settings, {**TINY, "environment_urls": [free_url]})  # warm-up

            blocked = await client.start_workflow(
                WORKFLOW_NAME,
                {**TINY, "groups": 4, "capacity_wait_seconds": 600, "environment_urls": [full_url]},
                id=str(uuid.uuid4()),
                task_queue=settings.control_task_queue,
            )
            await _wait_collecting(blocked)
            started = time.monotonic()
            finals = await asyncio.gather(
                *(_run(client, settings, {**TINY, "environment_urls": [free_url], "seed_start": i}) for i in range(SMALL_RUNS))
            )
            print(f"\n{SMALL_RUNS} runs with a blocked environment present: {time.monotonic() - started:.1f}s")
            assert [final["state"] for _, final in finals] == ["completed"] * SMALL_RUNS
            assert all(final["progress"]["groups_completed"] == 1 for _, final in finals)
            assert (await blocked.query("status"))["phase"] == "collection"
            _assert_waited_in_timers(await run_history(client, blocked.id), settings.gpu_task_queue)
            # Cancelled while waiting for capacity (in a timer): it ends cancelled, quickly.
            await blocked.cancel()
            with pytest.raises(WorkflowFailureError):
                await workflow_result(blocked)
            assert (await blocked.query("status"))["state"] == "cancelled"
    finally:
        await holder.close()
