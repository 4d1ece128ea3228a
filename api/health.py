"""``GET /healthz``: the API is up (always 200 while it answers), and how each component is.

``components.temporal.exposure`` is, under ``kiln serve`` with the embedded Temporal dev server,
``owner_only`` (it runs in a namespace of its own, reached by the home's owner only) or
``open_to_local_users`` (no namespace here or ``KILN_TEMPORAL_ISOLATION=off``: any local user
reaches it); absent with a Temporal of the user's own.
``components`` holds, under ``kiln serve``, every supervised child as serve last wrote it to
``<home>/run/serve.json`` (state, restarts, last exit; the PIDs stay in that 0600 file, since
``/healthz`` answers without a token), and always ``temporal`` and ``s3`` as this API
process sees them right now (``connection``: ``reachable`` / ``unreachable``, each checked by one
real request within 2 s, concurrently: Temporal's health check, S3's ``HeadBucket``). ``status``
is ``ok`` when every component is running/reachable, else ``degraded``.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from api.services import Services
from kiln.core.artifacts.outage import probe

TEMPORAL_CHECK = timedelta(seconds=1)
TEMPORAL_CHECK_BUDGET_S = 2.0  # connecting included: /healthz answers within ~2 s whatever happens
S3_CHECK_S = 1.0  # connect and read timeout of the one HeadBucket (a frozen store: unreachable)


def _serve_state(home: Path) -> dict[str, Any]:
    try:
        found = json.loads((Path(home) / "run" / "serve.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def supervised_components(home: Path) -> dict[str, dict[str, Any]]:
    """The children ``kiln serve`` supervises (``{}`` when this API does not run under serve)."""
    found = _serve_state(home)
    components = found.get("components")
    if not isinstance(components, dict):
        return {}
    return {
        str(name): {key: value for key, value in item.items() if key != "pid"}
        for name, item in components.items()
        if isinstance(item, dict)
    }


async def _check(svc: Services) -> bool:
    client = await svc.client()
    return bool(await client.service_client.check_health(timeout=TEMPORAL_CHECK))


async def temporal_reachable(svc: Services) -> bool:
    try:
        return await asyncio.wait_for(_check(svc), TEMPORAL_CHECK_BUDGET_S)
    except Exception:  # noqa: BLE001 - any failure (a KilnError included) means "not reachable now"
        return False


async def s3_connection(svc: Services) -> str:
    """``reachable`` / ``unreachable``: one bounded HeadBucket of the API's store."""
    try:
        store = svc.artifacts().store
        return await asyncio.wait_for(asyncio.to_thread(probe, store, timeout_s=S3_CHECK_S), TEMPORAL_CHECK_BUDGET_S)
    except Exception:  # noqa: BLE001 - no store (bad settings) or no answer in time
        return "unreachable"


async def health(svc: Services) -> dict[str, Any]:
    components: dict[str, dict[str, Any]] = dict(supervised_components(svc.settings.home))
    reachable, s3 = await asyncio.gather(temporal_reachable(svc), s3_connection(svc))
    temporal = dict(components.get("temporal") or {})
    temporal["connection"] = "reachable" if reachable else "unreachable"
    exposure = _serve_state(svc.settings.home).get("temporal_exposure")
    if isinstance(exposure, str):  # the embedded Temporal under serve: who else can reach it
        temporal["exposure"] = exposure
    components["temporal"] = temporal
    components["s3"] = {"connection": s3}
    healthy = (
        reachable
        and s3 == "reachable"
        and all(item.get("state", "running") == "running" for item in components.values())
    )
    return {"status": "ok" if healthy else "degraded", "components": components}
