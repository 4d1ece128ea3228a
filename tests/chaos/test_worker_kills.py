"""Chaos: the gpu worker process is SIGKILLed mid-group and mid-training, then a new one starts.

Nothing may be lost: the run completes, the interrupted work is redone (whole groups from reset
with the same seeds; training from the last heartbeated checkpoint), and every artifact is
byte-identical to the undisturbed reference run of the same request.
"""

from __future__ import annotations

import time

import pytest

from tests.chaos.conftest import train_request
from tests.support.chaos.assertions import expect_fixed, record
from tests.support.chaos.faults import (
    POLICY_LOAD_DELAY,
    SAMPLE_DELAY,
    TRAIN_FAIL_NOW,
    TRAIN_FAIL_RESUMED,
    TRAIN_LOAD_DELAY,
    TRAIN_SETUP_DELAY,
    TRAIN_STEP_DELAY,
)
from tests.support.chaos.runs import (
    RunOutcome,
    connect,
    last_details,
    result_within,
    start_run,
    wait_activity,
)
from tests.support.chaos.stack import ChaosStack

pytestmark = pytest.mark.asyncio


async def test_gpu_worker_killed_mid_group(stack: ChaosStack, reference_train: RunOutcome) -> None:
    hooks = stack.hooks
    hooks.set(SAMPLE_DELAY, 0.4)  # a group stays in flight > 1 s, so the kill lands mid-episode
    client = await connect(stack)
    started = time.monotonic()
    handle = await start_run(client, stack, train_request(stack.env_url))

    act = await wait_activity(
        client, handle,
        lambda a: a["type"] == "collect_group" and a["state"] == "STARTED" and a["attempt"] == 1
        and bool(last_details(a).get("step")),
        timeout_s=90, what="a collect_group mid-episode",
    )
    seen = last_details(act)
    killed_at = time.time()
    pid = stack.kill_worker("gpu")
    hooks.clear(SAMPLE_DELAY)
    starts = hooks.events("collect_start", run_id=handle.id, pid=pid)
    ends = {(e["group_index"], e["attempt"]) for e in hooks.events("collect_end", run_id=handle.id, pid=pid)}
    in_flight = {e["group_index"] for e in starts if (e["group_index"], e["attempt"]) not in ends}
    assert seen["group_index"] in in_flight

    restart_began = time.monotonic()
    stack.start_worker("gpu")
    worker_start_s = time.monotonic() - restart_began
    state, final = await result_within(handle, 180)
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, time.monotonic() - started)

    interruptions = final["interruptions"]
    interrupted = {item["group_index"] for item in interruptions}
    assert in_flight <= interrupted, (in_flight, interruptions)
    for item in interruptions:
        assert item["code"] == "executor_interrupted" and item["attempts"] >= 2, item
        assert item["stage"] == "group"
    # Every interrupted group was collected again, from reset, by the new worker.
    redone = hooks.events("collect_end", run_id=handle.id, outcome="ok")
    redone = [e for e in redone if e["pid"] != pid]
    assert interrupted <= {e["group_index"] for e in redone}
    assert final["progress"]["groups_completed"] == 4 and final["progress"]["rollouts_completed"] == 8
    reference_train.assert_same_artifacts(outcome, stack)
    recovered = max(e["t"] for e in redone if e["group_index"] in interrupted) - killed_at
    record(
        "1 gpu worker SIGKILL mid-group",
        groups_in_flight_at_kill=sorted(in_flight),
        groups_recollected=len(interrupted),
        attempts=[item["attempts"] for item in interruptions],
        new_worker_start_s=worker_start_s,
        kill_to_groups_recollected_s=recovered,
        run_s=outcome.seconds,
        reference_run_s=reference_train.seconds,
        artifacts_identical=True,
    )


