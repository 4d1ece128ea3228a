"""``GET /metrics``: Prometheus exposition of the API process (same bearer token as the API).

Before each scrape the run gauges are refreshed from Temporal's visibility store: runs by
state, and the queue depth (running runs whose phase is the ``queue`` stage).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.runs import RUN_STATES, RUNS_QUERY
from kiln.core.search_attributes import PHASE
from api.services import Services, services
from kiln.core.telemetry import prometheus as prom
from workers.metrics import exposition

router = APIRouter(tags=["health"])


@router.get("/metrics", include_in_schema=False)
async def metrics(svc: Services = Depends(services)) -> Response:
    client = await svc.client()
    try:
        for state, condition in RUN_STATES.items():
            prom.RUNS.labels(state=state).set((await client.count_workflows(f"{RUNS_QUERY} AND {condition}")).count)
        # Runs waiting in the FIFO run queue: their phase is the "queue" stage.
        queued = f"{RUNS_QUERY} AND ExecutionStatus = 'Running' AND {PHASE} = 'queue'"
        prom.QUEUE_DEPTH.set((await client.count_workflows(queued)).count)
    except Exception:  # noqa: BLE001 - visibility down: serve the last values, never a 500
        pass
    return Response(exposition(svc.temporal_metrics), media_type=CONTENT_TYPE_LATEST)
