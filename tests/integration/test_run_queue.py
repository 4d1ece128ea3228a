"""The FIFO run queue: slots, queue positions, and rejection beyond max_tracked_runs."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from tests.integration.test_api_helpers import TINY_ROLLOUT, BlackHole
from tests.support.kiln_workers import running_workers
from tests.support.waiting import workflow_result
from workflows.options import WORKFLOW_NAME

pytestmark = pytest.mark.asyncio


async def _wait_phase(handle: Any, phase: str, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status = await handle.query("status")
        if status["phase"] == phase:
            return status
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"run never reached {phase}: {status['phase']}")
        await asyncio.sleep(0.2)


async def test_queue_positions_and_capacity_full(kiln_settings: Any) -> None:
    settings = kiln_settings(max_active_runs=1, max_tracked_runs=2)
    hole = BlackHole()  # its /health never answers: the first run holds the only slot
    request = {**TINY_ROLLOUT, "environment_urls": [hole.url]}
    try:
        async with running_workers(settings, roles=("control",)) as client:
            first = await client.start_workflow(
                WORKFLOW_NAME, request, id=str(uuid.uuid4()), task_queue=settings.control_task_queue
            )
            first_status = await _wait_phase(first, "discovery")
            assert first_status["admission"]["sequence"] >= 1
            second = await client.start_workflow(
                WORKFLOW_NAME, request, id=str(uuid.uuid4()), task_queue=settings.control_task_queue
            )
            queued = await _wait_phase(second, "queue")
            for _ in range(50):
                queued = await second.query("status")
                if (queued.get("admission") or {}).get("queue_position") == 1:
                    break
                await asyncio.sleep(0.1)
            assert queued["admission"]["queue_position"] == 1
            assert queued["admission"]["sequence"] == first_status["admission"]["sequence"] + 1

            third = await client.start_workflow(
                WORKFLOW_NAME, request, id=str(uuid.uuid4()), task_queue=settings.control_task_queue
            )
            with pytest.raises(WorkflowFailureError) as failure:
                await workflow_result(third)
            assert failure.value.cause.type == "openenv_run_capacity_full"
            status = await third.query("status")
            assert status["failure"]["stage"] == "admission"

            # Cancel the queued run: it ends cancelled at admission, the first keeps its slot.
            await second.cancel()
            with pytest.raises(WorkflowFailureError):
                await workflow_result(second)
            cancelled = await second.query("status")
            assert cancelled["state"] == "cancelled" and cancelled["cancelled_stage"] == "queue"
            await first.cancel()
            with pytest.raises(WorkflowFailureError):
                await workflow_result(first)
            assert (await first.query("status"))["cancelled_stage"] == "discovery"
    finally:
        hole.close()