async def test_gpu_worker_killed_mid_training(stack: ChaosStack, reference_train: RunOutcome) -> None:
    hooks = stack.hooks
    hooks.set(TRAIN_STEP_DELAY, 0.7)  # 6 steps of >= 0.7 s: room to observe a checkpoint heartbeat
    client = await connect(stack)
    started = time.monotonic()
    handle = await start_run(client, stack, train_request(stack.env_url))
    act = await wait_activity(
        client, handle,
        lambda a: a["type"] == "train_adapter" and a["attempt"] == 1 and bool(last_details(a).get("checkpoint")),
        timeout_s=120, what="a heartbeated training checkpoint",
    )
    seen = last_details(act)
    killed_at = time.time()
    pid = stack.kill_worker("gpu")
    hooks.clear(TRAIN_STEP_DELAY)
    steps = hooks.events("train_step", run_id=handle.id)
    total_steps = steps[0]["total_steps"]
    done_before_kill = max(e["step"] for e in steps if e["pid"] == pid)
    assert done_before_kill < total_steps, "training finished before the kill; nothing was interrupted"

    stack.start_worker("gpu")
    state, final = await result_within(handle, 180)
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, time.monotonic() - started)

    # Nothing lost: the adapter (and every other artifact) equals the uninterrupted run's.
    reference_train.assert_same_artifacts(outcome, stack)
    assert final["training"]["adapter_sha256"] == reference_train.status["training"]["adapter_sha256"]
    assert final["training"]["steps"] == total_steps
    # What was re-done: every step run by a later attempt. An attempt that resumed started right
    # after a checkpoint the killed attempt had written (never before, never a skipped step).
    starts = [e for e in hooks.events("train_start", run_id=handle.id) if e["pid"] != pid]
    later = [e for e in hooks.events("train_step", run_id=handle.id) if e["pid"] != pid]
    by_attempt: dict[int, list[int]] = {}
    for e in later:
        by_attempt.setdefault(e["attempt"], []).append(e["step"])
    final_attempt = max(by_attempt)
    assert by_attempt[final_attempt][-1] == total_steps
    resumed_from = outcome.receipt(stack)["resumed_from_step"]
    if resumed_from is not None:
        assert seen["checkpoint_step"] <= resumed_from <= done_before_kill and resumed_from % 2 == 0
        assert by_attempt[final_attempt] == list(range(resumed_from + 1, total_steps + 1))
    else:
        assert by_attempt[final_attempt] == list(range(1, total_steps + 1))
    # The retry is in status: one interruption of train_adapter, naming the attempt that completed.
    retried = [i for i in final["interruptions"] if i["activity"] == "train_adapter"]
    assert len(retried) == 1 and retried[0]["attempts"] == final_attempt >= 2, final["interruptions"]
    assert retried[0]["stage"] == "training" and retried[0]["group_index"] is None
    assert final["interruptions_total"] == len(final["interruptions"])
    end = hooks.events("train_end", run_id=handle.id, outcome="ok")[-1]
    executed = len(hooks.events("train_step", run_id=handle.id))
    record(
        "2 gpu worker SIGKILL mid-training",
        total_steps=total_steps,
        steps_done_before_kill=done_before_kill,
        checkpoint_seen_in_heartbeat=seen["checkpoint_step"],
        later_attempts=[{"attempt": e["attempt"], "resumed": e["resumed"]} for e in starts],
        final_attempt_resumed_from_step=resumed_from,
        steps_repeated=executed - total_steps,
        kill_to_training_done_s=end["t"] - killed_at,
        run_s=outcome.seconds,
        adapter_identical=True,
    )


async def test_training_resumes_after_a_resumed_attempt_fails(
    stack: ChaosStack, reference_train: RunOutcome
) -> None:
    """Attempt 1 fails after heartbeating a checkpoint, attempt 2 (resumed) fails at once:
    attempt 3 must still resume from that checkpoint, not from step 0."""
    hooks = stack.hooks
    hooks.set(TRAIN_STEP_DELAY, 0.7)
    client = await connect(stack)
    handle = await start_run(client, stack, train_request(stack.env_url))
    act = await wait_activity(
        client, handle,
        lambda a: a["type"] == "train_adapter" and a["attempt"] == 1 and bool(last_details(a).get("checkpoint")),
        timeout_s=120, what="a heartbeated training checkpoint",
    )
    seen = last_details(act)
    hooks.set(TRAIN_FAIL_RESUMED)
    hooks.set(TRAIN_FAIL_NOW)
    state, final = await result_within(handle, 120)
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, 0.0)
    reference_train.assert_same_artifacts(outcome, stack)
    starts = hooks.events("train_start", run_id=handle.id)
    record(
        "2b resumed training attempt fails before its first checkpoint",
        attempts=[{"attempt": e["attempt"], "resumed": e["resumed"]} for e in starts],
        checkpoint_seen_in_heartbeat=seen["checkpoint_step"],
        final_resumed_from_step=outcome.receipt(stack)["resumed_from_step"],
        steps_executed=len(hooks.events("train_step", run_id=handle.id)),
    )
    assert [e["resumed"] for e in starts][:2] == [False, True], starts
    training_retries = [i for i in final["interruptions"] if i["activity"] == "train_adapter"]
    assert [i["attempts"] for i in training_retries] == [len(starts)], final["interruptions"]
    expect_fixed(
        [e["resumed"] for e in starts] == [False, True, True]
        and (outcome.receipt(stack)["resumed_from_step"] or 0) >= seen["checkpoint_step"],
        f"the third training attempt did not resume from the checkpoint: {starts}",
    )


