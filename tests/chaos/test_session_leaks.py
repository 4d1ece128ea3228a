"""Chaos: sessions never leak, even against a 1-session server with no idle-session reaper.

The environment is the real ``openenv`` counter with ``max_concurrent_envs=1`` and OpenEnv's
default ``session_timeout=None`` (its reaper is off), so a session nobody closes is held for good
and every later client meets ``CAPACITY_REACHED``. The gpu worker is SIGKILLed mid-episode, holding
the only session: the kernel closes its sockets, the server frees the session, and a probe gets
it within ``SESSION_FREE_BOUND_S`` (docs/openenv.md, "Sessions never leak"). A new worker's attempt
then collects the interrupted group from reset in that session and the run completes.
"""

from __future__ import annotations

import time

import pytest

from kiln.devstack.processes import free_port_block
from tests.chaos.conftest import rollout_request
from tests.support.chaos.assertions import record
from tests.support.chaos.environments import wait_env_idle
from tests.support.chaos.faults import SAMPLE_DELAY
from tests.support.chaos.runs import connect, last_details, result_within, start_run, wait_activity
from tests.support.chaos.stack import ChaosStack, serve_counter

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.timeout(400)]

SESSION_FREE_BOUND_S = 10.0  # kill -> the server grants its only session again (documented bound)


async def test_a_killed_worker_leaves_no_session_behind(stack: ChaosStack) -> None:
    (port,) = free_port_block(1, grpc_offset=None)
    env = serve_counter(stack.root, "counter-no-reaper-1", port=port, max_concurrent_envs=1)
    url = f"http://127.0.0.1:{port}"
    hooks = stack.hooks
    try:
        hooks.set(SAMPLE_DELAY, 0.4)  # an episode stays in flight > 1 s, so the kill lands in one
        client = await connect(stack)
        handle = await start_run(client, stack, rollout_request(url, concurrency=1))
        act = await wait_activity(
            client, handle,
            lambda a: a["type"] == "collect_group" and a["state"] == "STARTED" and a["attempt"] == 1
            and bool(last_details(a).get("step")),
            timeout_s=90, what="a collect_group mid-episode (holding the only session)",
        )
        assert last_details(act)["step"] >= 1
        pid = stack.kill_worker("gpu")
        killed = time.monotonic()
        hooks.clear(SAMPLE_DELAY)
        freed_s = await wait_env_idle(url, 1, timeout_s=SESSION_FREE_BOUND_S)
        assert time.monotonic() - killed <= SESSION_FREE_BOUND_S

        stack.start_worker("gpu")
        state, final = await result_within(handle, 180)
        assert state == "completed", final
        assert final["progress"]["rollouts_completed"] == 4
        interrupted = [item for item in final["interruptions"] if item["code"] == "executor_interrupted"]
        assert interrupted and all(item["attempts"] >= 2 for item in interrupted)
        redone = [e for e in hooks.events("collect_end", run_id=handle.id, outcome="ok") if e["pid"] != pid]
        assert {item["group_index"] for item in interrupted} <= {e["group_index"] for e in redone}
        capacity = final["environment_capacity"][url]
        assert capacity["sessions_granted_max"] == 1
        # Afterwards nothing is held: the one session opens again at once.
        idle_after_s = await wait_env_idle(url, 1)
        record("sessions never leak: gpu worker SIGKILL mid-episode, 1-session server without reaper",
               kill_to_session_free_s=freed_s, bound_s=SESSION_FREE_BOUND_S,
               refusals=capacity["refusals"], env_idle_after_s=idle_after_s)
    finally:
        hooks.clear(SAMPLE_DELAY)
        env.stop()


FROZEN_FREE_BOUND_S = 90.0  # the server's WebSocket keepalive (uvicorn: 20 s ping + 20 s timeout) plus slack


async def test_a_frozen_worker_loses_its_session_to_the_servers_keepalive(stack: ChaosStack) -> None:
    """A frozen worker (SIGSTOP) keeps its socket open, and no other process can close it: the
    session comes back when the server's keepalive drops the silent client. Meanwhile the run's
    next attempt (after the heartbeat timeout) waits for capacity in workflow timers, then
    collects the group in the freed session."""
    import os
    import signal

    (port,) = free_port_block(1, grpc_offset=None)
    env = serve_counter(stack.root, "counter-no-reaper-2", port=port, max_concurrent_envs=1)
    url = f"http://127.0.0.1:{port}"
    hooks = stack.hooks
    frozen = None
    try:
        hooks.set(SAMPLE_DELAY, 0.4)
        client = await connect(stack)
        handle = await start_run(client, stack, rollout_request(url, concurrency=1))
        await wait_activity(
            client, handle,
            lambda a: a["type"] == "collect_group" and a["state"] == "STARTED" and a["attempt"] == 1
            and bool(last_details(a).get("step")),
            timeout_s=90, what="a collect_group mid-episode (holding the only session)",
        )
        frozen = stack.workers.pop("gpu")
        os.killpg(frozen.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        hooks.clear(SAMPLE_DELAY)
        stack.start_worker("gpu")
        freed_s = await wait_env_idle(url, 1, timeout_s=FROZEN_FREE_BOUND_S)
        state, final = await result_within(handle, 240)
        assert state == "completed", final
        assert final["progress"]["rollouts_completed"] == 4
        capacity = final["environment_capacity"][url]
        assert capacity["sessions_granted_max"] == 1
        record("sessions never leak: gpu worker SIGSTOP mid-episode, 1-session server without reaper",
               stop_to_session_free_s=freed_s, bound_s=FROZEN_FREE_BOUND_S, refusals=capacity["refusals"],
               run_s=time.monotonic() - stopped)
    finally:
        hooks.clear(SAMPLE_DELAY)
        if frozen is not None:
            frozen.kill()  # SIGKILL ends a stopped process group too
        env.stop()
