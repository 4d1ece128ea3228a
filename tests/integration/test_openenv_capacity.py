"""Session planning from what the environment grants (issue 12) and capacity that never holds a
slot (issue 14), against real ``openenv`` counter servers with 1 and 8 sessions.

* A group of 4 (concurrency 4) on a 1-session server completes in waves of 1, with the same bytes
  (digests of the three bundle files) as a sequential plan on an 8-session server at the same URL,
  and the same tokens, texts, rewards, states and exchanges as one wave of 4 there (behaviour
  log-probs then differ by float rounding of the batch shape, < 1e-4).
* Cancelled while waiting for capacity, the collector leaves no session behind: a fresh session on
  the 1-session server opens within 1 s.
* On the activity path an attempt at a full environment ends within seconds with
  ``environment_at_capacity``, naming group_size and what the environment granted.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from kiln.canonical import canonical_json, sha256_bytes
from kiln.errors import EnvironmentCapacityExhausted, RunCancelled
from kiln.openenv.capacity import CAPACITY, EnvironmentAtCapacity
from kiln.openenv.discovery import inspect_environment
from kiln.openenv.session import open_session_and_reset
from kiln.openenv.urls import normalize_url
from kiln.rollout.group import EpisodeSettings, GroupCollector, GroupTask
from tests.support.servers import example_env_argv, free_port, serve_app_process
from tests.unit.test_verify_support import _collect

pytestmark = pytest.mark.timeout(240)


def _bundle(port: int, sessions: int, model_dir: Path, concurrency: int) -> dict[str, bytes]:
    from kiln.policy.runtime import PolicyRuntime

    settings = EpisodeSettings(group_size=4, max_steps=3, max_action_tokens=48, concurrency=concurrency)
    argv = example_env_argv("counter", port, max_concurrent_envs=sessions)
    with serve_app_process(argv, port=port) as url:
        return asyncio.run(
            _collect(url, PolicyRuntime.load(model_dir), groups=2, seed_start=40, settings=settings, template={})
        )


def _without_logprobs(value):
    if isinstance(value, dict):
        return {k: _without_logprobs(v) for k, v in value.items() if k not in ("logprobs", "dataset_sha256", "dataset_bytes", "replay_sha256")}
    if isinstance(value, (list, tuple)):
        return [_without_logprobs(v) for v in value]
    return value


def _logprobs(value, out: list[float]) -> list[float]:
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "logprobs":
                out.extend(v)
            else:
                _logprobs(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _logprobs(v, out)
    return out


def test_group_of_four_on_one_session_server_matches_eight_sessions(tiny_model_dir: Path) -> None:
    port = free_port()
    key = normalize_url(f"http://127.0.0.1:{port}").websocket_url
    narrow = _bundle(port, 1, tiny_model_dir, concurrency=4)  # waves of 1 (learned from refusals)
    observed = CAPACITY.snapshot(key)
    assert observed["max_sessions_advertised"] == 1  # learned from CAPACITY_REACHED
    assert observed["sessions_granted_max"] == 1 and observed["refusals"] >= 1
    CAPACITY.forget(key)  # the same URL now serves 8 sessions (as after LIMIT_MEMORY_S)
    sequential = _bundle(port, 8, tiny_model_dir, concurrency=1)
    wide = _bundle(port, 8, tiny_model_dir, concurrency=4)  # one wave of 4
    # Same sampling batches (one candidate at a time) → byte-identical rollouts and replay; the
    # summary differs only in the recorded request concurrency.
    for name in ("rollouts.jsonl", "replay.json"):
        assert sha256_bytes(narrow[name]) == sha256_bytes(sequential[name]), name
    summary_narrow, summary_seq = json.loads(narrow["summary.json"]), json.loads(sequential["summary.json"])
    changed = {k for k in set(summary_narrow) | set(summary_seq) if summary_narrow.get(k) != summary_seq.get(k)}
    assert changed == {"concurrency"} and summary_narrow["concurrency"] == 4, changed
    # Against one wave of 4: every token, text, reward, state and exchange is identical; only the
    # recorded behaviour log-probs differ by float rounding of a different batch shape.
    def parsed(files):
        return [json.loads(line) for line in files["rollouts.jsonl"].splitlines()], json.loads(files["replay.json"]), json.loads(files["summary.json"])
    assert _without_logprobs(parsed(narrow)) == _without_logprobs(parsed(wide))
    a, b = _logprobs(parsed(narrow), []), _logprobs(parsed(wide), [])
    assert len(a) == len(b) > 0 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    print("max logprob difference, one wave of 4 vs waves of 1:", max(abs(x - y) for x, y in zip(a, b)))
    assert CAPACITY.snapshot(key)["sessions_granted_max"] == 4  # the 8-session server's single wave


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
    started = time.monotonic()
    session, reset, retries = await open_session_and_reset(url, {"seed": 9}, capacity_wait_s=0)
    try:
        assert reset.kind == "observation" and retries == 0
        assert time.monotonic() - started < 1.0
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