async def test_slow_training_setup_is_not_timed_out(stack: ChaosStack) -> None:
    """A training setup slower than the heartbeat timeout must not cost an attempt."""
    hooks = stack.hooks
    hooks.set(TRAIN_SETUP_DELAY, stack.heartbeat_timeout_s + 1.5)
    client = await connect(stack)
    handle = await start_run(client, stack, train_request(stack.env_url))
    state, final = await result_within(handle, 120)
    starts = hooks.events("train_start", run_id=handle.id)
    record("2c training setup slower than the heartbeat timeout", state=state,
           training_attempts=len(starts))
    assert state == "completed", final
    expect_fixed(len(starts) == 1, f"training needed {len(starts)} attempts (setup was timed out)")


async def test_slow_policy_load_is_not_timed_out(stack: ChaosStack) -> None:
    """A collection attempt whose model load is slower than the heartbeat timeout (a freshly
    started worker's first group) must not cost an attempt: no group is re-collected."""
    from tests.chaos.conftest import rollout_request

    hooks = stack.hooks
    hooks.set(POLICY_LOAD_DELAY, stack.heartbeat_timeout_s + 1.5)
    client = await connect(stack)
    handle = await start_run(client, stack, rollout_request(stack.env_url))
    state, final = await result_within(handle, 120)
    assert state == "completed", final
    assert not hooks.present(POLICY_LOAD_DELAY)  # the slow load happened (the one-shot fired)
    attempts = sorted((e["group_index"], e["attempt"]) for e in hooks.events("collect_start", run_id=handle.id))
    record("2d policy load slower than the heartbeat timeout", collect_attempts=attempts,
           interruptions=len(final["interruptions"]))
    assert attempts == [(0, 1), (1, 1)], attempts
    assert final["interruptions"] == []


async def test_slow_model_load_for_training_is_not_timed_out(stack: ChaosStack) -> None:
    """A training attempt whose model load is slower than the heartbeat timeout (a worker started
    after a kill) must not cost one of training's three attempts."""
    hooks = stack.hooks
    hooks.set(TRAIN_LOAD_DELAY, stack.heartbeat_timeout_s + 1.5)
    client = await connect(stack)
    handle = await start_run(client, stack, train_request(stack.env_url))
    state, final = await result_within(handle, 120)
    assert state == "completed", final
    assert not hooks.present(TRAIN_LOAD_DELAY)  # the slow load happened (the one-shot fired)
    starts = hooks.events("train_start", run_id=handle.id)
    record("2e model load for training slower than the heartbeat timeout", training_attempts=len(starts))
    assert [e["attempt"] for e in starts] == [1], starts


async def test_on_interrupt_fail_ends_the_run_run_interrupted(stack: ChaosStack) -> None:
    """`on_interrupt: "fail"` restores the reference behaviour: a killed worker fails the run."""
    from tests.chaos.conftest import rollout_request
    from tests.support.chaos.assertions import manifest_absent

    hooks = stack.hooks
    hooks.set(SAMPLE_DELAY, 0.4)
    client = await connect(stack)
    handle = await start_run(client, stack, rollout_request(stack.env_url, on_interrupt="fail"))
    await wait_activity(
        client, handle,
        lambda a: a["type"] == "collect_group" and a["state"] == "STARTED" and a["attempt"] == 1
        and bool(last_details(a).get("step")),
        timeout_s=90, what="a collect_group mid-episode",
    )
    killed = time.monotonic()
    stack.kill_worker("gpu")
    hooks.clear(SAMPLE_DELAY)
    stack.start_worker("gpu")
    state, final = await result_within(handle, 120)
    seconds = time.monotonic() - killed
    assert state == "failed"
    status = await handle.query("status")
    assert status["failure"]["code"] == "run_interrupted"
    assert status["failure"]["stage"] == "collection"
    assert status["failure"]["retryable"] is False
    assert manifest_absent(stack.store(), handle.id)
    record("1b on_interrupt=fail, gpu worker SIGKILL mid-group", kill_to_failed_s=round(seconds, 2))
