"""The run pages in a real headless Chromium (Debian's, driven by Playwright).

A completed train run (with a paired evaluation), a failed run and a cancelled run; the API is
served over real HTTP with a bearer token, the browser authenticates once with ``?token=``.
Takes a screenshot of the run page; with KILN_UPDATE_SCREENSHOT=1 it becomes docs/run-page.png (the
README's screenshot), otherwise it goes to the test's temporary folder.
"""

from __future__ import annotations

import os

import asyncio
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from api.app import create_app
from tests.integration.test_api_helpers import BlackHole, unreachable_url
from tests.support.kiln_workers import running_workers
from tests.support.servers import free_port

pytestmark = pytest.mark.asyncio

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN = "run-page-test-token"
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "run-page.png"
TRAIN = {
    "kind": "train",
    "groups": 3,
    "group_size": 3,
    "max_steps": 3,
    "max_action_tokens": 32,
    "output_adapter": "paged",
    "training_config": {"epochs": 3, "lora_rank": 4, "lora_alpha": 8},
    "environment_eval": {"groups": 2, "group_size": 2},
}


async def _wait(http: Any, run_id: str, states: tuple[str, ...], timeout_s: float = 240.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status = (await http.get(f"/v1/openenv/runs/{run_id}")).json()
        if status.get("state") in states or asyncio.get_running_loop().time() > deadline:
            return status
        await asyncio.sleep(0.3)


@pytest.mark.timeout(600)
async def test_run_pages_in_a_real_browser(kiln_settings: Any, counter_env_url: str, tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian chromium is missing: run scripts/setup.sh as root (apt-get install chromium)")
    from playwright.async_api import async_playwright

    import httpx

    settings = kiln_settings(api_token=TOKEN)
    hole = BlackHole()
    port = free_port()
    async with running_workers(settings) as client:
        app = create_app(settings, client=client)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        base = f"http://127.0.0.1:{port}"
        try:
            while not server.started:
                await asyncio.sleep(0.05)
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as http:
                trained = (await http.post("/v1/openenv/runs", json={**TRAIN, "environment_urls": [counter_env_url]})).json()
                # Past the submit-time health check (preflight=false), so both fail or hang in the workflow.
                failed = (await http.post("/v1/openenv/runs", params={"preflight": "false"},
                                          json={"kind": "rollout", "environment_urls": [unreachable_url()]})).json()
                hung = (await http.post("/v1/openenv/runs", params={"preflight": "false"},
                                        json={"kind": "rollout", "environment_urls": [hole.url]})).json()
                await _wait(http, hung["run_id"], ("running",))
                while (await http.get(f"/v1/openenv/runs/{hung['run_id']}")).json()["phase"] != "discovery":
                    await asyncio.sleep(0.2)
                assert (await http.post(f"/v1/openenv/runs/{hung['run_id']}/cancel")).status_code == 200
                done = await _wait(http, trained["run_id"], ("completed", "failed", "cancelled"))
                assert done["state"] == "completed", done.get("failure")
                assert (await _wait(http, failed["run_id"], ("failed",)))["state"] == "failed"
                assert (await _wait(http, hung["run_id"], ("cancelled",)))["state"] == "cancelled"
                episodes = (await http.get(f"/v1/openenv/runs/{trained['run_id']}/episodes?limit=100")).json()
                # Without the token, neither a page nor its data is served.
                async with httpx.AsyncClient(base_url=base, timeout=30) as anonymous:
                    assert (await anonymous.get(f"/runs/{trained['run_id']}")).status_code == 401
            assert episodes["total"] == 9
            steps = done["training"]["steps"]

            async with async_playwright() as pw:
                browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = await browser.new_page(viewport={"width": 1200, "height": 900})
                errors: list[str] = []
                page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
                page.on("pageerror", lambda exc: errors.append(str(exc)))

                # Once with ?token=: redirected to the bare address, the cookie carries on.
                await page.goto(f"{base}/runs/{trained['run_id']}?token={TOKEN}")
                assert page.url == f"{base}/runs/{trained['run_id']}"
                await page.wait_for_selector("body[data-loaded=true]")
                await page.wait_for_selector("#page-info:has-text('of 9')")
                assert await page.text_content("#state") == "completed"
                assert await page.locator("#timeline li.done").count() == 7
                loss_points = page.locator("#chart-loss g.series[data-name='loss'] circle.pt")
                assert await loss_points.count() == steps
                assert await page.locator("#chart-kl circle.pt").count() == steps
                assert await page.locator("#chart-env-ce circle.pt").count() == steps
                assert await page.locator("#chart-reward circle.pt").count() == 3
                assert await page.locator("#paired tbody tr").count() == 2
                assert "decision" in (await page.text_content("#verdict") or "")
                assert await page.locator("#artifacts a").count() == len(done["artifacts"])
                assert await page.get_attribute("#temporal-link", "href") == done["temporal_ui"]

                # Paging: 5 episodes, then the remaining 4.
                assert await page.text_content("#page-info") == "episodes 1–5 of 9"
                first = await page.locator("#episodes tbody tr").first.get_attribute("data-episode")
                SCREENSHOT.parent.mkdir(exist_ok=True)
                shot = SCREENSHOT if os.environ.get("KILN_UPDATE_SCREENSHOT") == "1" else tmp_path / "run-page.png"
                await page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000  # a real rendering, not an empty page
                await page.click("#next")
                await page.wait_for_selector("#page-info:has-text('episodes 6–9 of 9')")
                shown = await page.locator("#episodes tbody tr").evaluate_all(
                    "rows => [...new Set(rows.map(r => r.dataset.episode))]")
                assert len(shown) == 4 and first not in shown
                assert await page.is_disabled("#next") and not await page.is_disabled("#prev")
                turn = episodes["episodes"][5]["turns"][0]
                assert turn["action"] in (await page.text_content("#episodes tbody") or "")

                # A failed and a cancelled run render their state and the stage they ended in.
                await page.goto(f"{base}/runs/{failed['run_id']}")
                await page.wait_for_selector("body[data-loaded=true]")
                assert await page.text_content("#state") == "failed"
                assert "environment_unavailable" in (await page.text_content("#failure") or "")
                assert await page.get_attribute("#timeline li.failed", "data-stage") == "discovery"
                await page.goto(f"{base}/runs/{hung['run_id']}")
                await page.wait_for_selector("body[data-loaded=true]")
                assert await page.text_content("#state") == "cancelled"
                assert await page.get_attribute("#timeline li.cancelled", "data-stage") == "discovery"

                # The index lists all three with state, adapter and mean return.
                await page.goto(f"{base}/runs")
                await page.wait_for_selector("#runs tbody tr")
                row = page.locator(f"#runs tbody tr[data-run-id='{trained['run_id']}']")
                cells = await row.locator("td").all_text_contents()
                assert cells[1:4] == ["completed", "train", "paged"]
                assert float(cells[4]) == pytest.approx(done["mean_return"], rel=1e-3)
                for other, state in ((failed, "failed"), (hung, "cancelled")):
                    other_row = page.locator(f"#runs tbody tr[data-run-id='{other['run_id']}'] td").nth(1)
                    assert await other_row.text_content() == state
                await browser.close()
            assert errors == []
        finally:
            server.should_exit = True
            await serving
            hole.close()
