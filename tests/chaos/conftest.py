"""Chaos fixtures: one real, restartable Kiln stack for the folder, and reference runs.

The stack (Temporal dev server, SeaweedFS, counter env on fixed ports; control and gpu workers as
separate processes) is started once per package and stopped by PID at the end, after which
nothing may be left listening. Each test starts with every part running and no fault hook set.
Reference runs (one per request shape) run undisturbed once and are shared.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.chaos.assertions import FIGURES
from tests.support.chaos.runs import RunOutcome, connect, drive
from tests.support.chaos.stack import ChaosStack
from tests.support.stack import assert_nothing_listening
from workflows.options import WORKFLOW_NAME

TRAINING_CONFIG = {
    "epochs": 2,
    "lora_rank": 4,
    "lora_alpha": 8,
    "learning_rate": 1e-3,
    "checkpoint_interval": 2,
}


def train_request(env_url: str, **overrides: Any) -> dict[str, Any]:
    """The tiny train request every artifact-equality case uses (one reference run for all)."""
    return {
        "kind": "train",
        "environment_urls": [env_url],
        "groups": 4,
        "group_size": 2,
        "max_steps": 3,
        "max_action_tokens": 32,
        "thinking": False,  # with these seeds 3 of 4 groups have reward variance: 6 training steps
        "output_adapter": "chaos-agent",
        "training_config": dict(TRAINING_CONFIG),
        **overrides,
    }


def rollout_request(env_url: str, **overrides: Any) -> dict[str, Any]:
    return {
        "kind": "rollout",
        "environment_urls": [env_url],
        "groups": 2,
        "group_size": 2,
        "max_steps": 3,
        "max_action_tokens": 32,
        "thinking": False,
        **overrides,
    }


@pytest.fixture(scope="package")
def chaos_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    stack = ChaosStack(root=tmp_path_factory.mktemp("chaos"), model_path=tiny_model_dir)
    try:
        stack.start()
        yield stack
    finally:
        processes = stack.close()
        for proc in processes:
            assert_nothing_listening(proc)


@pytest.fixture()
def stack(chaos_stack: ChaosStack) -> Iterator[ChaosStack]:
    """The shared stack, with every part running and no hook set, before and after the test."""
    _heal(chaos_stack)
    try:
        yield chaos_stack
    finally:
        chaos_stack.hooks.clear_all()
        _heal(chaos_stack)
        asyncio.run(_cancel_open_runs(chaos_stack))


async def _cancel_open_runs(stack: ChaosStack) -> None:
    """Cancel runs a failed test left running (one would hold the only queue slot)."""
    from temporalio.client import WorkflowExecutionStatus

    client = await connect(stack)
    handles = []
    async for info in client.list_workflows(f"WorkflowType = '{WORKFLOW_NAME}' AND ExecutionStatus = 'Running'"):
        handle = client.get_workflow_handle(info.id, run_id=info.run_id)
        await handle.cancel()
        handles.append(handle)
    deadline = asyncio.get_running_loop().time() + 30
    for handle in handles:
        while asyncio.get_running_loop().time() < deadline:
            if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                break
            await asyncio.sleep(0.2)


def _heal(stack: ChaosStack) -> None:
    stack.hooks.clear_all()
    if stack.temporal is None or not stack.temporal.alive():
        stack.start_temporal()
    if stack.s3 is None or not stack.s3.alive():
        stack.start_s3()
    if stack.env is None or not stack.env.alive():
        stack.start_env()
    for role in ("control", "gpu"):
        proc = stack.workers.get(role)
        if proc is None or not proc.alive():
            stack.start_worker(role)


@pytest.fixture(scope="package")
def reference_train(chaos_stack: ChaosStack) -> RunOutcome:
    """The undisturbed run of :func:`train_request` every disturbed train run is compared with.

    It runs on the shared gpu worker whatever that worker served before (adapters, training on
    its shared base model): sampling does not depend on a worker's history or on which rows share
    a sampling call, so a disturbed run on a restarted worker must write the same bytes.
    """
    _heal(chaos_stack)

    async def run() -> RunOutcome:
        client = await connect(chaos_stack)
        return await drive(client, chaos_stack, train_request(chaos_stack.env_url))

    outcome = asyncio.run(run())
    assert outcome.status["training"]["trained"] is True, outcome.status["training"]
    assert outcome.status["interruptions"] == []
    return outcome


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.write_sep("-", "chaos figures (time to recover, work re-done)")
    for entry in FIGURES:
        terminalreporter.write_line(json.dumps(entry, default=str))
