"""Session planning from what the environment grants (issue 12) and capacity that never holds a
slot (issue 14), against real ``openenv`` counter servers with 1 and 8 sessions.

* A group of 4 (default concurrency) on a 1-session server completes in waves of 1, with the same
  bytes (digests of the three bundle files, behaviour log-probs included) as the same request on an
  8-session server at the same URL, where each group is one wave of 4 (sampling is batch-invariant).
* Cancelled while waiting for capacity, the collector leaves no session behind: a fresh session on
  the 1-session server opens within 1 s.
* On the activity path an attempt at a full environment ends within seconds with
  ``environment_at_capacity``, naming group_size and what the environment granted.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest

from kiln.core.canonical import canonical_json, sha256_bytes
from kiln.core.errors import EnvironmentCapacityExhausted, RunCancelled
from kiln.core.openenv.capacity import CAPACITY, EnvironmentAtCapacity
from kiln.core.openenv.discovery import inspect_environment
from kiln.core.openenv.session_open import open_session_and_reset
from kiln.core.openenv.urls import normalize_url
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from tests.support.servers import example_env_argv, free_port, serve_app_process
from tests.unit.test_verify_support import _collect

pytestmark = pytest.mark.timeout(240)


def _bundle(port: int, sessions: int, model_dir: Path) -> dict[str, bytes]:
    from kiln.core.policy.runtime import PolicyRuntime

    settings = EpisodeSettings(group_size=4, max_steps=3, max_action_tokens=48)  # default concurrency
    argv = example_env_argv("counter", port, max_concurrent_envs=sessions)
    with serve_app_process(argv, port=port) as url:
        return asyncio.run(
            _collect(url, PolicyRuntime.load(model_dir), groups=2, seed_start=40, settings=settings, template={})
        )


def test_group_of_four_on_one_session_server_matches_eight_sessions(tiny_model_dir: Path) -> None:
    port = free_port()
    key = normalize_url(f"http://127.0.0.1:{port}").websocket_url
    narrow = _bundle(port, 1, tiny_model_dir)  # waves of 1 (learned from refusals)
    observed = CAPACITY.snapshot(key)
    assert observed["max_sessions_advertised"] == 1  # learned from CAPACITY_REACHED
    assert observed["sessions_granted_max"] == 1 and observed["refusals"] >= 1
    CAPACITY.forget(key)  # the same URL now serves 8 sessions (as after LIMIT_MEMORY_S)
    wide = _bundle(port, 8, tiny_model_dir)  # one wave of 4: each sampling call batches 4 rows
    assert CAPACITY.snapshot(key)["sessions_granted_max"] == 4
    # Sampling is batch-invariant (docs/models.md): waves of 1 and one wave of 4 record the same
    # tokens AND the same behaviour log-probs, so every byte of the bundle is the same.
    for name in ("rollouts.jsonl", "replay.json", "summary.json"):
        assert sha256_bytes(narrow[name]) == sha256_bytes(wide[name]), name
    groups = [json.loads(line) for line in wide["rollouts.jsonl"].splitlines()]
    assert [len(g["completions"]) for g in groups] == [4, 4]
    assert len(re.findall(rb'"logprobs":\[-', wide["rollouts.jsonl"])) >= 8  # log-probs are in those bytes


@pytest.fixture()
def single_url() -> str:
    with serve_app_process(lambda port: example_env_argv("counter", port, max_concurrent_envs=1)) as url:
        yield url


def _task(inspection: dict, seed: int, group_size: int, wait_s: int = 30) -> GroupTask:
    return GroupTask(
        group_index=0,
        environment_index=0,
        seed=seed,
        reset_payload={"seed": seed},
        inspection=inspection,
        settings=EpisodeSettings(group_size=group_size, max_steps=2, max_action_tokens=16, capacity_wait_seconds=wait_s),
        behavior_policy={},
    )


async def test_cancel_during_capacity_wait_leaves_no_session(single_url: str) -> None:
    url = normalize_url(single_url)
    inspection = json.loads(canonical_json(await inspect_environment(single_url)))
    holder, _, _ = await open_session_and_reset(url, {"seed": 1}, capacity_wait_s=5)
    cancel_at = time.monotonic() + 0.8
    collector = GroupCollector(
        _task(inspection, 3, 2), policy=None, should_cancel=lambda: time.monotonic() > cancel_at  # type: ignore[arg-type]
    )
    try:
        with pytest.raises(RunCancelled):
            await collector.run()
    finally:
        await holder.close()
    # Asyncio cancellation as well (a worker shutdown cancels the activity task).
    holder, _, _ = await open_session_and_reset(url, {"seed": 1}, capacity_wait_s=5)
    run = asyncio.ensure_future(GroupCollector(_task(inspection, 4, 2), policy=None).run())  # type: ignore[arg-type]
    await asyncio.sleep(0.6)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await holder.close()
    # No capacity wait allowed: the cancelled collection released its sessions at once.
    session, reset, retries = await open_session_and_reset(url, {"seed": 9}, capacity_wait_s=0)
    try:
        assert reset.kind == "observation" and retries == 0
    finally:
        await session.close()


async def test_attempt_at_capacity_ends_fast_and_names_group_size(single_url: str) -> None:
    url = normalize_url(single_url)
    inspection = json.loads(canonical_json(await inspect_environment(single_url)))
    holder, _, _ = await open_session_and_reset(url, {"seed": 1}, capacity_wait_s=5)
    try:
        started = time.monotonic()
        collector = GroupCollector(_task(inspection, 5, 4), policy=None, attempt_capacity_wait_s=0.5)  # type: ignore[arg-type]
        with pytest.raises(EnvironmentAtCapacity) as info:
            await collector.run()
        assert time.monotonic() - started < 3.0
        assert info.value.code == "environment_at_capacity" and not info.value.retryable
        assert info.value.details["group_size"] == 4
        assert info.value.details["max_sessions_advertised"] == 1
        # Local tools (no workflow) wait the whole capacity_wait_seconds, then name what they saw.
        local = GroupCollector(_task(inspection, 5, 4, wait_s=1), policy=None)  # type: ignore[arg-type]
        with pytest.raises(EnvironmentCapacityExhausted) as final:
            await local.run()
        assert "group_size 4" in final.value.message and "max_sessions 1" in final.value.message
        assert final.value.details["group_size"] == 4
    finally:
        await holder.close()
