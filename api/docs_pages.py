"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) served with their assets from this host: the pages
work offline, nothing is fetched from a CDN or a font service.

The assets are the files the ``fastapi-offline`` package ships (Swagger UI's bundle and styles,
ReDoc's standalone bundle, the favicon); FastAPI's own page builders point at them here.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from kiln.core.errors import ArtifactNotFound

ASSET_PREFIX = "/docs-assets"
# The pages may load from this host only: ReDoc's bundle names its "powered by" logo on a CDN,
# which this policy refuses before any request leaves the browser. Both pages start from an
# inline script, ReDoc styles inline and runs its search in a blob worker.
POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; worker-src 'self' blob:; font-src 'self' data:; connect-src 'self'"
)
_PAGE_HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff"}
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}


def asset_folder() -> Path:
    """Where the installed ``fastapi-offline`` package keeps the assets."""
    return Path(str(files("fastapi_offline") / "static"))


def install_docs_pages(app: FastAPI) -> None:
    """Add the two pages and their asset route to ``app`` (created with ``docs_url=None``,
    ``redoc_url=None``, so FastAPI's CDN pages are not there)."""
    router = APIRouter(include_in_schema=False)
    openapi_url = app.openapi_url or "/openapi.json"
    favicon = f"{ASSET_PREFIX}/favicon.png"

    @router.get("/docs")
    async def swagger_page() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{ASSET_PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSET_PREFIX}/swagger-ui.css",
            swagger_favicon_url=favicon,
        )
        page.headers.update(_PAGE_HEADERS)
        return page

    @router.get("/redoc")
    async def redoc_page() -> HTMLResponse:
        page = get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{ASSET_PREFIX}/redoc.standalone.js",
            redoc_favicon_url=favicon,
            with_google_fonts=False,
        )
        page.headers.update(_PAGE_HEADERS)
        return page

    @router.get(ASSET_PREFIX + "/{name}")
    async def docs_asset(name: str) -> FileResponse:
        if name not in ASSETS:  # a fixed list: no path from the URL reaches the file system
            raise ArtifactNotFound(f"no docs asset {name!r}")
        return FileResponse(
            asset_folder() / name,
            media_type=ASSETS[name],
            headers={"Cache-Control": "max-age=86400", "X-Content-Type-Options": "nosniff"},
        )

    app.include_router(router)
