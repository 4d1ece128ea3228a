"""Recoverable errors in the server's key order: Kiln collects them and its own bundle verifies.

A real ``openenv`` server (tests/support/error_env.py) answers ``EXECUTION_ERROR`` as
``{"message", "code"}`` and ``VALIDATION_ERROR`` with nested pydantic ``errors`` in pydantic's key
order. The real collector runs a scripted policy against it; ``kiln openenv verify`` (a
subprocess of the CLI) must accept the bundle (issue 12 item 3).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from websockets.asyncio.client import connect

from kiln.core.canonical import canonical_json
from kiln.core.contracts import reset_payload, reset_plan_sha256
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.rollout.bundle import build_bundle
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from tests.support.error_env import JAM_MESSAGE
from tests.support.scripted_policy import ScriptedPolicy
from tests.support.servers import serve_module
from tests.unit.test_verify_support import spec_for, write_bundle

REPO = Path(__file__).resolve().parents[2]
SEEDS = [11, 12]
SCRIPTS = {
    0: ['</think>{"amount": 4}', '</think>{"amount": 1}', '</think>{"amount": 5}', '</think>{"amount": 2}'],
    1: ['</think>{"amount": 5}'] * 4,  # the 4th recoverable error exceeds the budget of 3
    2: ['</think>{"amount": 1}', '</think>{"amount": 4}', '</think>{"amount": 4}', '</think>{"amount": 3}'],
}
EXECUTION_CONTENT = (
    '{"openenv_error":{"code":"EXECUTION_ERROR","message":"' + JAM_MESSAGE + '"},"recoverable":true,"done":false}'
)


@pytest.fixture(scope="module")
def error_env() -> Iterator[str]:
    with serve_module("tests.support.error_env") as url:
        yield url


async def _raw_step_reply(url: str, amount: int) -> str:
    async with connect(url.replace("http://", "ws://") + "/ws") as ws:
        await ws.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
        await ws.recv()
        await ws.send(json.dumps({"type": "step", "data": {"amount": amount}}))
        return str(await ws.recv())


async def _collect(url: str) -> dict[str, bytes]:
    inspection = json.loads(canonical_json(await inspect_environment(url)))
    policy = ScriptedPolicy(SCRIPTS, SEEDS)
    settings = EpisodeSettings(group_size=3, max_steps=4, max_action_tokens=64, concurrency=3)
    documents = []
    for g, seed in enumerate(SEEDS):
        task = GroupTask(
            group_index=g, environment_index=0, seed=seed, reset_payload=reset_payload({}, seed),
            inspection=inspection, settings=settings, behavior_policy=policy.identity(),
        )
        documents.append(json.loads(canonical_json(await GroupCollector(task, policy).run())))
    return build_bundle(
        documents,
        spec=spec_for(settings, seed_start=SEEDS[0]),
        inspections=[inspection],
        behavior_policy=policy.identity(),
        reset_plan_sha256=reset_plan_sha256([{}]),
    )


@pytest.mark.timeout(120)
def test_server_ordered_recoverable_errors_verify(error_env: str, tmp_path: Path) -> None:
    # The property under test is really there: openenv sends message before code.
    raw = asyncio.run(_raw_step_reply(error_env, 4))
    assert raw == '{"type":"error","data":{"message":"' + JAM_MESSAGE + '","code":"EXECUTION_ERROR"}}'
    assert json.loads(asyncio.run(_raw_step_reply(error_env, 5)))["data"]["errors"][0]["type"] == "amount_refused"

    files = _collect_files(error_env)
    replay = json.loads(files["replay.json"])
    outcomes = [
        [(ex["result"]["kind"], ex["result"].get("error", {}).get("code"), ex["result"].get("continued"))
         for ex in cand["exchanges"]]
        for group in replay["groups"] for cand in group["candidates"]
    ]
    obs, jam, refused = ("observation", None, None), ("protocol_error", "EXECUTION_ERROR", True), (
        "protocol_error", "VALIDATION_ERROR", True)
    expected_per_group = [
        [jam, obs, refused, obs],
        [refused, refused, refused, ("protocol_error", "VALIDATION_ERROR", False)],
        [obs, jam, jam, obs],
    ]
    assert outcomes == expected_per_group * len(SEEDS)
    candidates = [cand for group in replay["groups"] for cand in group["candidates"]]
    assert [c["termination"] for c in candidates[:3]] == ["max_steps", "protocol_error", "max_steps"]
    assert [c["episode_return"] for c in candidates[:3]] == [0.0, -4.0, 0.0]
    line = json.loads(files["rollouts.jsonl"].splitlines()[0])
    assert line["completions"][0]["trajectory"][1]["content"] == EXECUTION_CONTENT

    summary = write_bundle(tmp_path / "bundle", files)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", "from kiln.cli.app import main; main()", "openenv", "verify",
         "--summary", str(summary), "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(proc.stdout)
    assert (report["groups"], report["rollouts"], report["environment_exchanges"]) == (2, 6, 24)


def _collect_files(url: str) -> dict[str, bytes]:
    return asyncio.run(_collect(url))
