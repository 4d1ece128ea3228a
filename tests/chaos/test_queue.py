"""Chaos: two runs submitted at once with KILN_MAX_ACTIVE_RUNS=1 go through the FIFO run queue.

The later one waits (phase ``queued``, ``admission.queue_position`` 1) and is admitted only after
the earlier one has finished its work; admission order follows the queue's sequence numbers.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

import pytest

from tests.chaos.conftest import rollout_request
from tests.support.chaos.assertions import record
from tests.support.chaos.faults import SAMPLE_DELAY
from tests.support.chaos.runs import connect, result_within, start_run, wait_status
from tests.support.chaos.stack import ChaosStack

pytestmark = pytest.mark.asyncio


async def test_two_runs_fifo_with_one_slot(stack: ChaosStack) -> None:
    assert stack.max_active_runs == 1
    hooks = stack.hooks
    hooks.set(SAMPLE_DELAY, 0.3)  # the first run lasts a few seconds
    client = await connect(stack)
    handles = await asyncio.gather(
        start_run(client, stack, rollout_request(stack.env_url)),
        start_run(client, stack, rollout_request(stack.env_url)),
    )
    statuses = [
        await wait_status(h, lambda s: (s.get("admission") or {}).get("sequence") is not None,
                          timeout_s=30, what="a queue sequence number")
        for h in handles
    ]
    first, second = (h for _, h in sorted(zip((s["admission"]["sequence"] for s in statuses), handles)))
    waiting = await wait_status(
        second, lambda s: s["phase"] == "queue" and s["admission"].get("queue_position") == 1,
        timeout_s=30, what="the second run queued at position 1",
    )
    first_status = await wait_status(first, lambda s: s["phase"] not in ("admission", "queue"),
                                     timeout_s=30, what="the first run admitted")
    assert waiting["phase"] == "queue" and first_status["admission"]["queue_position"] is None
    results = await asyncio.gather(*(result_within(h, 120) for h in (first, second)))
    assert [state for state, _ in results] == ["completed", "completed"], results
    a, b = (value for _, value in results)
    admitted_a = datetime.fromisoformat(a["admission"]["admitted_at"])
    admitted_b = datetime.fromisoformat(b["admission"]["admitted_at"])
    assert a["admission"]["sequence"] < b["admission"]["sequence"]
    assert admitted_a < admitted_b
    # The second run touched the environment only once the first had published (its last piece
    # of work). Both stamps come from the same clock (the hooks), so no slack is needed; the
    # workflow's admitted_at is another clock and is only compared with the other run's.
    first_done = hooks.events("publish_end", run_id=first.id, outcome="ok")[-1]["t"]
    assert min(e["t"] for e in hooks.events("collect_start", run_id=second.id)) >= first_done
    record(
        "8 FIFO queue, two runs at once, max_active_runs=1",
        second_queue_wait_ms=b["admission"]["queue_wait_ms"],
        first_queue_wait_ms=a["admission"]["queue_wait_ms"],
        admitted_gap_s=(admitted_b - admitted_a).total_seconds(),
        second_admitted_after_first_published_s=admitted_b.timestamp() - first_done,
    )
