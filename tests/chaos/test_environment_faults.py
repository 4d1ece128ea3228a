"""Chaos: the environment server dies mid-episode, or refuses capacity for a while.

A killed environment that comes back on the same port costs the affected groups a re-collection
(from reset, same seeds), or fails the run with a clear code — never a hang. An environment at
capacity is waited for (CAPACITY_REACHED retries) and the retries are counted in summary.json.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from kiln.devstack.processes import free_port_block
from tests.chaos.conftest import rollout_request, train_request
from tests.support.chaos.assertions import read_uri, record
from tests.support.chaos.environments import SessionHolder, wait_env_idle
from tests.support.chaos.faults import SAMPLE_DELAY
from tests.support.chaos.runs import (
    RunOutcome,
    connect,
    last_details,
    result_within,
    start_run,
    wait_activity,
)
from tests.support.chaos.stack import ChaosStack, serve_counter

pytestmark = pytest.mark.asyncio

ENV_DOWN_S = 1.5
RUN_BOUND_S = 120.0  # "no hang": the run must end (either way) within this
CAPACITY_HOLD_S = 3.0


async def test_environment_dies_mid_episode_and_returns(stack: ChaosStack, reference_train: RunOutcome) -> None:
    hooks = stack.hooks
    hooks.set(SAMPLE_DELAY, 0.4)
    client = await connect(stack)
    started = time.monotonic()
    handle = await start_run(client, stack, train_request(stack.env_url))
    act = await wait_activity(
        client, handle,
        lambda a: a["type"] == "collect_group" and a["state"] == "STARTED" and a["attempt"] == 1
        and bool(last_details(a).get("step")),
        timeout_s=90, what="a collect_group mid-episode",
    )
    killed_at = time.time()
    stack.kill_env()
    await asyncio.sleep(ENV_DOWN_S)
    hooks.clear(SAMPLE_DELAY)
    await asyncio.to_thread(stack.start_env)
    back_at = time.time()
    state, final = await result_within(handle, RUN_BOUND_S)
    ended = time.monotonic()
    # The environment came back on the same port: the run must recover (re-collect the affected
    # groups) and complete. A failure here — even a clean environment_unavailable — is a defect.
    if state != "completed":
        status = await handle.query("status")
        record("4 environment killed mid-episode, back on the same port", state=state,
               failure=status["failure"], seconds_to_end=ended - started)
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, ended - started)
    interrupted = {item["group_index"] for item in final["interruptions"] if item["activity"] == "collect_group"}
    assert last_details(act)["group_index"] in interrupted
    failed_attempts = [e for e in hooks.events("collect_end", run_id=handle.id) if e["outcome"] != "ok"]
    assert {e["group_index"] for e in failed_attempts} == interrupted
    # Same URL, same seeds, re-collected from reset: the artifacts equal the reference run's.
    reference_train.assert_same_artifacts(outcome, stack)
    redone = [e for e in hooks.events("collect_end", run_id=handle.id, outcome="ok") if e["group_index"] in interrupted]
    record(
        "4 environment killed mid-episode, back on the same port",
        state=state,
        groups_recollected=len(interrupted),
        attempts=[item["attempts"] for item in final["interruptions"]],
        interruption_codes=sorted({item["code"] for item in final["interruptions"]}),
        failed_attempt_errors=sorted({e["outcome"] for e in failed_attempts}),
        env_down_s=back_at - killed_at,
        env_back_to_groups_recollected_s=max(e["t"] for e in redone) - back_at,
        run_s=outcome.seconds,
        artifacts_identical=True,
    )


async def test_environment_capacity_refused_for_a_while(stack: ChaosStack) -> None:
    (port,) = free_port_block(1, grpc_offset=None)
    env = serve_counter(stack.root, "counter-capacity-1", port=port, max_concurrent_envs=1)
    url = f"http://127.0.0.1:{port}"
    try:
        holder = SessionHolder(url)  # the only session, held by this test
        released = threading.Event()

        client = await connect(stack)
        started = time.monotonic()
        handle = await start_run(client, stack, rollout_request(url, concurrency=1, capacity_wait_seconds=60))
        # Hold the session until collection is really under way (refusals are happening), then
        # for CAPACITY_HOLD_S more: the release cannot race ahead of the first refused reset.
        await wait_activity(
            client, handle, lambda a: a["type"] == "collect_group" and a["state"] == "STARTED",
            timeout_s=60, what="a collect_group attempt (its resets are being refused)",
        )

        def release_later() -> None:
            time.sleep(CAPACITY_HOLD_S)
            holder.release()
            released.set()

        threading.Thread(target=release_later, daemon=True).start()
        state, final = await result_within(handle, 90)
        seconds = time.monotonic() - started
        assert released.is_set()
        assert state == "completed", getattr(final, "cause", final)
        summary_uri = next(a["uri"] for a in final["artifacts"] if a["name"] == "summary.json")
        summary = json.loads(read_uri(stack.store(), summary_uri))
        # Refusals are waited for in workflow timers (no gpu slot, no session held): they are run
        # facts in status, never artifact content.
        assert not [key for key in summary["stats"] if "capacity" in key]
        retries = final["environment_capacity"][url]["refusals"]
        assert retries > 0, (final.get("environment_capacity"), stack.hooks.events("collect_end", run_id=handle.id))
        assert final["progress"]["rollouts_completed"] == 4
        # Afterwards the environment is idle again: its one session can be opened (bounded wait).
        idle_s = await wait_env_idle(url, 1)
        record("5 environment refuses capacity (max_concurrent_envs=1, session held)",
               held_s=CAPACITY_HOLD_S, capacity_retry_count=retries, run_s=seconds,
               env_idle_after_s=idle_s)
    finally:
        env.stop()
