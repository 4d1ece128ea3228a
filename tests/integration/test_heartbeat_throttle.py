"""A gpu worker's heartbeat reaches the Temporal server within its 1 s throttle, not 0.8 x the
heartbeat timeout (the SDK default: 24 s at Kiln's default 30 s), so a training checkpoint named
in a heartbeat is on the server before a kill can lose it.

Real Temporal dev server; the gpu worker is the one ``build_workers`` makes (its throttle), with
an activity that heartbeats twice at once, as training does for a step and then its checkpoint.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from kiln.core.settings import Settings
from tests.support.waiting import workflow_result
from workers.factory import HEARTBEAT_THROTTLE, build_workers

RELEASE = threading.Event()


class TwoBeats:
    """The gpu role's activities for this test: one that heartbeats a step, then a checkpoint."""

    def __init__(self, *_: object) -> None:
        pass

    def all(self) -> list:
        return [beat_step_then_checkpoint]


@activity.defn
def beat_step_then_checkpoint() -> str:
    activity.heartbeat({"step": 1})
    activity.heartbeat({"step": 1, "checkpoint_step": 1})  # within the throttle of the first
    deadline = time.monotonic() + 60
    while not RELEASE.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    return "done"


@workflow.defn(sandboxed=False)
class CheckpointBeat:
    @workflow.run
    async def run(self, queue: str) -> str:
        return await workflow.execute_activity(
            beat_step_then_checkpoint, task_queue=queue, start_to_close_timeout=timedelta(minutes=2),
            heartbeat_timeout=timedelta(seconds=30))


async def _details(client: Client, handle) -> dict | None:  # noqa: ANN001
    description = await handle.describe()
    pending = description.raw_description.pending_activities
    if not pending or not pending[0].heartbeat_details.payloads:
        return None
    (value,) = await client.data_converter.decode(pending[0].heartbeat_details.payloads)
    return value


@pytest.mark.timeout(90)
async def test_a_checkpoint_heartbeat_reaches_the_server_within_the_throttle(temporal_server: str, tmp_path: Path) -> None:
    assert HEARTBEAT_THROTTLE == timedelta(seconds=1)
    client = await Client.connect(temporal_server)
    suffix = uuid.uuid4().hex[:8]
    settings = Settings(home=tmp_path, temporal_address=temporal_server, gpu_task_queue=f"throttle-gpu-{suffix}",
                        control_task_queue=f"throttle-control-{suffix}", model_path=tmp_path / "no-model",
                        s3_endpoint="http://127.0.0.1:9", s3_access_key="ak", s3_secret_key="sk-test-only")
    (gpu,) = build_workers(client, settings, ["gpu"], gpu_factory=TwoBeats)
    flows = Worker(client, task_queue=settings.control_task_queue, workflows=[CheckpointBeat],
                   workflow_runner=UnsandboxedWorkflowRunner())
    RELEASE.clear()
    async with gpu, flows:
        handle = await client.start_workflow(CheckpointBeat.run, settings.gpu_task_queue,
                                             id=f"throttle-{suffix}", task_queue=settings.control_task_queue)
        first_seen = None
        while True:
            details = await _details(client, handle)
            if details is not None and first_seen is None:
                first_seen = time.monotonic()
            if details is not None and "checkpoint_step" in details:
                break
            assert first_seen is None or time.monotonic() - first_seen < 10, details
            await asyncio.sleep(0.1)
        waited = time.monotonic() - first_seen
        RELEASE.set()
        assert await workflow_result(handle, 30) == "done"
    # The SDK's default would hold the second heartbeat 24 s (0.8 x 30 s); the throttle, 1 s.
    assert waited < 6, waited
    print(f"second heartbeat on the server {waited:.2f}s after the first")
