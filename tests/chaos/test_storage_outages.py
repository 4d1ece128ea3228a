"""Chaos: S3 (the real SeaweedFS) is down for 60 s while four runs of one request stand in
collection, training, evaluation and publication, and each completes with every artifact identical
to one undisturbed run of the same request (hf engine, a paired environment evaluation).

Each run is held where its stage's outage must land (per-run holds, ``tests/support/chaos/faults.py``):
collection, evaluation and publication at the start of their activity (``collect_group``,
``evaluate_run``, ``publish_run``), training after its first step, so that its step-2 checkpoint
write meets the outage. Once the undisturbed run has completed and all four stand in place, the
store is stopped by PID (SIGTERM), the holds are released, and the store is started again after
``S3_DOWN_S`` on the same port and data dir: one outage, met by each stage. A worker's store calls
wait the outage out (``kiln/core/artifacts/outage.py``, up to ``OUTAGE_WAIT_S``) while the activity
heartbeats: no attempt is spent, so no activity of any run is retried.

The stack is this module's own (a run queue of 5, 8 gpu activity slots, 24 environment sessions, and
trainings that do not share the sampler's base model), so the four runs and the reference run side by
side, and no run waits for a slot, a session or another run's training.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from kiln.core.artifacts.outage import OUTAGE_WAIT_S
from tests.chaos.conftest import train_request
from tests.support.chaos.assertions import read_uri, record
from tests.support.chaos.faults import TRAIN_STEP_HOLD
from tests.support.chaos.runs import RunOutcome, connect, result_within, start_run, wait_until_async
from tests.support.chaos.stack import ChaosStack
from tests.support.stack import assert_nothing_listening

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.heavy]

S3_DOWN_S = 60.0
EVAL_RECEIPT = "environment_eval/receipt.json"
# Stage → what holds its run where the outage must land: an activity held at its start, or training
# held after its first step.
HOLD = {"collection": "collect_group", "training": TRAIN_STEP_HOLD, "evaluation": "evaluate_run",
        "publication": "publish_run"}


# 8 gpu activities at once; each training loads its own copy of the model, so a training held at
# its first step never holds the shared base model that sampling and the other trainings wait for.
OUTAGE_WORKERS = {"KILN_GPU_MAX_CONCURRENT_ACTIVITIES": "8", "KILN_SHARE_BASE_MODEL": "false"}


def outage_request(env_url: str) -> dict[str, Any]:
    return train_request(env_url, output_adapter="outage-agent", environment_eval={"groups": 2, "group_size": 1})


@pytest.fixture(scope="module")
def outage_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    stack = ChaosStack(root=tmp_path_factory.mktemp("outages"), model_path=tiny_model_dir, max_active_runs=5,
                       env_max_sessions=24, heartbeat_timeout_s=10.0, worker_settings=OUTAGE_WORKERS)
    try:
        stack.start()
        yield stack
    finally:
        for proc in stack.close():
            assert_nothing_listening(proc)


def _eval_receipt(stack: ChaosStack, outcome: RunOutcome) -> dict[str, Any]:
    """The evaluation receipt less its run id (the one field that names the run)."""
    uri = next(a["uri"] for a in outcome.status["artifacts"] if a["name"] == EVAL_RECEIPT)
    receipt = json.loads(read_uri(stack.store(), uri))
    assert receipt.pop("run_id") == outcome.run_id
    return receipt


def _in_place(stack: ChaosStack, stage: str, run_id: str) -> bool:
    """Whether ``run_id`` is held where its stage's outage must land."""
    if stage == "training":
        return bool(stack.hooks.events("train_held", run_id=run_id))
    return bool(stack.hooks.events("activity_parked", run_id=run_id, type=HOLD[stage]))


@pytest.mark.timeout(900)
async def test_a_60s_s3_outage_is_waited_out_in_every_stage(outage_stack: ChaosStack) -> None:
    assert S3_DOWN_S < OUTAGE_WAIT_S
    stack, hooks = outage_stack, outage_stack.hooks
    runs = {stage: f"outage-{stage}-{uuid.uuid4().hex[:8]}" for stage in HOLD}
    hooks.hold([(HOLD[stage], run_id) for stage, run_id in runs.items()])
    client = await connect(stack)
    request = outage_request(stack.env_url)
    started = time.monotonic()
    reference = await start_run(client, stack, request)
    handles = {stage: await start_run(client, stack, request, run_id) for stage, run_id in runs.items()}

    state, value = await result_within(reference, 400)
    assert state == "completed", f"the undisturbed run ended {state}: {value}"
    undisturbed = RunOutcome.of(stack, reference.id, value, time.monotonic() - started)
    assert undisturbed.status["training"]["trained"] is True, undisturbed.status["training"]
    assert undisturbed.status["interruptions"] == [], undisturbed.status["interruptions"]
    reference_eval = _eval_receipt(stack, undisturbed)
    undisturbed.digests.pop(EVAL_RECEIPT, None)  # it names its run; compared less its run id below
    await wait_until_async(lambda: all(_in_place(stack, stage, run_id) for stage, run_id in runs.items()),
                           timeout_s=400, what="each stage's run held in place")

    stop_began = time.monotonic()
    stack.stop_s3()
    stopped_at = time.time()
    hooks.hold([])  # each held run now meets the stopped store
    await asyncio.sleep(S3_DOWN_S)
    restart_began = time.monotonic()
    await asyncio.to_thread(stack.start_s3)
    back_at = time.monotonic()
    finals = dict(zip(runs, await asyncio.gather(*(result_within(h, 400) for h in handles.values()))))
    done_at = time.monotonic()

    # every hold was let go after the store had stopped, so each stage did meet the outage
    released = {e["run_id"]: e["t"] for e in hooks.events() if e.get("event") in ("activity_released", "train_released")}
    assert sorted(released) == sorted(runs.values()) and min(released.values()) >= stopped_at, released
    for stage, run_id in runs.items():
        state, final = finals[stage]
        assert state == "completed", (stage, final)
        outcome = RunOutcome.of(stack, run_id, final, done_at - started)
        starts = hooks.events("activity_start", run_id=run_id)
        record(
            f"S3 (SeaweedFS) down {S3_DOWN_S:.0f} s during {stage}",
            s3_down_s=back_at - stop_began,
            restart_to_serving_s=back_at - restart_began,
            s3_back_to_runs_completed_s=done_at - back_at,
            reference_run_s=undisturbed.seconds,
            retried_activities=sorted({s["type"] for s in starts if s["attempt"] > 1}),
            artifacts_identical=True,
        )
        # The outage was waited out inside the attempts: no activity of the run was retried.
        assert final["interruptions"] == [] and final["interruptions_total"] == 0, (stage, final["interruptions"])
        assert [s for s in starts if s["attempt"] > 1] == [], stage
        assert _eval_receipt(stack, outcome) == reference_eval, stage
        outcome.digests.pop(EVAL_RECEIPT, None)
        undisturbed.assert_same_artifacts(outcome, stack)
