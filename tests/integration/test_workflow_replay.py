"""Workflow determinism: every kept history replays through the SDK's Replayer on HEAD.

Histories are kept per release under ``tests/histories/<release>/`` and never re-recorded or
deleted: a change to workflow code that would break runs in flight — runs started by any earlier
release — fails here. Such a change goes behind ``workflow.patched`` (docs/upgrading.md); a new
release's histories are recorded into a new folder with ``python -m tests.support.record_histories``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workers.converter import kiln_data_converter
from workers.sandbox import workflow_runner
from workflows.chunk import CollectChunkWorkflow
from workflows.openenv_run import OpenEnvRunWorkflow
from workflows.preflight import PreflightWorkflow
from workflows.run_queue import RunQueueWorkflow
from workflows.train_dataset import TrainDatasetWorkflow

ROOT = Path(__file__).resolve().parents[1] / "histories"
HISTORIES = sorted(ROOT.glob("*/*.json"))
# The release at which issue 24 was filed: its histories are the first kept ones.
FIRST_KEPT = ROOT / "a71a5c5"


def _named(stem: str) -> Path:
    return FIRST_KEPT / f"{stem}.json"


def test_histories_are_kept_per_release_and_none_loose() -> None:
    assert not list(ROOT.glob("*.json")), "a history outside a release folder"
    assert {p.stem for p in FIRST_KEPT.glob("*.json")} == {
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
    assert all(p.parent.parent == ROOT for p in HISTORIES)


def test_recording_refuses_an_existing_release_folder(tmp_path: Path) -> None:
    from tests.support.record_histories import release_folder

    (tmp_path / "a71a5c5").mkdir()
    with pytest.raises(FileExistsError, match="never re-recorded"):
        release_folder("a71a5c5", root=tmp_path)
    assert release_folder("v0.2.0", root=tmp_path) == tmp_path / "v0.2.0"
    assert not (tmp_path / "v0.2.0").exists()
    with pytest.raises(ValueError):
        release_folder("../escape", root=tmp_path)


def test_model_rollout_history_routes_gpu_work_to_the_model_queue() -> None:
    """The run naming model "tiny" scheduled every gpu activity on the model's own queue."""
    import json

    path = _named("model_rollout")
    events = json.loads(path.read_text())["events"]
    queues = {
        e["activityTaskScheduledEventAttributes"]["activityType"]["name"]: e["activityTaskScheduledEventAttributes"]["taskQueue"]["name"]
        for e in events
        if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"
    }
    assert queues["resolve_policy"] == queues["collect_group"] == "kiln-gpu-history.tiny"
    assert queues["admit_run"] == "kiln-control-history"


@pytest.mark.asyncio
@pytest.mark.parametrize("path", HISTORIES, ids=[f"{p.parent.name}/{p.stem}" for p in HISTORIES])
async def test_history_replays_deterministically(path: Path) -> None:
    replayer = Replayer(
        workflows=[OpenEnvRunWorkflow, CollectChunkWorkflow, RunQueueWorkflow, PreflightWorkflow, TrainDatasetWorkflow],
        data_converter=kiln_data_converter,  # the workers' converter
        workflow_runner=workflow_runner(),  # the workers' sandbox
    )
    history = WorkflowHistory.from_json(f"{path.parent.name}-{path.stem}", path.read_text())
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None


def test_retry_interrupt_cancel_history_holds_all_three() -> None:
    """The recorded run really retried a group (attempt 2) and really ended cancelled."""
    import json

    path = _named("retry_interrupt_cancel")
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

    path = _named("online_rl")
    events = json.loads(path.read_text())["events"]
    names = [
        e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
        for e in events
        if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"
    ]
    assert names.count("train_adapter") == 2 and names.count("store_iteration") == 2
    assert names.index("store_iteration") < names.index("publish_run")
    assert names[-1] == "publish_run"
