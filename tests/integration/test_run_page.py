"""The run pages in a real headless Chromium (Debian's, driven by Playwright).

A completed train run (with a paired evaluation, KL off, behind a slow WebSocket link so episode
latencies have four digits), a completed rollout (not evaluated), a failed run and a cancelled
run; the API is served over real HTTP with a bearer token, the browser authenticates once with
``?token=``. Every chart's y-axis labels lie inside their SVG, with round tick values.
Takes a screenshot of the run page; with KILN_UPDATE_SCREENSHOT=1 it becomes docs/run-page.png (the
screenshot in docs/operations.md), otherwise it goes to the test's temporary folder.
"""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from api.app import create_app
from tests.integration.test_api_helpers import BlackHole, unreachable_url
from tests.support.gated_proxy import GatedProxy
from tests.support.kiln_workers import running_workers
from tests.support.servers import free_port

pytestmark = pytest.mark.asyncio

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN = "run-page-test-token"
SLOW_WS_S = 0.5  # per environment answer: the upgrade and the reset alone make every wave last over a second (four-digit latencies)
ROLLOUT = {"kind": "rollout", "groups": 1, "group_size": 2, "max_steps": 2, "max_action_tokens": 16}
# Every y tick label of every chart: its box against its SVG's box (page pixels).
YTICK_BOXES = """() => [...document.querySelectorAll('svg')].flatMap(svg => {
  const outer = svg.getBoundingClientRect();
  return [...svg.querySelectorAll('text.ytick')].map(t => {
    const r = t.getBoundingClientRect();
    return {chart: svg.getAttribute('aria-label'), text: t.textContent, left: r.left - outer.left,
            right: outer.right - r.right, top: r.top - outer.top, bottom: outer.bottom - r.bottom};
  });
})"""


