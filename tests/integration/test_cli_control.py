"""The control CLI against a uvicorn-served API: ``status --follow`` exit codes (0 completed,
1 failed, 3 cancelled), ``runs``, ``cancel``, ``tasks`` and ``preflight``; following through a
status-query timeout, a closed pipe and an 80-column terminal."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from kiln.cli.control_cmds import register
from tests.integration.test_api_helpers import (
    NO_PREFLIGHT,
    TINY_ROLLOUT,
    BlackHole,
    serve_api,
    unreachable_url,
    wait_for,
)
from tests.support.kiln_workers import running_workers
from tests.support.servers import serve_module

ROOT = Path(__file__).resolve().parents[2]


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
            document = json.loads(listed.output)  # the API's own shape, as GET /v1/openenv/runs answers
            assert sorted(document) == ["runs", "schema"] and document["schema"] == "kiln.openenv-run-list.v1"
            runs = document["runs"]
            assert run_id in [r["run_id"] for r in runs]
            assert {r["state"] for r in runs} == {"completed"}
            plain = await cli(url, "runs")
            assert plain.exit_code == 0 and run_id[:8] in plain.output  # short ids (--wide: whole)
            wide = await cli(url, "runs", "--wide")
            assert wide.exit_code == 0 and run_id in wide.output

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
                # The follower is its own process: two CliRunners at once would share sys.stdout.
                follower = _kiln(url, ["openenv", "status", run_id, "--follow", "--poll-seconds", "0.3"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    await wait_for(http, run_id, lambda s: s["phase"] == "discovery")
                cancelled = await cli(url, "cancel", run_id)
                assert cancelled.exit_code == 0, cancelled.output
                assert f"cancellation requested for {run_id}" in cancelled.output
                out, err = await asyncio.to_thread(follower.communicate, timeout=60)
                assert "cancelled" in out
                assert follower.returncode == 3, (out, err)
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


def _kiln(url: str, args: list[str], **popen: Any) -> subprocess.Popen:
    """``kiln ARGS`` as its own process (the installed entry point's ``main``)."""
    env = {**os.environ, "KILN_API_URL": url, "PYTHONPATH": str(ROOT), "COLUMNS": "80", "TERM": "xterm-256color"}
    return subprocess.Popen([sys.executable, "-m", "kiln.cli.app", *args], env=env, cwd=ROOT, **popen)


def _to_closed_pipe(url: str, args: list[str]) -> tuple[int, bytes]:
    """``kiln ARGS | head -0``: stdout is a pipe whose reader is already gone."""
    read, write = os.pipe()
    os.close(read)
    proc = _kiln(url, args, stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def _on_a_terminal(url: str, args: list[str]) -> str:
    """``kiln ARGS`` on an 80-column pseudo-terminal: what the terminal receives."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = _kiln(url, args, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=60)
    os.close(master)
    text = b"".join(chunks).decode()
    text = re.sub(r"\x1b\]8;[^\x1b]*\x1b\\", "", text)  # hyperlink escapes
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "")


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_follow_piped_through_a_status_query_timeout_then_a_closed_pipe_and_a_terminal(
    kiln_settings: Any,
) -> None:
    """Workers stop while a piped follower watches a hung run: the API's status query times out
    (placeholder views), the follower prints no ``phase=unknown`` line and one stderr notice; the
    cancelled run then exits 3 through a closed pipe, and its terminal summary keeps links whole."""
    settings = kiln_settings()
    hole = BlackHole()
    try:
        with serve_api(settings) as url:
            async with running_workers(settings, roles=("control",)):
                run_id = await submit(url, {**TINY_ROLLOUT, "environment_urls": [hole.url]})
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    await wait_for(http, run_id, lambda s: s["phase"] == "discovery")
                follower = _kiln(url, ["openenv", "status", run_id, "--follow", "--poll-seconds", "0.3"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                first = await asyncio.to_thread(follower.stdout.readline)
                assert first.startswith("phase=discovery  groups=0/1"), first
            # No worker now: every status query waits 5 s and the API answers a placeholder.
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                placeholder = (await http.get(f"/v1/openenv/runs/{run_id}")).json()
            assert (placeholder["status_source"], placeholder["phase"], placeholder["state"]) == (
                "history", "unknown", "running")
            notice = await asyncio.to_thread(follower.stderr.readline)
            assert notice == "status query timed out, retrying\n"
            async with running_workers(settings, roles=("control",)):
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    assert (await http.post(f"/v1/openenv/runs/{run_id}/cancel")).status_code == 200
                out, err = await asyncio.to_thread(follower.communicate, timeout=90)
                assert follower.returncode == 3, (out, err)
                lines = [first.rstrip("\n"), *out.splitlines()]
                assert not [line for line in lines if "unknown" in line], lines
                assert [line for line in lines if line.startswith("phase=")][-1].startswith("phase=cancelled")
                assert err == "", err  # the one notice was read above; nothing else
                # `kiln openenv status RUN | head`: the reader is gone, the run's own code, quietly.
                code, errors = await asyncio.to_thread(_to_closed_pipe, url, ["openenv", "status", run_id])
                assert (code, errors) == (3, b"")
                code, errors = await asyncio.to_thread(_to_closed_pipe, url, ["openenv", "status", run_id, "--json"])
                assert (code, errors) == (3, b"")
                shown = (await asyncio.to_thread(_on_a_terminal, url, ["openenv", "status", run_id])).splitlines()
                ui = settings.run_ui_link(run_id)
                assert ui and f"web ui   {ui}" in shown, shown
                assert f"run page {url}/runs/{run_id}" in shown, shown
                runs = await asyncio.to_thread(_on_a_terminal, url, ["openenv", "runs"])
                assert run_id[:8] in runs and all(len(line) <= 80 for line in runs.splitlines()), runs
    finally:
        hole.close()
