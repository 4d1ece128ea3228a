"""``GET /healthz``: the API is up (always 200 while it answers), and how each component is.

``components`` holds, under ``kiln serve``, every supervised child as serve last wrote it to
``<home>/run/serve.json`` (state, restarts, last exit; the PIDs stay in that 0600 file, since
``/healthz`` answers without a token), and always ``temporal`` as this API
process sees it right now (``connection``: ``reachable`` / ``unreachable``, checked within 2 s). ``status`` is ``ok``
when every component is running/reachable, else ``degraded``.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from api.services import Services

TEMPORAL_CHECK = timedelta(seconds=1)
TEMPORAL_CHECK_BUDGET_S = 2.0  # connecting included: /healthz answers within ~2 s whatever happens


def supervised_components(home: Path) -> dict[str, dict[str, Any]]:
    """The children ``kiln serve`` supervises (``{}`` when this API does not run under serve)."""
    try:
        found = json.loads((Path(home) / "run" / "serve.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    components = found.get("components") if isinstance(found, dict) else None
    if not isinstance(components, dict):
        return {}
    return {
        str(name): {key: value for key, value in item.items() if key != "pid"}
        for name, item in components.items() if isinstance(item, dict)
    }


async def _check(svc: Services) -> bool:
    client = await svc.client()
    return bool(await client.service_client.check_health(timeout=TEMPORAL_CHECK))


async def temporal_reachable(svc: Services) -> bool:
    try:
        return await asyncio.wait_for(_check(svc), TEMPORAL_CHECK_BUDGET_S)
    except Exception:  # noqa: BLE001 - any failure (a KilnError included) means "not reachable now"
        return False


async def health(svc: Services) -> dict[str, Any]:
    components: dict[str, dict[str, Any]] = dict(supervised_components(svc.settings.home))
    reachable = await temporal_reachable(svc)
    temporal = dict(components.get("temporal") or {})
    temporal["connection"] = "reachable" if reachable else "unreachable"
    components["temporal"] = temporal
    healthy = reachable and all(
        item.get("state", "running") == "running" for item in components.values()
    )
    return {"status": "ok" if healthy else "degraded", "components": components}
