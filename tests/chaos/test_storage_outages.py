"""Chaos: S3 (the real SeaweedFS) is down for 60 s, once in each of collection, training,
evaluation and publication, and the run completes with every artifact identical to one undisturbed
run of the same request (hf engine, a paired environment evaluation).

The store is stopped by PID (SIGTERM) while the stage's activity is in progress, then started
again after ``S3_DOWN_S`` on the same port and data dir. Collection, evaluation and publication
are caught at the start of their activity (``park_activity`` holds it, heartbeating, until S3 is
down); training is caught between steps (each step slowed until S3 is down), so its step-2
checkpoint write meets the outage. A worker's store calls wait the outage out
(``kiln/core/artifacts/outage.py``, up to ``OUTAGE_WAIT_S``) while the activity heartbeats: no
attempt is spent, so no activity of the run is retried.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from kiln.core.artifacts.outage import OUTAGE_WAIT_S
from tests.chaos.conftest import train_request
from tests.support.chaos.assertions import read_uri, record
from tests.support.chaos.faults import PARK_ACTIVITY, TRAIN_STEP_DELAY
from tests.support.chaos.runs import RunOutcome, connect, drive, result_within, start_run, wait_until_async
from tests.support.chaos.stack import ChaosStack

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

S3_DOWN_S = 60.0
EVAL_RECEIPT = "environment_eval/receipt.json"
# Stage → the activity whose first attempt is held until S3 is down (training: slowed steps instead).
PARKED = {"collection": "collect_group", "evaluation": "evaluate_run", "publication": "publish_run"}
STEP_DELAY_S = 2.0


def outage_request(env_url: str) -> dict[str, Any]:
    return train_request(env_url, output_adapter="outage-agent", environment_eval={"groups": 2, "group_size": 1})


@pytest.fixture(scope="module")
def undisturbed(chaos_stack: ChaosStack) -> RunOutcome:
    """The one reference every outage case is compared with."""

    async def run() -> RunOutcome:
        return await drive(await connect(chaos_stack), chaos_stack, outage_request(chaos_stack.env_url), timeout_s=300)

    outcome = asyncio.run(run())
    assert outcome.status["training"]["trained"] is True and outcome.status["interruptions"] == []
    return outcome


def _eval_receipt(stack: ChaosStack, outcome: RunOutcome) -> dict[str, Any]:
    """The evaluation receipt less its run id (the one field that names the run)."""
    uri = next(a["uri"] for a in outcome.status["artifacts"] if a["name"] == EVAL_RECEIPT)
    receipt = json.loads(read_uri(stack.store(), uri))
    assert receipt.pop("run_id") == outcome.run_id
    return receipt


async def _reach(stack: ChaosStack, stage: str, run_id: str) -> None:
    """Wait until the run is inside ``stage``'s activity, held where the outage must land."""
    hooks = stack.hooks
    if stage == "training":
        await wait_until_async(lambda: hooks.events("train_step", run_id=run_id, step=1), timeout_s=240,
                               what="training step 1")
        return
    kind = PARKED[stage]
    await wait_until_async(lambda: hooks.events("activity_parked", run_id=run_id, type=kind), timeout_s=240,
                           what=f"{kind} to start (parked)")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", ["collection", "training", "evaluation", "publication"])
async def test_a_60s_s3_outage_is_waited_out(stack: ChaosStack, undisturbed: RunOutcome, stage: str) -> None:
    assert S3_DOWN_S < OUTAGE_WAIT_S
    hooks = stack.hooks
    if stage == "training":
        hooks.set(TRAIN_STEP_DELAY, STEP_DELAY_S)
    else:
        hooks.set(PARK_ACTIVITY, PARKED[stage])
    client = await connect(stack)
    started = time.monotonic()
    handle = await start_run(client, stack, outage_request(stack.env_url))
    await _reach(stack, stage, handle.id)
    stop_began = time.monotonic()
    stack.stop_s3()
    hooks.clear(TRAIN_STEP_DELAY)
    hooks.clear(PARK_ACTIVITY)  # the held activity now meets the stopped store
    await asyncio.sleep(S3_DOWN_S)
    restart_began = time.monotonic()
    await asyncio.to_thread(stack.start_s3)
    back_at = time.monotonic()
    state, final = await result_within(handle, 300)
    done_at = time.monotonic()
    assert state == "completed", final
    outcome = RunOutcome.of(stack, handle.id, final, done_at - started)
    starts = hooks.events("activity_start", run_id=handle.id)
    record(
        f"S3 (SeaweedFS) down {S3_DOWN_S:.0f} s during {stage}",
        s3_down_s=back_at - stop_began,
        restart_to_serving_s=back_at - restart_began,
        s3_back_to_run_completed_s=done_at - back_at,
        run_s=outcome.seconds,
        reference_run_s=undisturbed.seconds,
        retried_activities=sorted({s["type"] for s in starts if s["attempt"] > 1}),
        artifacts_identical=True,
    )
    # The outage was waited out inside the attempts: no activity of the run was retried.
    assert final["interruptions"] == [] and final["interruptions_total"] == 0, final["interruptions"]
    assert [s for s in starts if s["attempt"] > 1] == []
    assert outcome.seconds >= S3_DOWN_S  # the run did meet the outage
    assert _eval_receipt(stack, outcome) == _eval_receipt(stack, undisturbed)
    for side in (outcome, undisturbed):
        side.digests.pop(EVAL_RECEIPT, None)
    undisturbed.assert_same_artifacts(outcome, stack)
