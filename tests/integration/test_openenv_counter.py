"""The OpenEnv client against real ``openenv==0.10.0`` counter servers (subprocesses on loopback)."""

import asyncio
import random
import time

import pytest

from kiln.core.canonical import digest_json
from kiln.core.errors import EnvironmentCapacityExhausted, EnvironmentProtocolError, EnvironmentUnavailable
from kiln.core.openenv import (
    ActionValidator,
    EnvSession,
    identity_differences,
    inspect_environment,
    normalize_url,
    open_session_and_reset,
)
from tests.support.servers import free_port, serve_example_env


@pytest.fixture(scope="module")
def counter_url():
    with serve_example_env("counter", max_concurrent_envs=2) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def counter_v2_single():
    with serve_example_env("counter", max_concurrent_envs=1, schema_variant=2) as base_url:
        yield base_url


async def test_inspect_counter(counter_url):
    inspection = await inspect_environment(counter_url + "/")
    identity, schema = inspection["identity"], inspection["schema"]
    assert identity["base_url"] == counter_url
    assert identity["websocket_url"] == counter_url.replace("http://", "ws://") + "/ws"
    assert identity["environments"] == ["counter"]
    assert identity["metadata"]["name"] == "counter"
    assert identity["openapi_version"] == "1.0.0"
    assert identity["authentication"] == "none"
    assert identity["schema_sha256"] == digest_json(schema)
    assert set(schema) == {"action", "observation", "state", "reset_observation"}
    assert schema["action"]["required"] == ["amount"]
    validator = ActionValidator.compile(schema["action"])
    assert validator.validate({"amount": 3}) == []
    assert [i["keyword"] for i in validator.validate({"amount": 9})] == ["maximum"]
    again = await inspect_environment(counter_url)
    assert again["identity"]["discovery_sha256"] == identity["discovery_sha256"]
    assert identity_differences(inspection, again) == []


async def test_identity_drift_between_schema_variants(counter_url, counter_v2_single):
    first = await inspect_environment(counter_url)
    second = await inspect_environment(counter_v2_single)
    assert identity_differences(first, second) == [
        "identity.base_url",
        "identity.websocket_url",
        "identity.schema_sha256",
        "identity.discovery_sha256",
        "schema.action",
    ]


async def test_full_episode(counter_url):
    url = normalize_url(counter_url)
    target = random.Random(7).randint(8, 12)
    session, reset, retries = await open_session_and_reset(url, {"seed": 7}, capacity_wait_s=5)
    try:
        assert retries == 0
        assert reset.kind == "observation" and reset.done is False
        assert reset.observation["reward"] is None and reset.reward_value == 0.0
        assert reset.observation["observation"]["target"] == target
        total, steps = 0.0, 0
        result = reset
        while not result.done:
            result = await session.step({"amount": 1})
            steps += 1
            total += result.reward_value
        assert steps == target and total == float(target)
        assert result.observation["observation"]["count"] == target
        state = await session.state()
        assert state == {"episode_id": "seed-7", "step_count": target, "count": target, "target": target, "seed": 7}
    finally:
        await session.close()
    assert session.closed and not session.poisoned
    await session.close()  # idempotent
    with pytest.raises(EnvironmentProtocolError) as info:
        await session.state()
    assert info.value.details["reason"] == "session_closed"


async def test_recoverable_error_keeps_session(counter_url):
    session = await EnvSession.open(normalize_url(counter_url))
    try:
        await session.reset({"seed": 1})
        bad = await session.step({"amount": 0})
        assert bad.kind == "protocol_error" and bad.code == "VALIDATION_ERROR"
        assert not bad.terminal and bad.recoverable and bad.reward_value == 0.0
        assert bad.error["errors"][0]["loc"] == ["amount"]
        extra = await session.step({"amount": 1, "colour": "red"})
        assert extra.code == "VALIDATION_ERROR"
        assert (await session.state())["step_count"] == 0
        ok = await session.step({"amount": 2})
        assert ok.kind == "observation" and ok.observation["reward"] == 1.0
        assert (await session.state())["step_count"] == 1
    finally:
        await session.close()


