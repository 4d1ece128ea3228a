"""Read what a run did from its Temporal history: activity spans (scheduled, started, closed, on which
task queue) and timers, across the run's child workflows.

Tests assert scheduling properties with these (a wait happened in a timer, an activity never
waited in a queue for a slot) instead of comparing wall-clock ratios of short runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from temporalio.api.enums.v1 import EventType

_CLOSED = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED: "activity_task_completed_event_attributes",
    EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED: "activity_task_failed_event_attributes",
    EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT: "activity_task_timed_out_event_attributes",
    EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED: "activity_task_canceled_event_attributes",
}


@dataclass
class ActivitySpan:
    """One activity execution of one workflow (the last attempt, as history records it)."""

    workflow_id: str
    activity_type: str
    task_queue: str
    scheduled: datetime
    started: datetime | None = None
    closed: datetime | None = None
    outcome: str | None = None  # "completed", "failed", "timed_out", "canceled"; None while open

    @property
    def queue_wait_s(self) -> float | None:
        """Seconds between scheduling and a worker picking the (last) attempt up."""
        return None if self.started is None else (self.started - self.scheduled).total_seconds()

    @property
    def run_s(self) -> float | None:
        return None if self.started is None or self.closed is None else (self.closed - self.started).total_seconds()


@dataclass
class RunHistory:
    activities: list[ActivitySpan]
    timers_started: int
    workflows: int  # the run's workflow and each child workflow it started


def _time(event: Any) -> datetime:
    return event.event_time.ToDatetime()


async def run_history(client: Any, workflow_id: str) -> RunHistory:
    """The activity spans and timer count of a workflow and, recursively, of its children."""
    pending = [workflow_id]
    spans: list[ActivitySpan] = []
    timers = 0
    seen = 0
    while pending:
        wid = pending.pop()
        seen += 1
        history = await client.get_workflow_handle(wid).fetch_history()
        by_id: dict[int, ActivitySpan] = {}
        for event in history.events:
            kind = event.event_type
            if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                attrs = event.activity_task_scheduled_event_attributes
                span = ActivitySpan(wid, attrs.activity_type.name, attrs.task_queue.name, _time(event))
                by_id[event.event_id] = span
                spans.append(span)
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                by_id[event.activity_task_started_event_attributes.scheduled_event_id].started = _time(event)
            elif kind in _CLOSED:
                attrs = getattr(event, _CLOSED[kind])
                span = by_id[attrs.scheduled_event_id]
                span.closed = _time(event)
                span.outcome = _CLOSED[kind].removeprefix("activity_task_").removesuffix("_event_attributes")
            elif kind == EventType.EVENT_TYPE_TIMER_STARTED:
                timers += 1
            elif kind == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED:
                pending.append(event.child_workflow_execution_started_event_attributes.workflow_execution.workflow_id)
    return RunHistory(activities=spans, timers_started=timers, workflows=seen)
