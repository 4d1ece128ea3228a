"""MCP tool calls end to end (issue 25) against our three-tool server (``tests.support.tool_servers``,
real ``openenv``): inspection names the tool-call form, a constrained collection with the tiny
model only ever sends calls the server accepts, an unconstrained one never sends an invalid call
(it ends as a harness error instead), and both bundles verify offline.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from kiln.core.openenv.discovery import inspect_environment
from kiln.core.openenv.tool_calls import TOOL_CALLS_VERSION
from kiln.core.rollout.group import EpisodeSettings
from kiln.core.rollout.verify import verify_bundle
from tests.integration.test_openenv_wild import _collect
from tests.support.servers import free_port, serve_app_process
from tests.support.tool_servers import TOOL_SCHEMAS, call_is_valid
from tests.unit.test_verify_support import write_bundle

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _exchanges(files: dict[str, bytes]) -> list[dict]:
    replay = json.loads(files["replay.json"])
    return [x for g in replay["groups"] for c in g["candidates"] for x in c["exchanges"]]


def test_tool_calls_constrained_and_unconstrained_through_the_collector(tiny_model_dir: Path, tmp_path: Path) -> None:
    from kiln.core.policy.runtime import PolicyRuntime

    runtime = PolicyRuntime.load(tiny_model_dir)
    port = free_port()
    argv = [sys.executable, "-m", "tests.support.tool_servers", "--port", str(port), "--max-concurrent-envs", "4"]
    with serve_app_process(argv, port=port, startup_timeout_s=120) as url:
        inspection = asyncio.run(inspect_environment(url))
        constrained = EpisodeSettings(
            group_size=2, max_steps=3, max_action_tokens=256, thinking=False, constrained_actions=True
        )
        files = asyncio.run(_collect(url, runtime, constrained))
        free = EpisodeSettings(group_size=2, max_steps=3, max_action_tokens=64, thinking=False)
        free_files = asyncio.run(_collect(url, runtime, free))
    identity = inspection["identity"]
    assert identity["tool_calls"] == TOOL_CALLS_VERSION
    assert [t["name"] for t in identity["tools"]] == list(TOOL_SCHEMAS)

    sent = _exchanges(files)
    summary = json.loads(files["summary.json"])
    assert [r.get("harness_code") for r in summary["rollouts"]] == [None] * 2
    assert len(sent) == 6  # 2 candidates x 3 calls, every one sent
    for exchange in sent:
        action = exchange["action"]
        assert call_is_valid(action["tool_name"], action["arguments"])
        assert exchange["result"]["observation"]["observation"]["result"]["valid"] is True
    system = json.loads(files["rollouts.jsonl"].splitlines()[0])["messages"][0]["content"]
    assert '"const":"move"' in system and '"const":"configure"' in system
    assert verify_bundle(write_bundle(tmp_path / "constrained", files))["rollouts"] == 2

    # Unconstrained: whatever the model wrote, the server never received an invalid call.
    for exchange in _exchanges(free_files):
        assert exchange["result"]["observation"]["observation"]["result"]["valid"] is True
    free_summary = json.loads(free_files["summary.json"])
    codes = {r.get("harness_code") for r in free_summary["rollouts"]}
    assert codes <= {None, "INVALID_MODEL_ACTION", "ACTION_SCHEMA_VALIDATION_FAILED", "MODEL_ACTION_TRUNCATED"}
    assert verify_bundle(write_bundle(tmp_path / "free", free_files))["rollouts"] == 2
