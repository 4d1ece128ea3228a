"""``/v1/openenv/runs``: submit (exactly once per idempotency key), list, status, cancel, artifacts."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.artifacts import artifact_headers
from api.errors import ERROR_RESPONSES
from api.services import Services, services
from kiln.core.contracts import RunRequest
from kiln.api_models import RunManifest
from kiln.core.run_view import RunList, RunView
from kiln.core.served_models import require_served
from kiln.core.errors import ArtifactNotFound
from kiln.core.openenv.credential_config import resolve_bearer_token
from kiln.core.openenv.reachability import require_healthy
from kiln.core.openenv.urls import normalize_url, require_allowed_host

router = APIRouter(prefix="/v1/openenv/runs", tags=["runs"])

ERRORS = {**ERROR_RESPONSES, 404: {**ERROR_RESPONSES[404], "description": "run not found"}}
BINARY = {"schema": {"type": "string", "format": "binary"}}
# What an artifact body is, per manifest media type: JSON artifacts are JSON objects, JSONL ones text.
ARTIFACT_CONTENT = {
    "application/octet-stream": BINARY,
    "application/json": {"schema": {"type": "object"}},
    "application/x-ndjson": {"schema": {"type": "string", "description": "one JSON document per line"}},
}


@router.post(
    "",
    status_code=202,
    response_model=RunView,
    responses={200: {"description": "idempotent replay", "model": RunView}, **ERRORS},
)
async def create_run(
    request: RunRequest,
    preflight: bool = Query(
        default=True,
        description="Check every environment's /health (3 s, in parallel) before queueing; false skips it.",
    ),
    svc: Services = Depends(services),
) -> JSONResponse:
    """Start a run: 202 with the new run's status, 200 with the existing run's status when the
    same ``idempotency_key`` is retried with the identical request, 409 when it differs.
    A ``model`` the workers do not serve is refused (400 ``model_not_served``, naming the served
    models and the default), and so is an environment that does not answer ``/health`` (502
    ``environment_unavailable``), before anything is queued."""
    require_served(
        request.model, svc.settings.models_dir, default=svc.settings.default_model_path.name, engine=svc.settings.engine
    )
    urls = [normalize_url(text) for text in request.environment_urls]
    for url in urls:
        require_allowed_host(url, allow_remote=svc.settings.allow_remote_environments)
    if preflight:
        credentials = request.credential_ids or [None] * len(urls)
        await require_healthy(
            [
                (url, resolve_bearer_token(svc.settings.credentials or {}, credential, url))
                for url, credential in zip(urls, credentials, strict=True)
            ]
        )
    view, created = await (await svc.runs()).submit(request)
    if view.kind is None:  # the workflow has not answered its first query yet
        view.kind = request.kind
    return view_response(view, created)


@router.get("", response_model=RunList)
async def list_runs(
    state: str | None = Query(default=None, description="running | completed | failed | cancelled | terminated"),
    svc: Services = Depends(services),
) -> RunList:
    """Runs newest first: ``{schema, runs: [{run_id, state, phase, kind, ...}]}``."""
    return await (await svc.runs()).list_runs(state)


@router.get("/{run_id}", response_model=RunView, responses=ERRORS)
async def get_run(run_id: str, svc: Services = Depends(services)) -> RunView:
    """The run's status (phase, progress, returns, training, manifest, artifacts, failure)."""
    return await (await svc.runs()).status(run_id)


@router.post("/{run_id}/cancel", response_model=RunView, responses=ERRORS)
async def cancel_run(run_id: str, svc: Services = Depends(services)) -> RunView:
    """Request cancellation of a running run (409 ``openenv_run_not_cancellable`` when it ended)."""
    return await (await svc.runs()).cancel(run_id)


@router.delete("/{run_id}", response_model=RunView, responses=ERRORS)
async def delete_run(run_id: str, svc: Services = Depends(services)) -> RunView:
    """Same as ``POST /{run_id}/cancel``."""
    return await (await svc.runs()).cancel(run_id)


def view_response(view: RunView, created: bool) -> JSONResponse:
    """202 with a new run's view, 200 with the existing run's (an idempotent replay)."""
    return JSONResponse(status_code=202 if created else 200, content=view.model_dump(mode="json", by_alias=True))


async def _published_manifest(run_id: str, svc: Services) -> Any:
    view = await (await svc.runs()).status(run_id)
    recorded = view.manifest.sha256 if view.manifest is not None else None
    if view.state != "completed" and recorded is None:
        raise ArtifactNotFound(
            f"run {run_id} is {view.state} and has published no artifacts",
            hint="artifacts appear when the run completes",
        )
    return await svc.artifacts().manifest(run_id, recorded)


@router.get("/{run_id}/artifacts", response_model=RunManifest, responses=ERRORS)
async def get_manifest(run_id: str, svc: Services = Depends(services)) -> Response:
    """The run's manifest, byte for byte as published (ETag = its SHA-256)."""
    manifest = await _published_manifest(run_id, svc)
    return Response(
        content=manifest.raw,
        media_type="application/json",
        headers={
            "ETag": f'"{manifest.sha256}"',
            "Cache-Control": "private, no-store",
            "X-Content-Type-Options": "nosniff",
        },
    )


@router.get(
    "/{run_id}/artifacts/{name:path}",
    response_class=StreamingResponse,
    responses={
        200: {"description": "the artifact's bytes (media type from the manifest)", "content": ARTIFACT_CONTENT},
        **ERRORS,
    },
)
async def get_artifact(run_id: str, name: str, svc: Services = Depends(services)) -> StreamingResponse:
    """One manifest-declared artifact, verified (size + SHA-256) before the first byte is sent."""
    manifest = await _published_manifest(run_id, svc)
    artifact = await svc.artifacts().verified(manifest, name)
    return StreamingResponse(
        artifact.chunks(),
        status_code=200,
        media_type=artifact.entry["media_type"],
        headers=artifact_headers(run_id, artifact.entry),
    )
