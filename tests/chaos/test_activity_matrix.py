"""Chaos matrix: for every activity type of a train run, kill -9 the worker that runs it.

One train run with a paired environment evaluation and a static post-evaluation goes through
every activity type a run uses. Each type in turn is parked at the start of its first attempt
(the ``park_activity`` hook, heartbeating); the worker process running it (control or gpu) is
SIGKILLed while a second, fresh worker of that role polls, and a replacement starts. Each time the
retry must start within the type's documented recovery bound (``workflows/options.py``,
docs/durability.md: the heartbeat timeout, 3 s here, or the start-to-close of a short activity)
plus a generous slack for the loaded machine. The run must
then complete with every artifact identical to an undisturbed run of the same request, and its
status must name every retried activity with its attempt.

The dataset-training workflow's two activities (``split_dataset``, ``publish_training``) get the
same treatment on a run that trains from the reference train run's rollouts;
``tests/chaos/test_online_rl_chaos.py`` kills the worker running online RL's ``store_iteration``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from tests.chaos.conftest import TRAINING_CONFIG, train_request
from tests.support.chaos.assertions import read_uri, record
from tests.support.chaos.faults import PARK_ACTIVITY
from tests.support.chaos.runs import RunOutcome, connect, drive, result_within, start_run, wait_until_async
from tests.support.chaos.stack import ChaosStack
from workflows.names import TRAIN_DATASET_WORKFLOW
from workflows.options import GROUP_HEARTBEAT, OPTIONS as BY_ACTIVITY

OPTIONS = {activity.__name__: options for activity, options in BY_ACTIVITY.items()}  # by activity name

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

# In the order a train run with evaluation and post-evaluation reaches them.
MATRIX = (
    "admit_run",
    "enqueue_run",
    "discover_environments",
    "resolve_policy",
    "collect_group",
    "index_groups",
    "revalidate_environments",
    "train_adapter",
    "store_side_bundle",
    "world_model_gain",
    "evaluate_run",
    "post_evaluate",
    "publish_run",
)
# The dataset-training workflow's activities (both on the control worker).
DATASET_MATRIX = ("split_dataset", "publish_training")
EVAL_RECEIPT = "environment_eval/receipt.json"
# Beyond the bound: a loaded 2-core machine's scheduling (the standby worker polls and starts it).
SLACK_S = 20.0


def matrix_request(env_url: str) -> dict[str, Any]:
    return train_request(
        env_url,
        environment_eval={"groups": 2, "group_size": 1},
        post_eval={"suite": "counter-format", "min_accuracy": 0.0},
    )


def _role(kind: str) -> str:
    """The worker role that runs ``kind``: its queue's, and for the trainers' queue the gpu worker
    (it polls both its gpu queue and the trainers' queue beside it)."""
    queue = OPTIONS[kind].queue
    return "gpu" if queue == "train" else queue


@pytest.mark.timeout(1500)
async def test_every_activity_recovers_from_a_killed_worker(stack: ChaosStack) -> None:
    client = await connect(stack)
    reference = await drive(client, stack, matrix_request(stack.env_url), timeout_s=300)
    names = {item["activity"] for item in reference.status["interruptions"]}
    assert reference.status["interruptions_total"] == 0, reference.status["interruptions"]
    assert not names

    started = time.monotonic()
    handle, _, (state, final) = await _kill_in_turn(
        stack, lambda: start_run(client, stack, matrix_request(stack.env_url)), MATRIX
    )
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, time.monotonic() - started)
    record("matrix: run with every activity killed once", run_s=outcome.seconds,
           reference_run_s=reference.seconds, kills=len(MATRIX))
    # The evaluation receipt names its run: equal to the reference's but for that one field.
    theirs, ours = (_receipt_without_run_id(stack, o) for o in (reference, outcome))
    assert theirs == ours
    for o in (reference, outcome):
        o.digests.pop(EVAL_RECEIPT)
    reference.assert_same_artifacts(outcome, stack)
    retried_in_status = {item["activity"]: item["attempts"] for item in final["interruptions"]}
    for kind in MATRIX:
        assert retried_in_status.get(kind, 0) >= 2, (kind, final["interruptions"])
    assert final["interruptions_total"] == len(final["interruptions"]) >= len(MATRIX)


