"""Browser access to the run pages: ``?token=`` once → HttpOnly cookie; cookie only for reads."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from api.app import create_app
from kiln.core.settings import Settings

pytestmark = pytest.mark.asyncio
TOKEN = "page-token-123"


def _client(tmp_path: Path) -> httpx.AsyncClient:
    app = create_app(Settings(home=tmp_path, api_token=TOKEN))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln.test")


@pytest.mark.timeout(30)
async def test_token_query_sets_cookie_and_redirects(tmp_path: Path) -> None:
    async with _client(tmp_path) as http:
        redirected = await http.get("/runs", params={"token": TOKEN, "state": "failed"})
        assert redirected.status_code == 303
        assert redirected.headers["location"] == "/runs?state=failed"  # the token leaves the address
        cookie = redirected.headers["set-cookie"]
        assert cookie == f"kiln_token={TOKEN}; HttpOnly; SameSite=Strict; Path=/"

        http.cookies.clear()
        assert (await http.get("/runs")).status_code == 401  # no cookie, no header
        page = await http.get("/runs", headers={"cookie": f"kiln_token={TOKEN}"})
        assert page.status_code == 200 and "<table id=\"runs\">" in page.text
        assert page.headers["content-type"].startswith("text/html")
        asset = await http.get("/runs/assets/kiln-charts.js", headers={"cookie": f"kiln_token={TOKEN}"})
        assert asset.status_code == 200 and "lineChart" in asset.text
        assert asset.headers["content-type"].startswith("text/javascript")
        missing = await http.get("/runs/assets/evil.js", headers={"cookie": f"kiln_token={TOKEN}"})
        assert missing.status_code == 404 and missing.json()["code"] == "openenv_artifact_not_found"

        wrong = await http.get("/runs", headers={"cookie": "kiln_token=nope"})
        assert wrong.status_code == 401 and wrong.json()["code"] == "unauthorized"
        # A state-changing request never rides on the cookie.
        cancel = await http.post("/v1/openenv/runs/00000000-0000-4000-8000-000000000000/cancel",
                                 headers={"cookie": f"kiln_token={TOKEN}"})
        assert cancel.status_code == 401
