"""Compatibility with an older-profile server (openenv-core 0.3.0 shape): no /list_environments,
no Task API, no reset_observation, observation metadata dropped."""

import pytest

from kiln.core.errors import EnvironmentCapacityExhausted
from kiln.core.openenv import inspect_environment, normalize_url, open_session_and_reset
from kiln.core.openenv.tasks import task_catalog
from tests.support.servers import serve_module


@pytest.fixture(scope="module")
def old_url():
    with serve_module("tests.support.old_profile_server", "--max-concurrent-envs", "1") as base_url:
        yield base_url


async def test_inspect_old_profile(old_url):
    inspection = await inspect_environment(old_url)
    identity = inspection["identity"]
    assert identity["environments"] == []
    assert identity["metadata"]["name"] == "OldCounterEnvironment"
    assert set(inspection["schema"]) == {"action", "observation", "state"}
    assert identity["openapi_version"] == "1.0.0"


async def test_episode_on_old_profile(old_url):
    session, reset, retries = await open_session_and_reset(normalize_url(old_url), {"seed": 5}, capacity_wait_s=5)
    try:
        assert retries == 0
        assert set(reset.observation) == {"observation", "reward", "done"}
        assert "metadata" not in reset.observation["observation"]
        target = reset.observation["observation"]["target"]
        rewards = []
        result = reset
        while not result.done:
            result = await session.step({"amount": 1})
            rewards.append(result.observation["reward"])
        assert rewards == [1] * target and all(type(r) is int for r in rewards)
        assert (await session.state())["step_count"] == target
        with pytest.raises(EnvironmentCapacityExhausted) as info:
            await open_session_and_reset(normalize_url(old_url), {"seed": 5}, capacity_wait_s=0.3)
        assert info.value.details["refusals"] in (2, 3)  # 0 s, 0.25 s, then maybe one at ~0.3 s
    finally:
        await session.close()


async def test_no_task_api_on_old_profile(old_url):
    catalog = await task_catalog(old_url)
    assert catalog["task_api"] == "unsupported"
    assert catalog["splits"] == [] and catalog["tasks"] == []
