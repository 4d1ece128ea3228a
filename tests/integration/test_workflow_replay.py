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

from tests.support.replay import head_replayer

ROOT = Path(__file__).resolve().parents[1] / "histories"
HISTORIES = sorted(ROOT.glob("*/*.json"))
# The release at which issue 24 was filed: its histories are the first kept ones.
FIRST_KEPT = ROOT / "a71a5c5"
# A run started on 0051d57's workers and finished on aa15cce's (tests/support/mixed_version.py).
MIXED = ROOT / "mixed-0051d57-to-aa15cce"


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
    replayer = head_replayer()  # the control workers' workflows, converter and sandbox
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


def test_the_mixed_version_history_holds_both_releases_workers() -> None:
    """The kept mixed run: its first workflow tasks and activities ran on the earlier release's
    worker process, the training's second attempt (after that worker's kill: a heartbeat timeout)
    and everything after it on the later release's, and the run completed."""
    import json

    events = json.loads((MIXED / "train_killed_mid_training.json").read_text())["events"]
    tasks = [e["workflowTaskCompletedEventAttributes"]["identity"] for e in events
             if e["eventType"] == "EVENT_TYPE_WORKFLOW_TASK_COMPLETED"]
    old, new = tasks[0], tasks[-1]
    assert old != new and set(tasks) == {old, new}
    scheduled = {e["eventId"]: e["activityTaskScheduledEventAttributes"]["activityType"]["name"] for e in events
                 if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"}
    started = [(scheduled[a["scheduledEventId"]], a.get("attempt", 1), a["identity"], a.get("lastFailure"))
               for e in events if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_STARTED"
               for a in [e["activityTaskStartedEventAttributes"]]]
    train = [s for s in started if s[0] == "train_adapter"]
    assert [(s[1], s[2]) for s in train] == [(2, new)] and train[0][3]["timeoutFailureInfo"]["timeoutType"] == (
        "TIMEOUT_TYPE_HEARTBEAT")
    assert {s[2] for s in started[: started.index(train[0])]} == {old}
    assert {s[2] for s in started[started.index(train[0]):]} == {new}
    assert [s[0] for s in started].count("collect_group") == 4 and started[-1][0] == "publish_run"
    assert events[-1]["eventType"] == "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED"



def _collections_during_trainings(path: Path) -> list[int]:
    """For each train_adapter of the history at ``path``: how many collect_group activities were
    scheduled between its scheduling and its completion."""
    import json

    events = json.loads(path.read_text())["events"]
    scheduled = {e["eventId"]: e["activityTaskScheduledEventAttributes"]["activityType"]["name"] for e in events
                 if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"}
    order = [("scheduled", scheduled[e["eventId"]]) if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"
             else ("completed", scheduled[e["activityTaskCompletedEventAttributes"]["scheduledEventId"]])
             for e in events
             if e["eventType"] in ("EVENT_TYPE_ACTIVITY_TASK_SCHEDULED", "EVENT_TYPE_ACTIVITY_TASK_COMPLETED")]
    starts = [i for i, item in enumerate(order) if item == ("scheduled", "train_adapter")]
    ends = [i for i, item in enumerate(order) if item == ("completed", "train_adapter")]
    return [order[a:b].count(("scheduled", "collect_group")) for a, b in zip(starts, ends)]


def _patch_ids(path: Path) -> list[str]:
    import base64
    import json

    events = json.loads(path.read_text())["events"]
    return [json.loads(base64.b64decode(p["data"]))["id"] for e in events
            if e["eventType"] == "EVENT_TYPE_MARKER_RECORDED"
            for p in e["markerRecordedEventAttributes"]["details"].get("patch-data", {}).get("payloads", [])]


def test_the_stale_overlap_history_collects_while_it_trains() -> None:
    """d788376's three-iteration ``max_staleness`` 1 run, recorded before the setting could exceed 1
    (it replays on HEAD above, so staleness 1 keeps its commands): the collections of iterations 2
    and 3 (two groups each) were scheduled while iterations 1 and 2 trained; iteration 3 overlaps nothing."""
    path = ROOT / "d788376" / "online_rl_stale.json"
    assert _collections_during_trainings(path) == [2, 2, 0]
    assert "stale-pipeline" not in _patch_ids(path)


def test_the_stale_pipeline_history_collects_ahead_one_collection_at_a_time() -> None:
    """7c1fee2's four-iteration ``max_staleness`` 2 run (two groups an iteration), behind its patch:
    iteration 3's groups were collected before iteration 2 trained and iteration 4's before 3 did
    (strictly on-policy, 2, 4, 6 groups precede the trainings), and never more than one iteration's
    collection (two groups) was in flight."""
    import json

    path = ROOT / "7c1fee2" / "online_rl_stale2.json"
    assert "stale-pipeline" in _patch_ids(path)
    events = json.loads(path.read_text())["events"]
    scheduled = {e["eventId"]: e["activityTaskScheduledEventAttributes"]["activityType"]["name"] for e in events
                 if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"}
    before, collected, in_flight, most = [], 0, 0, 0
    for e in events:
        if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED":
            name = scheduled[e["eventId"]]
            collected += name == "collect_group"
            in_flight += name == "collect_group"
            if name == "train_adapter":
                before.append(collected)
        elif e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_COMPLETED":
            in_flight -= scheduled[e["activityTaskCompletedEventAttributes"]["scheduledEventId"]] == "collect_group"
        most = max(most, in_flight)
    assert before == [2, 6, 8, 8] and most == 2