def _round_ticks(labels: list[str]) -> float:
    """The step of evenly spaced y ticks that are multiples of 1, 2 or 5 × 10^k (else fails)."""
    values = [float(label) for label in labels]
    steps = {round(b - a, 9) for a, b in zip(values, values[1:])}
    assert len(values) >= 2 and len(steps) == 1, labels
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert round(mantissa, 6) in (1.0, 2.0, 5.0), labels
    assert all(abs(v / step - round(v / step)) < 1e-6 for v in values), labels
    return step
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "run-page.png"
TRAIN = {
    "kind": "train",
    "groups": 3,
    "group_size": 3,
    "max_steps": 3,
    "max_action_tokens": 32,
    "output_adapter": "paged",
    "training_config": {"epochs": 3, "lora_rank": 4, "lora_alpha": 8, "kl_coeff": 0.0},
    "environment_eval": {"groups": 2, "group_size": 2},
}
# A 2-iteration online run: the page's iteration table shows each iteration's KL figures.
ONLINE = {
    "kind": "train",
    "groups": 3,
    "group_size": 3,
    "max_steps": 3,
    "max_action_tokens": 32,
    "iterations": 2,
    "output_adapter": "paged-online",
    "training_config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8},
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
    import httpx
    from playwright.async_api import async_playwright

    settings = kiln_settings(api_token=TOKEN)
    hole = BlackHole()
    slow = GatedProxy(counter_env_url, ws_delay_s=SLOW_WS_S)
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
                trained = (await http.post("/v1/openenv/runs", json={**TRAIN, "environment_urls": [slow.url]})).json()
                sampled = (await http.post("/v1/openenv/runs", json={**ROLLOUT, "environment_urls": [counter_env_url]})).json()
                online = (await http.post("/v1/openenv/runs", json={**ONLINE, "environment_urls": [counter_env_url]})).json()
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
                assert (await _wait(http, sampled["run_id"], ("completed", "failed")))["state"] == "completed"
                done_online = await _wait(http, online["run_id"], ("completed", "failed"))
                assert done_online["state"] == "completed", done_online.get("failure")
                episodes = (await http.get(f"/v1/openenv/runs/{trained['run_id']}/episodes?limit=100")).json()
                events = (await http.get(f"/v1/openenv/runs/{trained['run_id']}/metrics")).json()["events"]
                # Without the token, neither a page nor its data is served.
                async with httpx.AsyncClient(base_url=base, timeout=30) as anonymous:
                    assert (await anonymous.get(f"/runs/{trained['run_id']}")).status_code == 401
            assert episodes["total"] == 9
            steps = done["training"]["steps"]
            latencies = [e["episode_latency_ms"] for e in events if e["kind"] == "group" and e["label"] == "group"]
            assert len(latencies) == 3 and min(latencies) >= 1000, latencies  # every wave has four digits
            train_steps = [e for e in events if e["kind"] == "train_step"]
            assert len(train_steps) == steps and all(e["kl"] is None for e in train_steps)  # KL off

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
                # KL is off: the chart says so instead of drawing zeros.
                assert await page.locator("#chart-kl circle.pt").count() == 0
                assert await page.text_content("#chart-kl svg") == "KL off"
                assert await page.locator("#chart-env-ce circle.pt").count() == steps
                assert await page.locator("#chart-reward circle.pt").count() == 3
                assert await page.locator("#paired tbody tr").count() == 2
                assert "decision" in (await page.text_content("#verdict") or "")
                assert await page.locator("#artifacts a").count() == len(done["artifacts"])
                assert await page.get_attribute("#temporal-link", "href") == done["temporal_ui"]
                assert ("not promoted" if not done["promoted"] else "promoted") in (await page.text_content("#summary") or "")
                assert await page.is_hidden("#iterations-section")  # one iteration: no iteration table

                # No y label is clipped (each lies inside its chart), and the ticks are round.
                boxes = await page.evaluate(YTICK_BOXES)
                charts = {box["chart"] for box in boxes}
                assert {"mean return", "episode latency (ms)", "loss", "env-CE (ECHO)", "grad norm"} <= charts
                for box in boxes:
                    assert min(box["left"], box["right"], box["top"], box["bottom"]) >= 0, box
                latency_labels = [b["text"] for b in boxes if b["chart"] == "episode latency (ms)"]
                step = _round_ticks(latency_labels)
                assert float(latency_labels[0]) <= min(latencies) and float(latency_labels[-1]) >= max(latencies)
                assert float(latency_labels[-1]) - float(latency_labels[0]) <= 8 * step
                assert max(len(label) for label in latency_labels) >= 4
                for chart in charts - {"KL"}:
                    _round_ticks([b["text"] for b in boxes if b["chart"] == chart])

                # Episodes read forwards: the reset observation, then reasoning → action → observation → reward.
                headers = await page.locator("#episodes thead th").all_text_contents()
                assert headers == ["group", "cand.", "turn", "reasoning", "action", "observation", "reward"]
                rows = page.locator("#episodes tbody tr")
                reset_cells = await rows.nth(0).locator("td").all_text_contents()
                first_episode = episodes["episodes"][0]
                assert reset_cells[2] == "reset" and reset_cells[5] == first_episode["reset_observation"]
                turn_cells = await rows.nth(1).locator("td").all_text_contents()
                first_turn = first_episode["turns"][0]
                assert turn_cells[2:6] == ["1", first_turn["reasoning"], first_turn["action"], first_turn["observation"]]

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

                # An online run: one row per iteration with its policy drift (KL to previous and to base).
                await page.goto(f"{base}/runs/{online['run_id']}")
                await page.wait_for_selector("body[data-loaded=true]")
                assert await page.is_visible("#iterations-section")
                rows = page.locator("#iterations tbody tr")
                assert await rows.count() == 2
                for n, record in enumerate(done_online["iterations"]):
                    cells = await rows.nth(n).locator("td").all_text_contents()
                    assert cells[0] == f"{record['iteration']} of 2" and int(cells[4]) == record["steps"] > 0
                    assert record["kl_to_previous"] is not None and record["kl_to_base"] is not None
                    assert float(cells[5]) == pytest.approx(record["kl_to_previous"], rel=1e-3, abs=1e-9)
                    assert float(cells[6]) == pytest.approx(record["kl_to_base"], rel=1e-3, abs=1e-9)
                    assert cells[8] == record["adapter_sha256"][:19] + "…"

                # A failed and a cancelled run render their state and the stage they ended in.
                await page.goto(f"{base}/runs/{failed['run_id']}")
                await page.wait_for_selector("body[data-loaded=true]")
                assert await page.text_content("#state") == "failed"
                assert "environment_unavailable at discovery" in (await page.text_content("#failure") or "")
                assert await page.get_attribute("#timeline li.failed", "data-stage") == "discovery"
                # Figures that will never come are not "no data yet" on an ended run.
                body = await page.text_content("body") or ""
                assert "no data yet" not in body and "appear when" not in body
                assert "none: the run failed without one" in (await page.text_content("#chart-reward") or "")
                assert await page.text_content("#episodes-note") == "no episodes: the run failed without publishing any"
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
                assert cells[5] == ("yes" if done["promoted"] else "no")  # evaluated, so a decision
                for other, state in ((failed, "failed"), (hung, "cancelled")):
                    other_row = page.locator(f"#runs tbody tr[data-run-id='{other['run_id']}'] td").nth(1)
                    assert await other_row.text_content() == state
                failed_row = page.locator(f"#runs tbody tr[data-run-id='{failed['run_id']}']")
                assert await failed_row.locator("td.failure-code").text_content() == "environment_unavailable"
                sampled_row = page.locator(f"#runs tbody tr[data-run-id='{sampled['run_id']}']")
                assert await sampled_row.locator("td.promoted").text_content() == "not evaluated"
                await page.screenshot(path=str(tmp_path / "runs-index.png"), full_page=True)
                await browser.close()
            assert errors == []
        finally:
            server.should_exit = True
            await serving
            hole.close()
            slow.close()