async def test_overshoot_metadata_is_top_level(counter_url):
    session, reset, _ = await open_session_and_reset(normalize_url(counter_url), {"seed": 3}, capacity_wait_s=5)
    try:
        target = reset.observation["observation"]["target"]
        result = reset
        for _ in range(target):
            result = await session.step({"amount": 5})
            if result.done:
                break
        assert result.done
        if result.observation["observation"]["count"] > target:
            assert result.observation["metadata"] == {"overshoot": True}
            assert result.observation["reward"] == 0.0
    finally:
        await session.close()


async def test_lock_step_refuses_second_request(counter_url):
    session = await EnvSession.open(normalize_url(counter_url))
    try:
        await session.reset({"seed": 2})
        first = asyncio.ensure_future(session.step({"amount": 1}))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="lock-step"):
            await session.step({"amount": 1})
        assert (await first).kind == "observation"
        assert not session.poisoned
    finally:
        await session.close()


async def test_keepalive_exchanges_state_while_policy_runs(counter_url):
    session = await EnvSession.open(normalize_url(counter_url), request_timeout_s=0.2)
    try:
        await session.reset({"seed": 4})
        before = session.requests_sent
        result = await session.run_with_keepalive(asyncio.sleep(0.32, result={"amount": 1}))
        assert result == {"amount": 1}
        keepalives = session.requests_sent - before
        assert 4 <= keepalives <= 7  # one state exchange every 50 ms
        step = await session.step(result)
        assert step.observation["observation"]["count"] == 1
        assert (await session.state())["step_count"] == 1  # state exchanges changed nothing
    finally:
        await session.close()


async def test_capacity_retry_then_exhaustion(counter_v2_single):
    url = normalize_url(counter_v2_single)
    holder, _, _ = await open_session_and_reset(url, {"seed": 1}, capacity_wait_s=5)
    try:
        started = time.monotonic()
        with pytest.raises(EnvironmentCapacityExhausted) as info:
            await open_session_and_reset(url, {"seed": 2}, capacity_wait_s=0.6)
        elapsed = time.monotonic() - started
        assert info.value.code == "environment_capacity_exhausted" and info.value.retryable
        # backoffs 0.25 then 0.35 (remaining) -> 3 refusals
        assert info.value.details["refusals"] == 3
        assert info.value.details["max_sessions"] == 1
        assert 0.55 <= elapsed < 10  # waited out its 0.6 s, then gave up
    finally:
        await holder.close()

    holder, _, _ = await open_session_and_reset(url, {"seed": 1}, capacity_wait_s=5)

    async def release_later():
        await asyncio.sleep(0.4)
        await holder.close()

    releaser = asyncio.ensure_future(release_later())
    session, reset, retries = await open_session_and_reset(url, {"seed": 2}, capacity_wait_s=10)
    try:
        await releaser
        assert 1 <= retries <= 3
        assert reset.kind == "observation"
        assert (await session.step({"amount": 1})).kind == "observation"
    finally:
        await session.close()


async def test_cancel_during_capacity_backoff(counter_v2_single):
    url = normalize_url(counter_v2_single)
    holder, _, _ = await open_session_and_reset(url, {"seed": 1}, capacity_wait_s=5)
    try:
        deadline = time.monotonic() + 0.3
        with pytest.raises(Exception) as info:
            await open_session_and_reset(url, {}, capacity_wait_s=30, should_cancel=lambda: time.monotonic() > deadline)
        assert info.value.code == "cancelled"
        assert time.monotonic() - deadline < 10  # cancelled well inside the 30 s capacity wait
    finally:
        await holder.close()


async def test_unreachable_server_names_route_and_reason():
    port = free_port()
    with pytest.raises(EnvironmentUnavailable) as info:
        await inspect_environment(f"127.0.0.1:{port}")
    assert info.value.message == f"GET http://127.0.0.1:{port}/health: connection refused"
    with pytest.raises(EnvironmentUnavailable) as info:
        await EnvSession.open(normalize_url(f"http://127.0.0.1:{port}"))
    assert info.value.message == f"GET http://127.0.0.1:{port}/health: connection refused"


async def test_counter_has_no_task_provider(counter_url):
    from kiln.core.openenv.tasks import task_catalog

    catalog = await task_catalog(counter_url)
    assert catalog == {"environment_name": "counter", "task_api": "unsupported", "splits": [], "tasks": []}
