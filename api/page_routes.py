"""The run pages (HTML) and the JSON they read: ``/runs``, ``/runs/{id}``, metrics, episodes.

The pages are static files in ``api/static`` (no build step, nothing fetched from a CDN); their
script reads the JSON routes with the browser's cookie (see ``api.page_access``). The JSON routes
added here are new; the existing run routes are unchanged.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import FileResponse, HTMLResponse

from api.page_data import episode_rows, page
from api.runs import checked_run_id
from api.services import Services, services
from kiln.core.errors import ArtifactNotFound
from kiln.api_models import EpisodePage, RunMetrics
from kiln.core.telemetry.live import read_events

STATIC = Path(__file__).with_name("static")
ASSETS = {
    "kiln-charts.js": "text/javascript",
    "kiln-run.js": "text/javascript",
    "kiln-runs.js": "text/javascript",
    "kiln.css": "text/css",
}
_NO_STORE = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}

router = APIRouter(tags=["pages"])
data = APIRouter(prefix="/v1/openenv/runs", tags=["runs"])


def _html(name: str) -> HTMLResponse:
    return HTMLResponse((STATIC / name).read_text(encoding="utf-8"), headers=_NO_STORE)


@router.get("/runs", include_in_schema=False)
async def runs_page() -> HTMLResponse:
    """Every run: state, adapter, mean return, promotion."""
    return _html("runs.html")


@router.get("/runs/assets/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise ArtifactNotFound(f"no page asset {name!r}")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"X-Content-Type-Options": "nosniff"})


@router.get("/runs/{run_id}", include_in_schema=False)
async def run_page(run_id: str, svc: Services = Depends(services)) -> HTMLResponse:
    """One run: timeline, curves, verdict, episodes, links."""
    await (await svc.runs()).describe(run_id)  # 404 for an unknown run
    return _html("run.html")


_checked = checked_run_id


@data.get("/{run_id}/metrics", response_model=RunMetrics)
async def run_metrics(run_id: str, svc: Services = Depends(services)) -> RunMetrics:
    """The run's live metric events so far: groups (reward curve) and training steps."""
    await (await svc.runs()).describe(_checked(run_id))
    events = await asyncio.to_thread(read_events, svc.artifacts().store, run_id)
    return RunMetrics(run_id=run_id, events=events)


@data.get("/{run_id}/episodes", response_model=EpisodePage)
async def run_episodes(
    run_id: str,
    offset: int = Query(default=0, ge=0),
    limit: int = Query(default=10, ge=1, le=100),
    svc: Services = Depends(services),
) -> dict[str, Any]:
    """Sampled episodes of a completed run, ``limit`` at a time (the reset observation, then per
    turn: reasoning, action, observation, reward)."""
    view = await (await svc.runs()).status(_checked(run_id))
    if view.manifest is None:
        raise ArtifactNotFound(
            f"run {run_id} is {view.state} and has published no episodes", hint="episodes appear when the run completes"
        )
    artifacts = svc.artifacts()
    manifest = await artifacts.manifest(run_id, view.manifest.sha256)
    rollouts = await artifacts.verified(manifest, "rollouts.jsonl")
    replay = await artifacts.verified(manifest, "replay.json")
    rows = episode_rows(b"".join(rollouts.chunks()), b"".join(replay.chunks()))
    return page(rows, offset, limit)
