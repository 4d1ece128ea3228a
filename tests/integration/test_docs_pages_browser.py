"""``/docs`` and ``/redoc`` render in a real browser with every request answered by the Kiln API
itself: the browser is cut off from every other host, and the pages still show the API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.core.settings import Settings
from tests.integration.test_api_helpers import serve_api
from tests.integration.test_run_page import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.asyncio


@pytest.mark.timeout(120)
async def test_swagger_and_redoc_render_offline(tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian chromium is missing: run scripts/setup.sh as root (apt-get install chromium)")
    from playwright.async_api import async_playwright

    with serve_api(Settings(home=tmp_path)) as base:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = await browser.new_page()
            requested: list[str] = []
            refused: list[str] = []

            async def only_this_host(route: Any) -> None:
                url = route.request.url
                requested.append(url)
                if url.startswith(base + "/"):
                    await route.continue_()
                else:
                    refused.append(url)
                    await route.abort()

            await page.route("**/*", only_this_host)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            blocked: list[str] = []  # what the pages' Content-Security-Policy refused (never requested)
            page.on("console", lambda msg: blocked.append(msg.text) if "Content Security Policy" in msg.text else None)

            await page.goto(f"{base}/docs")
            await page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
            assert "Kiln" in (await page.text_content(".swagger-ui .info .title") or "")
            assert await page.locator(".opblock-summary-path[data-path='/v1/openenv/runs']").count() >= 1

            await page.goto(f"{base}/redoc")
            await page.wait_for_selector("redoc h1", timeout=30_000)
            assert "Kiln" in (await page.text_content("redoc h1") or "")
            await browser.close()
    assert refused == [] and errors == []
    # ReDoc's bundle names its "powered by" logo on a CDN: refused by the policy, not fetched.
    assert len(blocked) >= 1 and all("cdn.redoc.ly" in line for line in blocked), blocked
    assert {f"{base}/docs-assets/swagger-ui-bundle.js", f"{base}/docs-assets/redoc.standalone.js",
            f"{base}/openapi.json"} <= set(requested)
