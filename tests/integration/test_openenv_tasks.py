"""Task API catalogs (R2.*) against a real openenv 0.10.0 server with a TaskProvider."""

import pytest

from kiln.core.errors import EnvironmentUnavailable, InvalidRequest
from kiln.core.openenv import inspect_environment, normalize_url, open_session_and_reset
from kiln.core.openenv.httpio import make_client
from kiln.core.openenv.tasks import TaskClient, task_catalog
from tests.support.servers import serve_module


@pytest.fixture(scope="module")
def taskbank():
    with serve_module("examples.envs.taskbank.server") as base_url:
        yield base_url


async def test_splits_only(taskbank):
    catalog = await task_catalog(taskbank)
    assert catalog == {
        "environment_name": "taskbank",
        "task_api": "available",
        "splits": [
            {"name": "train", "type": "train"},
            {"name": "test", "type": "test"},
            {"name": "holdout", "type": "validation", "provider": "reference"},
        ],
        "tasks": [],
    }


async def test_page_with_case_insensitive_split(taskbank):
    catalog = await task_catalog(taskbank, environment_name="TASKBANK", split="TRAIN", start=1, limit=50)
    assert catalog["selected_split"] == "train"
    assert (catalog["num_tasks"], catalog["start"], catalog["stop"]) == (3, 1, 3)
    assert [row["id"] for row in catalog["tasks"]] == ["t1", "t2"]
    empty = await task_catalog(taskbank, split="test", start=5, limit=1)
    assert (empty["num_tasks"], empty["stop"], empty["tasks"]) == (2, 2, [])
    one = await task_catalog(taskbank, split="test", start=0, limit=1)
    assert [row["id"] for row in one["tasks"]] == ["s0"] and one["stop"] == 1


async def test_selection_and_page_errors(taskbank):
    with pytest.raises(InvalidRequest) as info:
        await task_catalog(taskbank, split="nope")
    assert info.value.code == "openenv_invalid_task_selection"
    assert "valid splits: train, test, holdout" in info.value.message
    assert info.value.details["valid_splits"] == ["train", "test", "holdout"]
    with pytest.raises(InvalidRequest) as info:
        await task_catalog(taskbank, environment_name="other")
    assert info.value.code == "openenv_invalid_task_selection"
    for limit in (0, 201):
        with pytest.raises(InvalidRequest) as info:
            await task_catalog(taskbank, limit=limit)
        assert info.value.code == "openenv_invalid_task_page"


async def test_task_index_out_of_range_is_http_400(taskbank):
    url = normalize_url(taskbank)
    async with make_client(bearer_token=None, connect_timeout_s=5, timeout_s=5) as client:
        tasks = TaskClient(client, url, "taskbank", bearer_token=None, timeout_s=5, connect_timeout_s=5)
        assert (await tasks.task("test", 0))["id"] == "s0"
        assert len(await tasks.tasks("train")) == 3
        assert [r["id"] for r in await tasks.task_range("train", -2, None)] == ["t1", "t2"]
        with pytest.raises(EnvironmentUnavailable) as info:
            await tasks.task("test", 99)
    assert info.value.details["http_status"] == 400 and not info.value.retryable


async def test_task_selected_by_reset_options(taskbank):
    inspection = await inspect_environment(taskbank)
    assert inspection["identity"]["environments"] == ["taskbank"]
    session, reset, _ = await open_session_and_reset(
        normalize_url(taskbank), {"split": "test", "index": 1, "seed": 0}, capacity_wait_s=5)
    try:
        assert reset.observation["observation"]["question"] == "6/2"
        result = await session.step({"answer": "3"})
        assert result.done and result.observation["reward"] == 1.0
    finally:
        await session.close()


def test_task_page_line_past_the_end() -> None:
    from kiln.cli.control_cmds import task_page_line

    page = {"selected_split": "train", "start": 10, "stop": 3, "num_tasks": 3}
    assert task_page_line(page) == "  train: --start 10 is past the end: the split has 3 task(s) (start 0..2)"
    assert task_page_line({**page, "start": 1}) == "  train: tasks 1..2 of 3 (0-based, inclusive)"
