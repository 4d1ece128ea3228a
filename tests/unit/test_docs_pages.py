"""``/docs`` and ``/redoc`` load offline: every script, style and icon they name is served by the
API itself (the bytes the installed asset package holds), and no page names another host."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.docs_pages import ASSETS, asset_folder
from kiln.core.settings import Settings

pytestmark = pytest.mark.asyncio
URL_ATTR = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|url:\s*["']([^"']+)["']""")


def _client(tmp_path: Path) -> httpx.AsyncClient:
    app = create_app(Settings(home=tmp_path))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("page", "expected"),
    [
        ("/docs", {"/docs-assets/swagger-ui-bundle.js", "/docs-assets/swagger-ui.css", "/docs-assets/favicon.png"}),
        ("/redoc", {"/docs-assets/redoc.standalone.js", "/docs-assets/favicon.png"}),
    ],
)
async def test_the_page_and_every_asset_it_names_load_from_this_host(
    tmp_path: Path, page: str, expected: set[str]
) -> None:
    async with _client(tmp_path) as http:
        answer = await http.get(page)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
        named = {next(group for group in match if group) for match in URL_ATTR.findall(answer.text)}
        assert "//" not in answer.text.replace("http://www.w3.org", ""), "an absolute URL is named"
        assert named - {"/openapi.json"} == expected
        for url in sorted(expected):
            asset = await http.get(url)
            name = url.rsplit("/", 1)[1]
            assert asset.status_code == 200, url
            assert asset.headers["content-type"].startswith(ASSETS[name]), url
            assert asset.content == (asset_folder() / name).read_bytes()
            assert len(asset.content) > 1000
        schema = await http.get("/openapi.json")
        assert schema.status_code == 200 and schema.json()["info"]["title"] == "Kiln"


@pytest.mark.timeout(30)
async def test_only_the_listed_assets_are_served(tmp_path: Path) -> None:
    async with _client(tmp_path) as http:
        # a file beside the assets, an unknown name, and a path out of the folder (no route matches it)
        for name, code in (("core.py", "openenv_artifact_not_found"), ("evil.js", "openenv_artifact_not_found"),
                           ("..%2F__init__.py", "not_found")):
            refused = await http.get(f"/docs-assets/{name}")
            assert refused.status_code == 404, name
            assert refused.json()["code"] == code, name
