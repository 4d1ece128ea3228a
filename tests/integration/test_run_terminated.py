"""A run terminated through Temporal (``temporal workflow terminate``, not Kiln's cancel) shows
``failure.code = run_terminated`` naming who terminated it and why, not a failure of null."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from api.runs import RunService
from kiln.core.settings import Settings
from workflows.names import WORKFLOW_NAME


@pytest.mark.timeout(60)
async def test_a_terminated_run_names_who_and_why(temporal_server: str, tmp_path: Path) -> None:
    operator = Client.connect(temporal_server, identity="mallory@elsewhere", data_converter=pydantic_data_converter)
    client = await operator
    run_id = str(uuid.uuid4())
    # No worker polls this queue: the run stays scheduled until it is terminated.
    handle = await client.start_workflow(WORKFLOW_NAME, {"kind": "rollout"}, id=run_id,
                                         task_queue=f"nobody-{uuid.uuid4().hex[:8]}")
    await handle.terminate(reason="cleaning up the cluster")
    api_client = await Client.connect(temporal_server, data_converter=pydantic_data_converter)
    view = await RunService(api_client, Settings(home=tmp_path, temporal_address=temporal_server)).status(run_id)
    assert view.state == "failed" and view.phase == "failed"
    assert view.failure is not None
    assert view.failure.code == "run_terminated" and view.failure.stage == "orchestration"
    assert view.failure.message == (
        "the run was terminated through Temporal by mallory@elsewhere: cleaning up the cluster")
    assert view.failure.details == {"terminated_by": "mallory@elsewhere", "reason": "cleaning up the cluster"}
