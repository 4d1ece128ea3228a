"""Submit-time reachability: every environment of a run answers ``GET /health`` before queueing.

Owns the short, parallel health check the API runs before a run is started (the CLI submits
through the API, so it gets the same check; ``--no-preflight`` / ``?preflight=false`` skips it).
Every failure is one uniform ``EnvironmentUnavailable`` naming the URL — the same message whether
the port is closed, the server answers another status, or it does not answer in time — so the
check can not be used to map loopback ports and their statuses.
"""

from __future__ import annotations

import asyncio

from kiln.core.errors import EnvironmentUnavailable, KilnError
from kiln.core.openenv.credentials import prepare_token
from kiln.core.openenv.httpio import check_health, make_client
from kiln.core.openenv.urls import EnvironmentUrl

HEALTH_TIMEOUT_S = 3.0


def unavailable(url: EnvironmentUrl, timeout_s: float) -> EnvironmentUnavailable:
    """The one message for an environment that is not usable right now."""
    return EnvironmentUnavailable(
        f"environment {url.base_url} did not answer GET /health with 200 within {timeout_s:g}s",
        hint="start the environment server (or fix the URL) and submit again; "
        "--no-preflight (API: ?preflight=false) submits without this check",
        stage="admission",
        details={"base_url": url.base_url},
    )


async def _healthy(url: EnvironmentUrl, token: str | None, timeout_s: float) -> bool:
    prepared = prepare_token(url, token)  # a credential error is the caller's, not "unavailable"
    try:
        async with make_client(bearer_token=prepared, connect_timeout_s=timeout_s, timeout_s=timeout_s) as client:
            await asyncio.wait_for(
                check_health(client, url.route("/health"), timeout_s=timeout_s, connect_timeout_s=timeout_s),
                timeout_s,
            )
    except (KilnError, asyncio.TimeoutError, OSError):
        return False
    return True


async def require_healthy(
    targets: list[tuple[EnvironmentUrl, str | None]], *, timeout_s: float = HEALTH_TIMEOUT_S
) -> None:
    """Check every environment's ``/health`` in parallel; raise for the first (in order) that fails."""
    results = await asyncio.gather(*(_healthy(url, token, timeout_s) for url, token in targets))
    for (url, _token), ok in zip(targets, results, strict=True):
        if not ok:
            raise unavailable(url, timeout_s)
