"""Runs on a hybrid model (qwen3_5's Gated DeltaNet + full attention layers, random weights, the
tiny model's tokenizer and template) through the whole stack on the hf engine.

Thinking that cannot finish: with thinking on and a 4-token action budget, a random-weight model
never writes ``</think>`` (one id of 1024), so every completion of every group ends inside
``<think>``. The run's warnings name each group, the cause and the fix, and the train run's
``training_failed`` (no reward variation) names them too, not only "no reward variation".
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from kiln.core.unfinished_thinking import FIX
from tests.support.model_builders import build_family_folder
from tests.support.kiln_workers import running_workers
from tests.support.waiting import workflow_result
from workflows.options import WORKFLOW_NAME

pytestmark = pytest.mark.asyncio


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_thinking_that_never_closes_names_the_cause_and_the_fix(
    kiln_settings: Any, counter_env_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = build_family_folder("qwen3_5", tmp_path / "qwen3_5", tokenizer_dir=tiny_model_dir)
    settings = kiln_settings(model_path=model)
    request = {"kind": "train", "groups": 2, "group_size": 2, "max_steps": 2, "max_action_tokens": 4,
               "output_adapter": "never-closes", "environment_urls": [counter_env_url],
               "training_config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8}}
    async with running_workers(settings) as client:
        handle = await client.start_workflow(WORKFLOW_NAME, request, id=str(uuid.uuid4()),
                                             task_queue=settings.control_task_queue)
        with pytest.raises(WorkflowFailureError):
            await workflow_result(handle, timeout_s=240)
        status = await handle.query("status")
    assert status["progress"]["groups_completed"] == 2 and status["progress"]["rollouts_completed"] == 4
    thinking = [w for w in status["warnings"] if "ended inside <think>" in w]
    assert sorted(w.split(":", 1)[0] for w in thinking) == ["group 0", "group 1"]
    assert all(FIX in w for w in thinking)
    failure = status["failure"]
    assert failure["code"] == "training_failed" and failure["details"]["reason"] == "zero_groups"
    assert failure["message"].startswith("every seed group was skipped before training, so no adapter was "
                                         "trained: every group: every completion ended inside <think>")
    assert "no reward variation" in failure["message"]
    assert failure["hint"].startswith(FIX)
    assert failure["details"]["unfinished_thinking_groups"] == [0, 1]
