"""Chaos: a run cancelled in each stage ends ``cancelled`` promptly, names the stage, publishes
nothing, and leaves no WebSocket session open on the environment.

"No session left" is checked on the real environment: afterwards it accepts exactly its
``max_concurrent_envs`` sessions and refuses one more.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.chaos.conftest import rollout_request, train_request
from tests.support.chaos.assertions import expect_fixed, manifest_absent, record
from tests.support.chaos.environments import SlowHealthServer, wait_env_idle
from tests.support.chaos.faults import PUBLISH_HOLD, SAMPLE_DELAY, TRAIN_STEP_DELAY
from tests.support.chaos.runs import (
    connect,
    last_details,
    result_within,
    start_run,
    wait_activity,
    wait_status,
    wait_until_async,
)
from tests.support.chaos.stack import ChaosStack

pytestmark = pytest.mark.asyncio

PROMPT_S = 10.0  # a cancelled run must be closed within this


async def _cancel(handle: Any) -> tuple[float, dict[str, Any]]:
    """Cancel, wait for the run to close (bounded); return (seconds, final status)."""
    began = time.monotonic()
    await handle.cancel()
    state, _ = await result_within(handle, 60)
    seconds = time.monotonic() - began
    assert state == "cancelled", state
    assert seconds < PROMPT_S, f"cancellation took {seconds:.1f}s"
    return seconds, await handle.query("status")


def _assert_cancelled(stack: ChaosStack, run_id: str, status: dict[str, Any], stage: str) -> None:
    assert status["state"] == "cancelled" and status["phase"] == "cancelled"
    assert status["cancelled_stage"] == stage, status.get("cancelled_stage")
    assert status["manifest"] is None and status["artifacts"] == []
    assert manifest_absent(stack.store(), run_id)


async def test_cancel_while_queued_and_mid_group(stack: ChaosStack) -> None:
    hooks = stack.hooks
    delay = 1.0
    hooks.set(SAMPLE_DELAY, delay)  # run A holds the only slot (max_active_runs=1) for a while
    client = await connect(stack)
    # Constrained actions: every action is valid, so episodes run several slowed steps (an
    # invalid first action would end a group after one sample, before the test could cancel).
    first = await start_run(client, stack, rollout_request(stack.env_url, max_steps=6, constrained_actions=True))
    await wait_activity(
        client, first,
        lambda a: a["type"] == "collect_group" and a["state"] == "STARTED" and bool(last_details(a).get("group_index") is not None),
        timeout_s=60, what="run A mid-group",
    )
    queued = await start_run(client, stack, rollout_request(stack.env_url))
    await wait_status(queued, lambda s: s["phase"] == "queue" and (s.get("admission") or {}).get("queue_position") == 1,
                      timeout_s=30, what="run B queued at position 1")

    queued_s, status = await _cancel(queued)
    _assert_cancelled(stack, queued.id, status, "queue")
    # No environment contact, no model use: the only activities it ran were admission and the queue.
    events = hooks.events(run_id=queued.id)
    assert {e["type"] for e in events if e["event"] == "activity_start"} <= {"admit_run", "enqueue_run"}
    assert [e for e in events if e["event"] != "activity_start"] == []

    cancelled_at = time.time()
    group_s, status = await _cancel(first)
    _assert_cancelled(stack, first.id, status, "collection")
    # In-flight attempts learn of the cancel with a heartbeat reply (heartbeats are throttled to
    # 0.8 x timeout) and stop at the next step boundary, or finish first; either way they end
    # within that bound and close their sessions.
    started = hooks.events("collect_start", run_id=first.id)
    bound = 0.8 * stack.heartbeat_timeout_s + 2 * delay + 3.0
    await wait_until_async(lambda: len(hooks.events("collect_end", run_id=first.id)) == len(started),
                           timeout_s=bound, what="run A's collection attempts to end")
    ends = hooks.events("collect_end", run_id=first.id)
    hooks.clear(SAMPLE_DELAY)
    idle_s = await wait_env_idle(stack.env_url, stack.env_max_sessions)
    record("7a cancel while queued", cancel_to_closed_s=queued_s, stage="queue")
    record(
        "7c cancel mid-group",
        cancel_to_closed_s=group_s,
        attempts_ended=[e["outcome"] for e in ends],
        cancel_to_attempts_ended_s=max(e["t"] for e in ends) - cancelled_at,
        sessions_all_closed_within_s=idle_s,
    )


async def test_cancel_during_discovery(stack: ChaosStack) -> None:
    slow = SlowHealthServer(delay_s=30)
    try:
        client = await connect(stack)
        handle = await start_run(client, stack, rollout_request(slow.url))
        await wait_status(handle, lambda s: s["phase"] == "discovery", timeout_s=30, what="discovery")
        await wait_until_async(lambda: slow.requests > 0, timeout_s=15, what="the slow /health request")
        seconds, status = await _cancel(handle)
        _assert_cancelled(stack, handle.id, status, "discovery")
        record("7b cancel during discovery (stalled /health)", cancel_to_closed_s=seconds)
    finally:
        slow.close()


async def test_cancel_during_training(stack: ChaosStack) -> None:
    hooks = stack.hooks
    hooks.set(TRAIN_STEP_DELAY, 0.7)
    client = await connect(stack)
    handle = await start_run(client, stack, train_request(stack.env_url))
    await wait_until_async(lambda: hooks.events("train_step", run_id=handle.id), timeout_s=90,
                           what="the first training step")
    status = await wait_status(handle, lambda s: True, timeout_s=5, what="status")
    assert status["phase"] == "training"
    cancelled_at = time.time()
    seconds, status = await _cancel(handle)
    _assert_cancelled(stack, handle.id, status, "training")
    end = await wait_until_async(lambda: hooks.events("train_end", run_id=handle.id), timeout_s=15,
                                 what="the training attempt to stop")
    steps = hooks.events("train_step", run_id=handle.id)
    assert end[-1]["outcome"].startswith("error:"), end  # stopped, not run to the end
    assert max(e["step"] for e in steps) < steps[0]["total_steps"]
    idle_s = await wait_env_idle(stack.env_url, stack.env_max_sessions)
    record(
        "7d cancel during training",
        cancel_to_closed_s=seconds,
        cancel_to_training_stopped_s=end[-1]["t"] - cancelled_at,
        training_stopped_with=end[-1]["outcome"],
        steps_done=f"{max(e['step'] for e in steps)}/{steps[0]['total_steps']}",
        sessions_all_closed_within_s=idle_s,
    )


async def test_cancel_during_evaluation(stack: ChaosStack) -> None:
    hooks = stack.hooks
    client = await connect(stack)
    request = train_request(stack.env_url, environment_eval={"groups": 2, "group_size": 2})
    handle = await start_run(client, stack, request)
    await wait_status(handle, lambda s: s["phase"] == "training", timeout_s=90, what="training")
    hooks.set(SAMPLE_DELAY, 0.5)  # evaluation episodes stay in flight long enough to be cancelled
    await wait_status(handle, lambda s: s["phase"] == "evaluation", timeout_s=90, what="evaluation")
    seconds, status = await _cancel(handle)
    _assert_cancelled(stack, handle.id, status, "evaluation")
    hooks.clear(SAMPLE_DELAY)
    idle_s = await wait_env_idle(stack.env_url, stack.env_max_sessions)
    record("7e cancel during evaluation", cancel_to_closed_s=seconds,
           evaluation_state=(status.get("environment_evaluation") or {}).get("state"),
           sessions_all_closed_within_s=idle_s)


async def test_cancel_during_publication_publishes_nothing(stack: ChaosStack) -> None:
    hooks = stack.hooks
    hooks.set(PUBLISH_HOLD)  # publication is in progress (held at its start) when the cancel comes
    client = await connect(stack)
    handle = await start_run(client, stack, rollout_request(stack.env_url))
    await wait_until_async(lambda: hooks.events("publish_start", run_id=handle.id), timeout_s=60,
                           what="publication to start")
    seconds, status = await _cancel(handle)
    assert status["cancelled_stage"] == "publication"
    hooks.clear(PUBLISH_HOLD)
    end = await wait_until_async(lambda: hooks.events("publish_end", run_id=handle.id), timeout_s=30,
                                 what="the publication attempt to end")
    await asyncio.sleep(0.2)
    absent = manifest_absent(stack.store(), handle.id)
    record("7f cancel during publication", cancel_to_closed_s=seconds,
           publication_attempt_after_cancel=end[-1]["outcome"], manifest_written_after_cancel=not absent)
    expect_fixed(absent, f"run {handle.id} is 'cancelled' but its manifest was published afterwards")
