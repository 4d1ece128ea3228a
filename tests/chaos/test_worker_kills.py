"""Chaos: the gpu worker process is SIGKILLed mid-group and mid-training, then a new one starts.

Nothing may be lost: the run completes, the interrupted work is redone (whole groups from reset
with the same seeds; training from the last heartbeated checkpoint), and every artifact is
byte-identical to the undisturbed reference run of the same request.
"""

from __future__ import annotations

import time
import pytest

from tests.chaos.conftest import train_request
from tests.support.chaos import (
    SAMPLE_DELAY,
    TRAIN_STEP_DELAY,
    ChaosStack,
    RunOutcome,
    connect,
    last_details,
    record,
    result_within,
    start_run,
    wait_activity,
)

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
    hooks.set(TRAIN_STEP_DELAY, 0.5)  # 8 steps of >= 0.5 s: room to observe a checkpoint heartbeat
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
    done_before_kill = max(e["step"] for e in hooks.events("train_step", run_id=handle.id, pid=pid))
    total_steps = seen.get("total_steps") or hooks.events("train_step", run_id=handle.id)[0]["total_steps"]
    assert done_before_kill < total_steps, "training finished before the kill; nothing was interrupted"

    stack.start_worker("gpu")
    state, final = await result_within(handle, 180)
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, time.monotonic() - started)

    # The adapter (and every other artifact) equals the uninterrupted run's.
    reference_train.assert_same_artifacts(outcome, stack)
    assert final["training"]["adapter_sha256"] == reference_train.status["training"]["adapter_sha256"]
    resumed_from = outcome.receipt(stack)["resumed_from_step"]
    assert resumed_from is not None and resumed_from >= seen["checkpoint_step"]
    assert resumed_from % 2 == 0 and resumed_from <= done_before_kill
    retried = [e for e in hooks.events("train_step", run_id=handle.id) if e["pid"] != pid]
    assert [e["step"] for e in retried] == list(range(resumed_from + 1, total_steps + 1))
    starts = [e for e in hooks.events("train_start", run_id=handle.id) if e["pid"] != pid]
    assert starts and starts[-1]["resumed"] is True
    end = hooks.events("train_end", run_id=handle.id, outcome="ok")[-1]
    record(
        "2 gpu worker SIGKILL mid-training",
        total_steps=total_steps,
        steps_done_before_kill=done_before_kill,
        checkpoint_seen_in_heartbeat=seen["checkpoint_step"],
        resumed_from_step=resumed_from,
        steps_repeated=done_before_kill - resumed_from,
        kill_to_training_done_s=end["t"] - killed_at,
        run_s=outcome.seconds,
        adapter_identical=True,
    )
