"""Chaos: the CONTROL worker is kill -9'd during discovery and during publication (issue 14 §9).

The control worker runs the workflows and the control activities (discovery, revalidation,
publication). Killed mid-activity, a fresh control worker must take the run over: the attempt is
retried (after its heartbeat or start-to-close timeout), the run completes, and exactly one
manifest is published, every artifact intact.

Discovery is frozen at a known point with a gated TCP proxy in front of the real environment
(``tests.support.gated_proxy``); publication with the ``PUBLISH_HOLD`` hook.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.chaos.conftest import rollout_request
from tests.support.chaos.assertions import record, verify_published
from tests.support.chaos.faults import PUBLISH_HOLD
from tests.support.chaos.runs import connect, result_within, start_run, wait_status, wait_until_async
from tests.support.chaos.stack import ChaosStack
from tests.support.gated_proxy import GatedProxy

pytestmark = pytest.mark.asyncio

# Discovery has no heartbeat: a lost attempt is retried after DISCOVERY_TIMEOUT (3 min).
DISCOVERY_RECOVERY_S = 300.0
PUBLISH_RECOVERY_S = 180.0


@pytest.mark.timeout(600)
async def test_control_worker_killed_during_discovery(stack: ChaosStack) -> None:
    proxy = GatedProxy(stack.env_url)
    try:
        client = await connect(stack)
        proxy.hold()
        started = time.monotonic()
        handle = await start_run(client, stack, rollout_request(proxy.url))
        await wait_status(handle, lambda s: s["phase"] == "discovery", timeout_s=60, what="discovery")
        await wait_until_async(lambda: proxy.parked > 0, timeout_s=30, what="discovery's first request")
        pid = await asyncio.to_thread(stack.kill_worker, "control")
        killed_at = time.monotonic()
        await asyncio.to_thread(stack.start_worker, "control")
        proxy.open()
        state, final = await result_within(handle, DISCOVERY_RECOVERY_S)
        assert state == "completed", final
        assert final["phase"] == "completed" and final["progress"]["groups_completed"] == 2
        verify_published(stack.store(), handle.id, final)
        record("9a control worker kill -9 during discovery", killed_pid=pid,
               kill_to_completed_s=time.monotonic() - killed_at, run_s=time.monotonic() - started)
    finally:
        proxy.close()


@pytest.mark.timeout(600)
async def test_control_worker_killed_during_publication(stack: ChaosStack) -> None:
    hooks = stack.hooks
    hooks.set(PUBLISH_HOLD)  # publication is in progress (held at its start) when the kill comes
    client = await connect(stack)
    started = time.monotonic()
    handle = await start_run(client, stack, rollout_request(stack.env_url))
    await wait_until_async(lambda: hooks.events("publish_start", run_id=handle.id), timeout_s=120,
                           what="publication to start")
    pid = await asyncio.to_thread(stack.kill_worker, "control")
    killed_at = time.monotonic()
    hooks.clear(PUBLISH_HOLD)  # the next attempt runs straight through
    await asyncio.to_thread(stack.start_worker, "control")
    state, final = await result_within(handle, PUBLISH_RECOVERY_S)
    assert state == "completed", final
    attempts = [e["attempt"] for e in hooks.events("publish_start", run_id=handle.id)]
    assert attempts[0] == 1 and max(attempts) >= 2, attempts  # the killed attempt was retried
    assert [e["outcome"] for e in hooks.events("publish_end", run_id=handle.id)] == ["ok"]
    manifest = verify_published(stack.store(), handle.id, final)
    assert {a["name"] for a in manifest["artifacts"]} == {"rollouts.jsonl", "replay.json", "summary.json", "metrics.jsonl"}
    record("9b control worker kill -9 during publication", killed_pid=pid, publish_attempts=attempts,
           kill_to_completed_s=time.monotonic() - killed_at, run_s=time.monotonic() - started)
