"""``create_app(settings)``: the REST facade. Routes stay thin; errors use the KilnError codes."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from api.runs import RunService
from kiln.contracts import parse_run_request
from kiln.errors import InvalidRequest, KilnError
from kiln.openenv.discovery import inspect_environment
from kiln.openenv.urls import normalize_url, require_allowed_host
from kiln.settings import Settings
from workers.factory import connect_client

MAX_BODY_BYTES = 1024 * 1024


def error_response(error: KilnError) -> JSONResponse:
    return JSONResponse(status_code=error.http_status, content=error.to_dict())


async def read_json(request: Request) -> Any:
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise InvalidRequest("request body is larger than 1 MiB")
    try:
        import json

        return json.loads(body or b"null")
    except ValueError:
        raise InvalidRequest("request body is not valid JSON") from None


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = await connect_client(settings)
        app.state.runs = RunService(client, settings)
        yield

    app = FastAPI(title="Kiln", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(KilnError)
    async def _kiln_error(_request: Request, error: KilnError) -> JSONResponse:
        return error_response(error)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/openenv/runs")
    async def create_run(request: Request) -> JSONResponse:
        run_request = parse_run_request(await read_json(request))
        for url in run_request.environment_urls:
            require_allowed_host(normalize_url(url), allow_remote=settings.allow_remote_environments)
        status, created = await request.app.state.runs.submit(run_request)
        return JSONResponse(status_code=202 if created else 200, content=status)

    @app.get("/v1/openenv/runs")
    async def list_runs(request: Request) -> dict[str, Any]:
        return {"runs": await request.app.state.runs.list_runs()}

    @app.get("/v1/openenv/runs/{run_id}")
    async def get_run(run_id: str, request: Request) -> dict[str, Any]:
        return await request.app.state.runs.status(run_id)

    @app.post("/v1/openenv/runs/{run_id}/cancel")
    async def cancel_run(run_id: str, request: Request) -> dict[str, Any]:
        return await request.app.state.runs.cancel(run_id)

    @app.post("/v1/openenv/inspect")
    async def inspect(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise InvalidRequest("body must be an object with environment_urls")
        urls = body.get("environment_urls") or body.get("environments")
        if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
            raise InvalidRequest("environment_urls: give 1-64 environment URLs")
        inspections = []
        for url in urls:
            normalized = normalize_url(url)
            require_allowed_host(normalized, allow_remote=settings.allow_remote_environments)
            inspections.append(await inspect_environment(normalized))
        return {"schema": "kiln.openenv-inspection.v1", "environments": inspections}

    return app


def app_from_env() -> FastAPI:
    """uvicorn factory: ``uvicorn --factory api.app:app_from_env``."""
    from kiln.settings import load_settings

    return create_app(load_settings())
