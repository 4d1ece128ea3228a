"""The control CLI against a uvicorn-served API: ``status --follow`` exit codes (0 completed,
1 failed, 3 cancelled), ``runs``, ``cancel``, ``tasks`` and ``preflight``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from kiln.cli.control_cmds import register
from tests.integration.test_api_helpers import (
    TINY_ROLLOUT,
    NO_PREFLIGHT,
    BlackHole,
    serve_api,
    unreachable_url,
    wait_for,
)
from tests.support.kiln_workers import running_workers
from tests.support.servers import serve_module


def cli_app() -> typer.Typer:
    root = typer.Typer()
    openenv = typer.Typer()
    register(openenv)
    root.add_typer(openenv, name="openenv")
    return root


async def cli(url: str, *args: str) -> Any:
    """Invoke ``kiln openenv ARGS`` in a thread (the workers keep running in this loop)."""
    return await asyncio.to_thread(
        CliRunner().invoke, cli_app(), ["openenv", *args], env={"KILN_API_URL": url}
    )


async def submit(url: str, request: dict[str, Any]) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        response = await http.post("/v1/openenv/runs", params=NO_PREFLIGHT, json=request)
        assert response.status_code == 202, response.text
        return response.json()["run_id"]


async def test_follow_completed_run_exits_0(kiln_settings: Any, counter_env_url: str) -> None:
    settings = kiln_settings()
    async with running_workers(settings):
        with serve_api(settings) as url:
            run_id = await submit(url, {**TINY_ROLLOUT, "environment_urls": [counter_env_url]})
            followed = await cli(url, "status", run_id, "--follow", "--poll-seconds", "0.3")
            assert followed.exit_code == 0, followed.output
            assert "state    completed" in followed.output
            assert "episodes=2/2" in followed.output and "groups=1/1" in followed.output
            assert "summary.json" in followed.output

            as_json = await cli(url, "status", run_id, "--json")
            assert as_json.exit_code == 0
            status = json.loads(as_json.output)
            assert status["run_id"] == run_id and status["state"] == "completed"
            assert status["progress"]["rollouts_completed"] == 2

            listed = await cli(url, "runs", "--state", "completed", "--json")
            assert listed.exit_code == 0
            runs = json.loads(listed.output)
            assert run_id in [r["run_id"] for r in runs]
            assert {r["state"] for r in runs} == {"completed"}
            plain = await cli(url, "runs")
            assert plain.exit_code == 0 and run_id in plain.output

            again = await cli(url, "cancel", run_id)
            assert again.exit_code == 2 and "openenv_run_not_cancellable" in again.output

            receipt = await cli(url, "preflight", "--output-adapter", "cli-agent", "--json")
            assert receipt.exit_code == 0, receipt.output
            preflight = json.loads(receipt.output)
            assert preflight["schema"] == "kiln.openenv-training-preflight.v1"
            assert preflight["capacity_reserved"] is False
            # a run's identity adds its sampling settings to the model identity a preflight names
            run_policy = {k: v for k, v in status["behavior_policy"].items()
                          if k not in ("inference", "inference_config_sha256")}
            assert "inference_config_sha256" in status["behavior_policy"]
            assert preflight["contract"]["behavior_policy"] == run_policy


async def test_follow_failed_run_exits_1(kiln_settings: Any) -> None:
    settings = kiln_settings()
    url_down = unreachable_url()
    async with running_workers(settings, roles=("control",)):
        with serve_api(settings) as url:
            run_id = await submit(url, {**TINY_ROLLOUT, "environment_urls": [url_down]})
            followed = await cli(url, "status", run_id, "--follow", "--poll-seconds", "0.3")
            assert followed.exit_code == 1, followed.output
            assert "environment_unavailable" in followed.output
            assert f"{url_down}/health" in followed.output
            as_json = await cli(url, "status", run_id, "--follow", "--json")
            assert as_json.exit_code == 1
            assert json.loads(as_json.output)["failure"]["stage"] == "discovery"
            missing = await cli(url, "status", "00000000-0000-4000-8000-000000000000")
            assert missing.exit_code == 2 and "openenv_run_not_found" in missing.output


async def test_follow_cancelled_run_exits_3(kiln_settings: Any) -> None:
    settings = kiln_settings()
    hole = BlackHole()
    try:
        async with running_workers(settings, roles=("control",)):
            with serve_api(settings) as url:
                run_id = await submit(url, {**TINY_ROLLOUT, "environment_urls": [hole.url]})
                follower = asyncio.create_task(cli(url, "status", run_id, "--follow", "--poll-seconds", "0.3"))
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    await wait_for(http, run_id, lambda s: s["phase"] == "discovery")
                cancelled = await cli(url, "cancel", run_id)
                assert cancelled.exit_code == 0, cancelled.output
                assert f"cancellation requested for {run_id}" in cancelled.output
                followed = await asyncio.wait_for(follower, timeout=60)
                assert "cancelled" in followed.output
                assert followed.exit_code == 3, followed.output
    finally:
        hole.close()


@pytest.fixture(scope="module")
def taskbank() -> Any:
    with serve_module("examples.envs.taskbank.server") as base_url:
        yield base_url


async def test_tasks_command(kiln_settings: Any, taskbank: str) -> None:
    settings = kiln_settings()
    with serve_api(settings) as url:
        result = await cli(url, "tasks", "--environment", taskbank, "--split", "test", "--limit", "1", "--json")
        assert result.exit_code == 0, result.output
        body = json.loads(result.output)
        catalog = body["catalogs"][0]["catalog"]
        assert (catalog["selected_split"], catalog["num_tasks"], catalog["stop"]) == ("test", 2, 1)
        assert [row["id"] for row in catalog["tasks"]] == ["s0"]
        plain = await cli(url, "tasks", "--environment", taskbank)
        assert plain.exit_code == 0
        assert "split holdout (validation)" in plain.output
        bad = await cli(url, "tasks", "--environment", taskbank, "--limit", "500")
        assert bad.exit_code == 2 and "openenv_invalid_task_page" in bad.output
