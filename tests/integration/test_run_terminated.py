"""A run terminated through Temporal (``temporal workflow terminate``, not Kiln's cancel) shows
state ``terminated`` with who terminated it, why and in which stage, as Temporal's history recorded
it, not ``failed`` with a failure of null: in the status, the runs list (its own filter), the
client (which raises ``run_terminated``), the CLI's outcome lines (exit code 4) and the run page."""

from __future__ import annotations

import asyncio
import getpass
import uuid
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from rich.console import Console
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from api.app import create_app
from api.runs import RunService
from kiln.cli.follow import print_outcome
from kiln.client.client import Client as KilnClient
from kiln.client.client import raise_for_outcome
from kiln.core.errors import RunTerminated
from kiln.core.settings import Settings
from kiln.devstack import temporal_binary
from tests.integration.test_api_helpers import BlackHole
from tests.support.kiln_workers import running_workers
from tests.support.servers import free_port
from workflows.names import WORKFLOW_NAME

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN = "terminated-run-token"
REASON = "cleaning up the cluster"


@pytest.mark.timeout(60)
async def test_an_unclaimed_terminated_run_names_who_and_why(temporal_server: str, tmp_path: Path) -> None:
    client = await Client.connect(temporal_server, identity="mallory@elsewhere", data_converter=pydantic_data_converter)
    run_id = str(uuid.uuid4())
    # No worker polls this queue: the run stays scheduled until it is terminated.
    handle = await client.start_workflow(WORKFLOW_NAME, {"kind": "rollout"}, id=run_id,
                                         task_queue=f"nobody-{uuid.uuid4().hex[:8]}")
    await handle.terminate(reason=REASON)
    api_client = await Client.connect(temporal_server, data_converter=pydantic_data_converter)
    service = RunService(api_client, Settings(home=tmp_path, temporal_address=temporal_server))
    view = await service.status(run_id)
    assert (view.state, view.phase) == ("terminated", "terminated")
    assert view.termination is not None
    assert view.termination.model_dump() == {"identity": "mallory@elsewhere", "reason": REASON,
                                             "stage": "orchestration"}
    assert view.failure is not None and view.failure.code == "run_terminated"
    assert view.failure.message == f"the run was terminated through Temporal by mallory@elsewhere: {REASON}"
    assert view.failure.details == {"terminated_by": "mallory@elsewhere", "reason": REASON}
    with pytest.raises(RunTerminated, match=REASON):
        raise_for_outcome(view)


async def _status(http: Any, run_id: str, done: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status = (await http.get(f"/v1/openenv/runs/{run_id}")).json()
        if done(status) or asyncio.get_running_loop().time() > deadline:
            return status
        await asyncio.sleep(0.3)


async def _page_shows(base: str, run_id: str) -> dict[str, Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"{base}/runs/{run_id}?token={TOKEN}")
            await page.wait_for_selector("body[data-loaded=true]")
            return {
                "state": await page.text_content("#state"),
                "failure": await page.text_content("#failure"),
                "ended_at": await page.locator("#timeline li.terminated").all_text_contents(),
                "done": await page.locator("#timeline li.done").all_text_contents(),
            }
        finally:
            await browser.close()


@pytest.mark.timeout(240)
async def test_a_run_terminated_with_the_temporal_cli_shows_terminated_everywhere(
    kiln_settings: Any, temporal_server: str
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian chromium is missing: run scripts/setup.sh as root (apt-get install chromium)")
    import httpx

    settings = kiln_settings(api_token=TOKEN)
    hole = BlackHole()  # the environment accepts and never answers: the run stays in discovery
    port = free_port()
    async with running_workers(settings) as client:
        server = uvicorn.Server(uvicorn.Config(create_app(settings, client=client), host="127.0.0.1", port=port,
                                               log_level="warning"))
        serving = asyncio.create_task(server.serve())
        base = f"http://127.0.0.1:{port}"
        try:
            while not server.started:
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
                run_id = (await http.post("/v1/openenv/runs", params={"preflight": "false"},
                                          json={"kind": "rollout", "environment_urls": [hole.url]})).json()["run_id"]
                assert (await _status(http, run_id, lambda s: s["phase"] == "discovery"))["phase"] == "discovery"
                cli = await asyncio.create_subprocess_exec(
                    temporal_binary(), "workflow", "terminate", "--address", temporal_server,
                    "--workflow-id", run_id, "--reason", REASON,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                out, _ = await asyncio.wait_for(cli.communicate(), 30)
                assert cli.returncode == 0, out
                status = await _status(http, run_id, lambda s: s["state"] != "running")
                listed = {state: [r for r in (await http.get("/v1/openenv/runs", params={"state": state})).json()["runs"]
                                  if r["run_id"] == run_id] for state in ("terminated", "failed")}
            # The temporal CLI records its own identity: "temporal-cli:USER@HOST".
            identity = status["termination"]["identity"]
            assert identity.startswith(f"temporal-cli:{getpass.getuser()}@"), identity
            assert (status["state"], status["phase"]) == ("terminated", "terminated")
            assert status["termination"] == {"identity": identity, "reason": REASON, "stage": "discovery"}
            assert status["failure"]["code"] == "run_terminated" and status["failure"]["stage"] == "discovery"
            assert [(r["state"], r["phase"], r["failure_code"]) for r in listed["terminated"]] == [
                ("terminated", "terminated", "run_terminated")]
            assert listed["failed"] == []

            with KilnClient(base, TOKEN) as kiln:
                view = await asyncio.to_thread(kiln.status, run_id)
                assert view.state == "terminated" and view.termination is not None
                with pytest.raises(RunTerminated, match=f"by {identity}: {REASON}"):
                    await asyncio.to_thread(kiln.wait, run_id, poll_s=0.2, timeout_s=30)
            console = Console(record=True, width=200, force_terminal=False)
            assert print_outcome(view, console) == 4
            assert f"terminated at discovery by {identity}: {REASON}" in console.export_text()

            page = await _page_shows(base, run_id)
            assert page["state"] == "terminated"
            assert page["failure"] == f"terminated through Temporal at discovery by {identity}: {REASON}"
            assert page["ended_at"] == ["discovery"] and page["done"] == ["admission"]
        finally:
            server.should_exit = True
            await serving
            hole.close()
