"""A deterministic model fault ends the run on its first attempt with ``model_fault``.

The planted fault is a real model with a broken config: the tiny Qwen3 model whose ``config.json``
declares its second layer ``linear_attention`` (an architecture without such layers). It loads;
its first forward fails inside transformers' Qwen3 code, the same way every time. The run must
end at collection after one attempt of the group, with the model's family, architecture and the
cause in the message and no Python exception class name.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from tests.support.kiln_workers import running_workers
from tests.support.waiting import workflow_result
from workflows.options import WORKFLOW_NAME

pytestmark = pytest.mark.asyncio


def _broken_model(tiny_model_dir: Path, out: Path) -> Path:
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["layer_types"] = ["full_attention", "linear_attention"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_model_that_fails_in_its_forward_ends_the_run_at_once(
    kiln_settings: Any, counter_env_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = kiln_settings(model_path=_broken_model(tiny_model_dir, tmp_path / "broken"))
    request = {"kind": "rollout", "groups": 1, "group_size": 2, "max_steps": 2, "max_action_tokens": 8,
               "environment_urls": [counter_env_url]}
    async with running_workers(settings) as client:
        handle = await client.start_workflow(WORKFLOW_NAME, request, id=str(uuid.uuid4()),
                                             task_queue=settings.control_task_queue)
        with pytest.raises(WorkflowFailureError):
            await workflow_result(handle)
        status = await handle.query("status")
        events = [event async for event in handle.fetch_history_events()]
    failure = status["failure"]
    assert status["state"] == "failed"
    assert failure["code"] == "model_fault" and failure["retryable"] is False
    assert failure["stage"] == "collection"
    message = failure["message"]
    assert "qwen3 model (Qwen3ForCausalLM)" in message and "modeling_qwen3.py" in message
    assert "'linear_attention'" in message
    assert "KeyError" not in message and "Traceback" not in message
    assert failure["details"]["architecture"] == "Qwen3ForCausalLM"
    started = [e.activity_task_started_event_attributes.attempt for e in events
               if e.HasField("activity_task_started_event_attributes")]
    scheduled = {e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name for e in events
                 if e.HasField("activity_task_scheduled_event_attributes")}
    collect = [i for i, name in scheduled.items() if "collect" in name]
    assert len(collect) == 1  # one group, scheduled once
    assert started and max(started) == 1  # no activity was retried