async def _kill_in_turn(
    stack: ChaosStack, start: Any, kinds: tuple[str, ...], *, default_heartbeat: tuple[str, ...] = ()
) -> tuple[Any, list[dict[str, Any]], tuple[str, Any]]:
    """Start a run (``start()``) with ``kinds[0]`` parked; SIGKILL the worker running each kind's
    first attempt in turn (the next kind parks), assert each retry starts within its bound plus
    ``SLACK_S``; returns the run's handle, one row per kill and ``result_within``'s answer. The
    kinds in ``default_heartbeat`` run with the default heartbeat timeout, not the stack's."""
    hooks = stack.hooks
    # A standby worker per role polls next to the one that will be killed, so the retry waits only
    # for Temporal to notice the death (what the bound says), not for a process to start; after each
    # kill a fresh replacement starts while the run goes on.
    for role in sorted({_role(kind) for kind in kinds}):
        await asyncio.to_thread(stack.start_worker, role)
    hooks.set(PARK_ACTIVITY, kinds[0])
    handle = await start()
    rows: list[dict[str, Any]] = []
    try:
        for index, kind in enumerate(kinds):
            parked = await wait_until_async(
                lambda: hooks.events("activity_parked", run_id=handle.id, type=kind), timeout_s=240,
                what=f"{kind} to start (parked)",
            )
            role = _role(kind)
            pid = parked[0]["pid"]
            victim = next(proc for proc in stack.every_process if proc.pid == pid)
            assert victim.alive() and "worker-" + role in str(victim.log_path), (kind, victim.log_path)
            killed_at = time.time()
            victim.kill()
            if stack.workers.get(role) is victim:
                stack.workers.pop(role)
            if index + 1 < len(kinds):  # the next type parks; this one's retry runs straight through
                hooks.set(PARK_ACTIVITY, kinds[index + 1])
            else:
                hooks.clear(PARK_ACTIVITY)
            replacement = asyncio.ensure_future(asyncio.to_thread(stack.start_worker, role))
            heartbeat = GROUP_HEARTBEAT if kind in default_heartbeat else _seconds(stack.heartbeat_timeout_s)
            bound_s = OPTIONS[kind].recovery_bound(heartbeat).total_seconds()
            retried = await wait_until_async(
                lambda: [e for e in hooks.events("activity_start", run_id=handle.id, type=kind)
                         if e["attempt"] >= 2 and e["pid"] != pid],
                timeout_s=bound_s + SLACK_S + 60, what=f"{kind}'s retry",
            )
            recovery_s = retried[0]["t"] - killed_at
            rows.append({"activity": kind, "worker": role, "bound_s": bound_s, "kill_to_retry_s": round(recovery_s, 1)})
            record(f"matrix: worker SIGKILL during {kind}", **rows[-1])
            assert recovery_s <= bound_s + SLACK_S, rows[-1]
            await replacement
        return handle, rows, await result_within(handle, 300)
    finally:  # the package's other tests expect one worker per role
        kept = [id(proc) for proc in (*stack.workers.values(), *stack.spares())]
        for proc in stack.every_process:
            if proc.log_path.name.startswith("worker-") and proc.alive() and id(proc) not in kept:
                await asyncio.to_thread(proc.stop, timeout_s=15)


@pytest.mark.timeout(600)
async def test_dataset_training_activities_recover_from_a_killed_worker(
    stack: ChaosStack, reference_train: RunOutcome
) -> None:
    from kiln.core.training_config import TrainingConfig
    from kiln.core.records import StoredObject
    from kiln.core.side_records import TrainDatasetInput

    store = stack.store()
    rollouts = read_uri(store, next(a["uri"] for a in reference_train.status["artifacts"] if a["name"] == "rollouts.jsonl"))
    request = TrainDatasetInput(
        dataset=StoredObject.of(await asyncio.to_thread(store.put_blob, rollouts)),
        output_adapter="chaos-dataset",
        training_config=TrainingConfig(**TRAINING_CONFIG),
    ).model_dump(mode="json", by_alias=True)
    client = await connect(stack)
    reference = await drive(client, stack, request, workflow=TRAIN_DATASET_WORKFLOW)
    assert reference.status["training"]["trained"] is True and reference.status["interruptions_total"] == 0

    started = time.monotonic()
    # split_dataset is the workflow's first activity: it is scheduled before the workflow learns
    # the workers' heartbeat timeout (split_dataset answers it), so it has the default 30 s.
    handle, rows, (state, final) = await _kill_in_turn(
        stack, lambda: start_run(client, stack, request, workflow=TRAIN_DATASET_WORKFLOW), DATASET_MATRIX,
        default_heartbeat=("split_dataset",),
    )
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, time.monotonic() - started)
    record("matrix: dataset training with each activity killed once", run_s=outcome.seconds,
           reference_run_s=reference.seconds, kills=len(rows))
    reference.assert_same_artifacts(outcome, stack)
    retried_in_status = {item["activity"]: item["attempts"] for item in final["interruptions"]}
    assert all(retried_in_status.get(kind, 0) >= 2 for kind in DATASET_MATRIX), final["interruptions"]


def _receipt_without_run_id(stack: ChaosStack, outcome: RunOutcome) -> dict[str, Any]:
    uri = next(a["uri"] for a in outcome.status["artifacts"] if a["name"] == EVAL_RECEIPT)
    receipt = json.loads(read_uri(stack.store(), uri))
    assert receipt.pop("run_id") == outcome.run_id
    return receipt


def _seconds(value: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=value)
