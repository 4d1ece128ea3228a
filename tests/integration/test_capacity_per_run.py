"""Capacity figures per run (issue 25): ``environment_capacity`` in status counts one run's
refusals, waves and the most sessions it held at once — never more than the server allows.

Real ``openenv`` counter servers with ONE session (``create_app(..., max_concurrent_envs=1)``).

* The ordering race behind ``sessions_granted_max: 2`` on 1-session servers: a group closes a
  finished episode's session (the server frees it at once) while the capacity book still counted
  it, so the next group's grant made two. A grant now leaves the book before its socket starts
  closing, whoever closes it.
* Two runs on one worker process: each run's status counts only its own refusals (a process-wide
  counter would hand the first run's refusal to the second) and at most 1 session at once.
* A third run while the only session is held elsewhere: each attempt refused for capacity is one
  INFO line in the worker's log with no traceback (no "Completing activity as failed" warning),
  and the run's refusals count those attempts' refusals too.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import pytest

from kiln.core.openenv.capacity import CAPACITY
from kiln.core.openenv.session import EnvSession
from kiln.core.openenv.session_open import open_session_and_reset
from kiln.core.openenv.urls import normalize_url
from kiln.core.rollout.sessions import SessionPlanner
from tests.support.servers import serve_example_env

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def single_session_url():
    with serve_example_env("counter", max_concurrent_envs=1) as url:
        yield url


def _planner(url: str, holder: str) -> SessionPlanner:
    return SessionPlanner(
        normalize_url(url), {"seed": 1}, bearer_token=None, group_index=0, group_size=1,
        capacity_wait_s=5.0, attempt_capacity_wait_s=None, should_cancel=lambda: False,
        heartbeat=lambda _details: None, holder=holder,
    )


async def test_a_session_closed_by_its_group_leaves_the_book_before_the_server_frees_it(single_session_url: str) -> None:
    url = single_session_url
    holder = f"run-{uuid.uuid4().hex[:8]}"
    first, second = _planner(url, holder), _planner(url, holder)
    opened: list[EnvSession] = []
    [(_, session, _, _)] = await first.open_wave([0], opened, 1)
    await session.close()  # as a group closes a finished episode: the server frees it now
    [(_, other, _, _)] = await second.open_wave([0], opened, 1)  # the server grants it again
    await first.release(session)  # the wave's cleanup, after the other grant
    await second.release(other)
    assert first.observed()["sessions_granted_max"] == 1
    assert second.observed()["sessions_granted_max"] == 1
    assert CAPACITY.snapshot(normalize_url(url).websocket_url)["sessions_granted_max"] == 1
    # Another holder (run) at the same environment starts from nothing.
    assert _planner(url, "another-run").observed()["sessions_granted_max"] == 0


ONE_GROUP = {"kind": "rollout", "groups": 1, "group_size": 2, "max_steps": 2, "max_action_tokens": 8,
             "concurrency": 2}


async def _start(client: Any, settings: Any, request: dict[str, Any]) -> Any:
    from workflows.options import WORKFLOW_NAME

    return await client.start_workflow(
        WORKFLOW_NAME, request, id=str(uuid.uuid4()), task_queue=settings.control_task_queue
    )


async def _completed(client: Any, settings: Any, request: dict[str, Any], handle: Any = None) -> dict[str, Any]:
    from tests.support.waiting import workflow_result

    handle = handle or await _start(client, settings, request)
    final = await workflow_result(handle, timeout_s=120)
    assert final["state"] == "completed", final.get("failure")
    return final


def _capacity_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kiln.expected" and "environment_at_capacity" in r.getMessage()]


@pytest.mark.slow
async def test_three_runs_on_a_one_session_server_count_only_their_own(
    kiln_settings: Any, single_session_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.support.kiln_workers import running_workers

    caplog.set_level(logging.INFO, logger="kiln.expected")
    settings = kiln_settings()
    url = single_session_url
    CAPACITY.forget(normalize_url(url).websocket_url)
    async with running_workers(settings) as client:
        # Run 1: its first wave of 2 meets exactly one refusal (CAPACITY_REACHED, max 1), then the
        # group runs in waves of 1.
        first = await _completed(client, settings, {**ONE_GROUP, "environment_urls": [url]})
        # Run 2, same worker process: the limit is known, so it never asks for 2 sessions.
        second = await _completed(client, settings, {**ONE_GROUP, "environment_urls": [url]})
        assert _capacity_lines(caplog) == []  # no attempt ended for capacity so far
        # Run 3 while another client holds the only session: its attempts end at capacity (the
        # workflow waits in timers) until the holder lets go.
        holder, _, _ = await open_session_and_reset(normalize_url(url), {"seed": 1}, capacity_wait_s=5)
        try:
            third_handle = await _start(client, settings, {**ONE_GROUP, "environment_urls": [url]})
            deadline = time.monotonic() + 90
            while not _capacity_lines(caplog):
                assert time.monotonic() < deadline, "run 3 was never refused"
                await asyncio.sleep(0.1)
        finally:
            await holder.close()
        third = await _completed(client, settings, {}, third_handle)
    lines = _capacity_lines(caplog)
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in lines)
    assert all("is at capacity" in r.getMessage() for r in lines)
    failed = [r for r in caplog.records if r.getMessage().startswith("Completing activity as failed")]
    assert [r for r in failed if r.levelno >= logging.WARNING] == []  # no traceback at WARNING
    # Each refused attempt met one refusal (waves of 1); the run's status counts them all.
    assert third["environment_capacity"][url] == {
        "sessions_granted_max": 1, "max_sessions_advertised": 1, "refusals": len(lines), "waves": 2,
    }
    assert first["environment_capacity"][url] == {
        "sessions_granted_max": 1, "max_sessions_advertised": 1, "refusals": 1, "waves": 2,
    }
    assert second["environment_capacity"][url] == {
        "sessions_granted_max": 1, "max_sessions_advertised": 1, "refusals": 0, "waves": 2,
    }
