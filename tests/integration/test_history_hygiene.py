"""History hygiene: a 256-group run stays well inside Temporal's limits (events and payload sizes)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.support.kiln_workers import running_workers
from tests.support.waiting import workflow_result
from workflows.options import WORKFLOW_NAME

pytestmark = pytest.mark.asyncio

TEMPORAL_WARN_EVENTS = 10_240
PAYLOAD_LIMIT = 256 * 1024


def _payload_sizes(event: Any) -> list[int]:
    """Byte sizes of every payload carried by one history event."""
    sizes: list[int] = []
    for field in (
        "workflow_execution_started_event_attributes",
        "activity_task_scheduled_event_attributes",
        "activity_task_completed_event_attributes",
        "workflow_execution_completed_event_attributes",
        "workflow_execution_signaled_event_attributes",
        "workflow_execution_update_accepted_event_attributes",
    ):
        if not event.HasField(field):
            continue
        attrs = getattr(event, field)
        for name in ("input", "result"):
            if hasattr(attrs, name) and attrs.HasField(name):
                sizes.extend(len(p.data) for p in getattr(attrs, name).payloads)
    return sizes


async def test_256_group_run_stays_small(kiln_settings: Any, counter_env_url: str) -> None:
    settings = kiln_settings(gpu_max_concurrent_activities=4)
    request = {
        "kind": "rollout",
        "environment_urls": [counter_env_url],
        "groups": 256,
        "group_size": 1,
        "max_steps": 1,
        "max_action_tokens": 8,
        "thinking": False,
    }
    run_id = str(uuid.uuid4())
    async with running_workers(settings) as client:
        handle = await client.start_workflow(
            WORKFLOW_NAME, request, id=run_id, task_queue=settings.control_task_queue
        )
        final = await workflow_result(handle)
        history = await handle.fetch_history()
    assert final["state"] == "completed"
    assert final["progress"]["groups_completed"] == 256
    events = list(history.events)
    sizes = [size for event in events for size in _payload_sizes(event)]
    largest = max(sizes)
    print(f"256-group run: {len(events)} history events, largest payload {largest} bytes")
    assert len(events) < TEMPORAL_WARN_EVENTS // 4
    assert largest < PAYLOAD_LIMIT // 4
