"""Rollback tolerance: what one release newer wrote decodes on this release.

A rolling deploy in either direction has a worker of one release read what another wrote. A kept
history whose ``admit_run`` result carries fields this release does not know (at the top, in the
run request and in its training config, as a release that adds ``parallel_groups``-like fields
writes them) replays on HEAD with Kiln's data converter; the SDK's plain pydantic converter fails
that replay (``Extra inputs are not permitted``), as rollback did before. API input stays strict:
the same unknown field in a user's request is refused, and a view with an unknown field is
refused by plain validation but read by the client's.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from kiln.core.contracts import parse_run_request
from kiln.core.errors import InvalidRequest
from kiln.core.records import AdmissionResult
from kiln.core.run_view import RunView
from kiln.core.tolerant import TOLERANT_CONTEXT
from workers.converter import kiln_data_converter
from workers.sandbox import workflow_runner
from workflows.chunk import CollectChunkWorkflow
from workflows.openenv_run import OpenEnvRunWorkflow
from workflows.preflight import PreflightWorkflow
from workflows.run_queue import RunQueueWorkflow
from workflows.train_dataset import TrainDatasetWorkflow

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
NEWER = {"from_a_newer_release": {"groups_in_flight": 4}}


def _with_newer_fields(result: dict[str, Any]) -> dict[str, Any]:
    request = dict(result["request"], **NEWER)
    if isinstance(request.get("training_config"), dict):
        request["training_config"] = dict(request["training_config"], **NEWER)
    return {**result, **NEWER, "request": request}


def _newer_admission(path: Path) -> tuple[str, int]:
    """The history at ``path`` with its ``admit_run`` result as a newer release writes it; how
    many results were changed."""
    history = json.loads(path.read_text())
    scheduled: dict[str, str] = {}
    changed = 0
    for event in history["events"]:
        attributes = event.get("activityTaskScheduledEventAttributes")
        if attributes:
            scheduled[event["eventId"]] = attributes["activityType"]["name"]
        completed = event.get("activityTaskCompletedEventAttributes")
        if completed and scheduled.get(completed["scheduledEventId"]) == "admit_run":
            payload = completed["result"]["payloads"][0]
            result = _with_newer_fields(json.loads(base64.b64decode(payload["data"])))
            payload["data"] = base64.b64encode(json.dumps(result).encode()).decode()
            changed += 1
    return json.dumps(history), changed


async def _replay(history_json: str, name: str, converter: Any) -> Any:
    replayer = Replayer(
        workflows=[OpenEnvRunWorkflow, CollectChunkWorkflow, RunQueueWorkflow, PreflightWorkflow, TrainDatasetWorkflow],
        data_converter=converter,
        workflow_runner=workflow_runner(),
    )
    return await replayer.replay_workflow(WorkflowHistory.from_json(name, history_json), raise_on_replay_failure=False)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["rollout", "train_with_gate"])
async def test_a_newer_releases_admission_result_replays_here(name: str) -> None:
    history_json, changed = _newer_admission(HISTORIES / "380a782" / f"{name}.json")
    assert changed == 1
    tolerant = await _replay(history_json, name, kiln_data_converter)
    assert tolerant.replay_failure is None
    strict = await _replay(history_json, name, pydantic_data_converter)
    assert strict.replay_failure is not None
    assert "Extra inputs are not permitted" in str(strict.replay_failure.__cause__ or strict.replay_failure)


@pytest.mark.timeout(30)
def test_the_converter_drops_unknown_fields_at_every_depth_and_keeps_the_rest() -> None:
    history = json.loads((HISTORIES / "380a782" / "train_with_gate.json").read_text())
    payloads = [
        json.loads(base64.b64decode(e["activityTaskCompletedEventAttributes"]["result"]["payloads"][0]["data"]))
        for e in history["events"] if "activityTaskCompletedEventAttributes" in e
    ]
    written = next(p for p in payloads if "reset_plan_sha256" in p and "request" in p)
    newer = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(_with_newer_fields(written)).encode())
    (decoded,) = kiln_data_converter.payload_converter.from_payloads([newer], [AdmissionResult])
    assert isinstance(decoded, AdmissionResult)
    assert decoded == AdmissionResult.model_validate(written)  # the known fields, exactly as written
    with pytest.raises(Exception, match="from_a_newer_release"):
        pydantic_data_converter.payload_converter.from_payloads([newer], [AdmissionResult])


@pytest.mark.timeout(30)
def test_user_input_stays_strict_and_the_client_reads_a_newer_view() -> None:
    with pytest.raises(InvalidRequest, match="from_a_newer_release"):
        parse_run_request({"kind": "rollout", "environment_urls": ["http://127.0.0.1:9"], **NEWER})
    body = {"run_id": "r", "state": "completed", "phase": "completed", **NEWER,
            "progress": {"groups_completed": 2, **NEWER}}
    with pytest.raises(ValueError, match="from_a_newer_release"):
        RunView.model_validate(body)
    view = RunView.model_validate(body, context=TOLERANT_CONTEXT)
    assert (view.run_id, view.state, view.progress.groups_completed) == ("r", "completed", 2)
