"""How many groups one run keeps in flight: ``KILN_RUN_PARALLEL_GROUPS`` (default 4 with hf), read
by the control worker at admission and recorded in the run's admission result, so the workflow's
gate comes from history (a run admitted before the setting existed replays with 4).

Real stack (Temporal dev server, SeaweedFS, the counter environment, the real control and gpu
workers); only the policy is scripted (``FixedActionPolicy``), so each group is a few real
episodes and no model runs. The figure is read from the run's history: the most ``collect_group``
activities scheduled and not yet ended at any point. The workflow schedules a whole gate's worth
in its first collection task, so with 12 groups the gate itself is reached.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType

from api.runs import RunService
from kiln.core.contracts import parse_run_request
from tests.support.kiln_workers import running_workers
from tests.support.scripted_gpu import scripted_gpu_factory
from tests.support.scripted_policy import FixedActionPolicy
from tests.support.waiting import workflow_result

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]

GROUPS = 12


ENDED = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED: "activity_task_completed_event_attributes",
    EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED: "activity_task_failed_event_attributes",
    EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT: "activity_task_timed_out_event_attributes",
    EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED: "activity_task_canceled_event_attributes",
}


async def _most_groups_in_flight(settings: Any, counter_env_url: str) -> tuple[int, dict, dict]:
    """Run a 12-group rollout run; the most ``collect_group`` activities in flight at once in its
    history (scheduled and not yet ended: a group refused for capacity ends its attempt and is
    scheduled again), the final status, and the admission result as recorded."""
    request = parse_run_request({
        "kind": "rollout", "environment_urls": [counter_env_url], "groups": GROUPS, "group_size": 2,
        "max_steps": 1, "max_action_tokens": 16, "thinking": False,
    })
    async with running_workers(settings, gpu_factory=scripted_gpu_factory(FixedActionPolicy('{"amount": 1}'))) as client:
        status, _ = await RunService(client, settings).submit(request)
        handle = client.get_workflow_handle(status.run_id)
        final = await workflow_result(handle, timeout_s=200)
        events = (await handle.fetch_history()).events
    names: dict[int, str] = {}
    in_flight = most = 0
    admission: dict = {}
    for event in events:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            names[event.event_id] = name
            if name == "collect_group":
                in_flight += 1
                most = max(most, in_flight)
        elif event.event_type in ENDED:
            attrs = getattr(event, ENDED[event.event_type])
            name = names.get(attrs.scheduled_event_id)
            if name == "collect_group":
                in_flight -= 1
            if name == "admit_run" and event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                admission = json.loads(attrs.result.payloads[0].data)
    assert in_flight == 0
    return most, final, admission


async def test_a_run_keeps_the_admitted_number_of_groups_in_flight(kiln_settings: Any, counter_env_url: str) -> None:
    # a gpu worker with room for 8 at once: the run's own gate is what limits it
    default_settings = kiln_settings(gpu_max_concurrent_activities=8)
    wide_settings = kiln_settings(gpu_max_concurrent_activities=8, run_parallel_groups=8)

    default_in_flight, default_final, default_admission = await _most_groups_in_flight(
        default_settings, counter_env_url)
    wide_in_flight, wide_final, wide_admission = await _most_groups_in_flight(
        wide_settings, counter_env_url)

    for final in (default_final, wide_final):
        assert final["state"] == "completed", final.get("failure")
        assert final["progress"]["groups_completed"] == GROUPS
    assert default_admission["parallel_groups"] == 4 and default_in_flight == 4
    assert wide_admission["parallel_groups"] == 8 and wide_in_flight == 8
