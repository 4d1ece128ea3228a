"""Workflow determinism: recorded histories replay through the SDK's Replayer.

A change to workflow code that would break runs already in flight fails here. If a change is
meant to be incompatible, re-record with ``python -m tests.support.record_histories tests/histories``
(and use ``workflow.patched`` for runs that must survive the upgrade).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.chunk import CollectChunkWorkflow
from workflows.openenv_run import OpenEnvRunWorkflow
from workflows.preflight import PreflightWorkflow
from workflows.run_queue import RunQueueWorkflow
from workflows.train_dataset import TrainDatasetWorkflow

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("*.json"))


def test_histories_were_recorded() -> None:
    assert {p.stem for p in HISTORIES} >= {
        "train_with_gate",
        "rollout",
        "unreachable",
        "run_queue",
        "run_queue_one_signal_at_a_time",  # recorded before the queue's signals-at-once patch
        "train_dataset",
        "retry_interrupt_cancel",
        "model_rollout",
        "online_rl",
    }


def test_model_rollout_history_routes_gpu_work_to_the_model_queue() -> None:
    """The run naming model "tiny" scheduled every gpu activity on the model's own queue."""
    import json

    path = next(p for p in HISTORIES if p.stem == "model_rollout")
    events = json.loads(path.read_text())["events"]
    queues = {
        e["activityTaskScheduledEventAttributes"]["activityType"]["name"]: e["activityTaskScheduledEventAttributes"]["taskQueue"]["name"]
        for e in events
        if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"
    }
    assert queues["resolve_policy"] == queues["collect_group"] == "kiln-gpu-history.tiny"
    assert queues["admit_run"] == "kiln-control-history"


@pytest.mark.asyncio
@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_history_replays_deterministically(path: Path) -> None:
    replayer = Replayer(
        workflows=[OpenEnvRunWorkflow, CollectChunkWorkflow, RunQueueWorkflow, PreflightWorkflow, TrainDatasetWorkflow],
        data_converter=pydantic_data_converter,
    )
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None


def test_retry_interrupt_cancel_history_holds_all_three() -> None:
    """The recorded run really retried a group (attempt 2) and really ended cancelled."""
    import json

    path = next(p for p in HISTORIES if p.stem == "retry_interrupt_cancel")
    events = json.loads(path.read_text())["events"]
    attempts = [
        e["activityTaskStartedEventAttributes"].get("attempt", 1)
        for e in events
        if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_STARTED"
    ]
    assert max(attempts) == 2
    kinds = {e["eventType"] for e in events}
    assert "EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED" in kinds
    assert events[-1]["eventType"] == "EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED"


def test_online_rl_history_trains_twice_each_from_the_last() -> None:
    """The recorded two-iteration run: two train_adapter activities, the second continuing from the
    first's adapter and optimizer state; each iteration stored before publication."""
    import json

    path = next(p for p in HISTORIES if p.stem == "online_rl")
    events = json.loads(path.read_text())["events"]
    names = [
        e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
        for e in events
        if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"
    ]
    assert names.count("train_adapter") == 2 and names.count("store_iteration") == 2
    assert names.index("store_iteration") < names.index("publish_run")
    assert names[-1] == "publish_run"
