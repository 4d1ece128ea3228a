"""A misbehaving environment ends with a documented Kiln code, never a Python exception name
(issue 14 §4): deep documents, overflowing rewards, 1011 closes, silent servers, and the
workflow's mapping of unexpected exceptions. Real hostile OpenEnv-like server on loopback."""

from __future__ import annotations

import time
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from api.app import create_app
from kiln.core.errors import EnvironmentProtocolError, EnvironmentUnavailable, KilnError
from kiln.core.openenv import EnvSession, inspect_environment, normalize_url, open_session_and_reset
from kiln.core.rollout.episode import CandidateEpisode
from kiln.core.settings import Settings
from tests.integration.test_api_helpers import asgi_client
from tests.support.servers import serve_module
from workflows.status import failure_from

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def hostile() -> Any:
    with serve_module("tests.support.hostile_server", health_path="/ok/health") as base_url:
        yield base_url


async def test_deeply_nested_metadata_is_a_protocol_error(hostile: str) -> None:
    with pytest.raises(KilnError) as info:
        await inspect_environment(f"{hostile}/deepmeta", timeout_s=10)
    assert type(info.value) is EnvironmentProtocolError
    assert info.value.code == "environment_protocol_error"
    assert "/deepmeta/metadata" in info.value.message and "nesting is deeper than 64" in info.value.message


async def test_inspect_route_answers_deep_metadata_with_a_kiln_code(hostile: str, tmp_path: Any) -> None:
    app = create_app(Settings(home=tmp_path))
    async with asgi_client(app) as http:
        response = await http.post("/v1/openenv/inspect", json={"environments": [f"{hostile}/deepmeta"]})
    assert (response.status_code, response.json()["code"]) == (502, "openenv_inspection_failed")
    assert "RecursionError" not in response.text


async def test_rewards_that_overflow_the_return_are_a_protocol_error(hostile: str) -> None:
    session, reset, _ = await open_session_and_reset(
        normalize_url(f"{hostile}/huge_reward"), {"seed": 1}, capacity_wait_s=2
    )
    episode = CandidateEpisode(candidate_index=0, prompt_ids=[1], protocol_error_reward=-1.0,
                               max_recoverable_errors=3)
    try:
        first = await session.step({"amount": 1})
        assert first.reward_value == 1e308
        episode.record_observation({"amount": 1}, first.observation, first.reward_value)
        second = await session.step({"amount": 1})
        with pytest.raises(EnvironmentProtocolError) as info:
            episode.record_observation({"amount": 1}, second.observation, second.reward_value)
    finally:
        await session.close()
    assert info.value.code == "environment_protocol_error"
    assert "overflow" in info.value.message
    assert episode.steps == 1 and episode.episode_return == 1e308


async def test_a_1011_close_is_not_capacity_exhausted(hostile: str) -> None:
    started = time.monotonic()
    with pytest.raises(KilnError) as info:
        await open_session_and_reset(normalize_url(f"{hostile}/close1011"), {"seed": 1}, capacity_wait_s=30)
    assert type(info.value) is EnvironmentUnavailable
    assert info.value.code == "environment_unavailable"
    assert "1011" in info.value.message
    # Not retried as a capacity refusal for the 30 s wait.
    assert time.monotonic() - started < 15


async def test_a_silent_environment_ends_with_the_request_timeout(hostile: str) -> None:
    session = await EnvSession.open(normalize_url(f"{hostile}/stall_step"), request_timeout_s=2.0)
    try:
        await session.reset({"seed": 1})
        with pytest.raises(KilnError) as info:
            await session.step({"amount": 1})
    finally:
        await session.close()
    assert type(info.value) is EnvironmentUnavailable
    assert info.value.code == "environment_unavailable"
    assert "no reply within 2s" in info.value.message


@pytest.mark.parametrize("python_type", ["RecursionError", "ValueError", "KeyError"])
async def test_unknown_exceptions_end_as_internal_error(python_type: str) -> None:
    # What Temporal makes of a non-Kiln exception raised in an activity: type = its class name.
    failure = failure_from(ApplicationError("boom", type=python_type), "collection")
    assert failure.code == "internal_error"
    assert failure.message == f"{python_type}: boom"
    # A KilnError keeps its code.
    kiln = EnvironmentProtocolError("bad frame")
    mapped = failure_from(ApplicationError(kiln.message, kiln.to_dict(), type=kiln.code), "collection")
    assert mapped.code == "environment_protocol_error"
