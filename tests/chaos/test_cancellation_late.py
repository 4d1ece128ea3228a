"""Chaos: cancellation in the late stages (issue 14 §9): during identity revalidation, during
the post-training static evaluation, and after publication's commit point.

Before the commit point a cancelled run ends ``cancelled`` naming the stage and publishes
nothing; after it (manifest written) the cancel can no longer undo the publication, so the run
ends ``completed`` with exactly that manifest.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.chaos.conftest import rollout_request, train_request
from tests.support.chaos.assertions import manifest_absent, record, verify_published
from tests.support.chaos.environments import wait_env_idle
from tests.support.chaos.faults import PUBLISH_HOLD_AFTER, REVALIDATE_HOLD, SAMPLE_DELAY
from tests.support.chaos.runs import connect, result_within, start_run, wait_status, wait_until_async
from tests.support.chaos.stack import ChaosStack

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(420)]

PROMPT_S = 10.0


async def _cancel(handle: Any) -> tuple[float, str, dict[str, Any]]:
    began = time.monotonic()
    await handle.cancel()
    state, _ = await result_within(handle, 60)
    return time.monotonic() - began, state, await handle.query("status")


def _assert_cancelled(stack: ChaosStack, run_id: str, state: str, status: dict[str, Any], stage: str) -> None:
    assert state == "cancelled", (state, status.get("failure"))
    assert status["phase"] == "cancelled" and status["cancelled_stage"] == stage
    assert status["manifest"] is None and status["artifacts"] == []
    assert manifest_absent(stack.store(), run_id)


async def test_cancel_during_revalidation(stack: ChaosStack) -> None:
    hooks = stack.hooks
    hooks.set(REVALIDATE_HOLD)  # revalidation waits (heartbeating) until the test lets it go
    try:
        client = await connect(stack)
        handle = await start_run(client, stack, rollout_request(stack.env_url))
        await wait_status(handle, lambda s: s["phase"] == "revalidation", timeout_s=120, what="revalidation")
        await wait_until_async(lambda: bool(hooks.events("revalidate_held", run_id=handle.id)),
                               timeout_s=30, what="revalidation to be held")
        seconds, state, status = await _cancel(handle)
        _assert_cancelled(stack, handle.id, state, status, "revalidation")
        assert seconds < PROMPT_S, seconds
        record("7g cancel during revalidation", cancel_to_closed_s=seconds)
    finally:
        hooks.clear(REVALIDATE_HOLD)


async def test_cancel_during_post_evaluation(stack: ChaosStack) -> None:
    hooks = stack.hooks
    client = await connect(stack)
    request = train_request(stack.env_url, output_adapter="chaos-post-eval",
                            post_eval={"suite": "counter-format", "include_baseline": True})
    handle = await start_run(client, stack, request)
    await wait_status(handle, lambda s: s["phase"] == "training", timeout_s=120, what="training")
    hooks.set(SAMPLE_DELAY, 0.5)  # evaluation generations stay in flight long enough
    await wait_status(handle, lambda s: s["phase"] == "post_evaluation", timeout_s=180, what="post_eval")
    seconds, state, status = await _cancel(handle)
    hooks.clear(SAMPLE_DELAY)
    _assert_cancelled(stack, handle.id, state, status, "post_evaluation")
    assert seconds < PROMPT_S, seconds
    await wait_env_idle(stack.env_url, stack.env_max_sessions)
    record("7h cancel during post_eval", cancel_to_closed_s=seconds)


async def test_cancel_after_the_commit_point_keeps_the_publication(stack: ChaosStack) -> None:
    hooks = stack.hooks
    hooks.set(PUBLISH_HOLD_AFTER)  # the manifest is written; the activity has not returned yet
    client = await connect(stack)
    handle = await start_run(client, stack, rollout_request(stack.env_url))
    await wait_until_async(lambda: hooks.events("publish_end", run_id=handle.id, outcome="ok"),
                           timeout_s=120, what="the manifest to be written")
    await handle.cancel()
    await asyncio.sleep(1.0)  # the cancel reaches the held activity
    hooks.clear(PUBLISH_HOLD_AFTER)
    state, final = await result_within(handle, 60)
    assert state == "completed", final
    assert final["phase"] == "completed"
    verify_published(stack.store(), handle.id, final)
    record("7i cancel after the commit point", state=state)
