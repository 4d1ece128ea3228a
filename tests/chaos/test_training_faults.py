"""Chaos, in training: a kill -9 redoes at most one checkpoint interval (the checkpoint heartbeat
reaches Temporal within the gpu worker's 1 s heartbeat throttle, not 0.8 x the heartbeat
timeout), and a frozen S3 during training or collection is waited out without spending an
attempt.

Both runs must complete with every artifact byte-identical to the undisturbed reference run.
(At this stack's 3 s heartbeat timeout the SDK's default throttle is 2.4 s, so the kill case
holds with it too; tests/integration/test_heartbeat_throttle.py shows the throttle itself at
the default 30 s timeout, where the SDK default would hold a checkpoint's heartbeat 24 s.)
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.chaos.conftest import TRAINING_CONFIG, train_request
from tests.support.chaos.assertions import record
from tests.support.chaos.faults import TRAIN_STEP_DELAY
from tests.support.chaos.runs import RunOutcome, connect, result_within, start_run
from tests.support.chaos.stack import ChaosStack
from workers.factory import HEARTBEAT_THROTTLE

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

INTERVAL = TRAINING_CONFIG["checkpoint_interval"]  # 2
STEP_DELAY_S = 3.0  # each step's heartbeat holds the training thread this long
OUTAGE_S = 12.0  # longer than TRAIN_RETRY's three attempts used to last (about 7.5 s)


def _wait_event(stack: ChaosStack, event: str, timeout_s: float, **match: object) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = stack.hooks.events(event, **match)
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no {event} {match} within {timeout_s}s")


@pytest.mark.timeout(420)
async def test_a_kill_soon_after_a_checkpoint_redoes_at_most_one_interval(
    stack: ChaosStack, reference_train: RunOutcome
) -> None:
    hooks = stack.hooks
    hooks.set(TRAIN_STEP_DELAY, STEP_DELAY_S)
    client = await connect(stack)
    started = time.monotonic()
    handle = await start_run(client, stack, train_request(stack.env_url))
    # The step-2 checkpoint is uploaded and heartbeated; the worker is then inside step 3's
    # heartbeat delay. Kill it 2 s later: more than the 1 s throttle after the checkpoint's
    # heartbeat (the SDK default would have held it 2.4 s at this stack's 3 s heartbeat timeout),
    # and 1 s before step 4 can start.
    _wait_event(stack, "train_checkpoint", 150, run_id=handle.id, attempt=1, step=INTERVAL)
    time.sleep(HEARTBEAT_THROTTLE.total_seconds() + 1.0)
    pid = stack.kill_worker("gpu")
    hooks.clear(TRAIN_STEP_DELAY)
    steps = hooks.events("train_step", run_id=handle.id)
    done_before_kill = max(e["step"] for e in steps if e["pid"] == pid)
    total_steps = steps[0]["total_steps"]
    assert done_before_kill == INTERVAL + 1 < total_steps
    stack.start_worker("gpu")
    state, final = await result_within(handle, 240)
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, time.monotonic() - started)
    reference_train.assert_same_artifacts(outcome, stack)
    receipt = outcome.receipt(stack)
    executed = len(hooks.events("train_step", run_id=handle.id))
    redone = executed - total_steps
    assert receipt["resumed_from_step"] == INTERVAL, receipt["resumed_from_step"]
    assert receipt["checkpoint"]["used"] is True and receipt["checkpoint"]["step"] == INTERVAL
    assert redone == done_before_kill - INTERVAL <= INTERVAL
    record("kill -9 one step after a checkpoint (interval 2)", total_steps=total_steps,
           steps_done_before_kill=done_before_kill, resumed_from_step=receipt["resumed_from_step"],
           steps_redone=redone, run_s=outcome.seconds, artifacts_identical=True)


@pytest.mark.timeout(420)
async def test_a_frozen_s3_during_training_is_waited_out_in_the_same_attempt(
    stack: ChaosStack, reference_train: RunOutcome
) -> None:
    hooks = stack.hooks
    hooks.set(TRAIN_STEP_DELAY, 1.0)
    client = await connect(stack)
    started = time.monotonic()
    handle = await start_run(client, stack, train_request(stack.env_url))
    _wait_event(stack, "train_step", 150, run_id=handle.id, attempt=1, step=1)
    os.killpg(stack.s3.pid, signal.SIGSTOP)  # the step-2 checkpoint upload meets a frozen store
    frozen_at = time.time()
    try:
        time.sleep(OUTAGE_S)
    finally:
        os.killpg(stack.s3.pid, signal.SIGCONT)
    hooks.clear(TRAIN_STEP_DELAY)
    state, final = await result_within(handle, 240)
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, time.monotonic() - started)
    reference_train.assert_same_artifacts(outcome, stack)
    # One attempt did it all: no retry of train_adapter (or of anything else), no step redone.
    assert final["interruptions"] == [], final["interruptions"]
    starts = hooks.events("train_start", run_id=handle.id)
    assert [e["attempt"] for e in starts] == [1], starts
    total_steps = hooks.events("train_step", run_id=handle.id)[0]["total_steps"]
    assert len(hooks.events("train_step", run_id=handle.id)) == total_steps
    checkpoint = hooks.events("train_checkpoint", run_id=handle.id, step=INTERVAL)[0]
    record("S3 frozen 12 s during training", outage_s=OUTAGE_S,
           freeze_to_checkpoint_stored_s=checkpoint["t"] - frozen_at,
           training_attempts=1, run_s=outcome.seconds, artifacts_identical=True)


@pytest.mark.timeout(480)
async def test_s3_frozen_for_a_minute_during_collection_is_waited_out(
    stack: ChaosStack, reference_train: RunOutcome
) -> None:
    """60 s of a frozen S3 while seed groups are in flight: no group is re-collected, nothing is
    retried, the artifacts equal the undisturbed run's."""
    hooks = stack.hooks
    client = await connect(stack)
    started = time.monotonic()
    handle = await start_run(client, stack, train_request(stack.env_url))
    _wait_event(stack, "collect_start", 150, run_id=handle.id)
    os.killpg(stack.s3.pid, signal.SIGSTOP)
    frozen_at = time.time()
    try:
        time.sleep(60.0)
    finally:
        os.killpg(stack.s3.pid, signal.SIGCONT)
    thawed_at = time.time()
    state, final = await result_within(handle, 300)
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, time.monotonic() - started)
    reference_train.assert_same_artifacts(outcome, stack)
    assert final["interruptions"] == [], final["interruptions"]
    attempts = {(e["group_index"], e["attempt"]) for e in hooks.events("collect_start", run_id=handle.id)}
    assert {attempt for _, attempt in attempts} == {1}, sorted(attempts)
    ends = hooks.events("collect_end", run_id=handle.id, outcome="ok")
    record("S3 frozen 60 s during collection", outage_s=round(thawed_at - frozen_at, 1),
           groups_recollected=0, last_group_done_after_thaw_s=round(max(e["t"] for e in ends) - thawed_at, 1),
           run_s=outcome.seconds, artifacts_identical=True)
