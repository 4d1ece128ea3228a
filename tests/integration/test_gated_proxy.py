"""The test proxy's slow WebSocket mode delays what Kiln's real session reads, not its health probe.

Kiln probes ``/health`` and then upgrades the same socket to ``/ws``; the proxy must notice the
upgrade request on that socket (a per-connection check of the first request alone never fires).
"""

from __future__ import annotations

import time

import httpx
import pytest

from kiln.core.openenv.session import EnvSession
from tests.support.gated_proxy import GatedProxy

pytestmark = pytest.mark.asyncio
DELAY_S = 2.0


@pytest.mark.timeout(60)
async def test_slow_proxy_delays_the_upgraded_session_and_not_health(counter_env_url: str) -> None:
    proxy = GatedProxy(counter_env_url, ws_delay_s=DELAY_S)
    try:
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(f"{proxy.url}/health")).status_code == 200
        health_s = time.monotonic() - started

        started = time.monotonic()
        session = await EnvSession.open(proxy.url)
        opened_s = time.monotonic() - started
        try:
            started = time.monotonic()
            result = await session.reset({"seed": 3})
            reset_s = time.monotonic() - started
        finally:
            await session.close()
    finally:
        proxy.close()
    assert result.kind == "observation" and result.done is False
    assert health_s < DELAY_S, health_s  # plain HTTP passes undelayed
    assert opened_s >= DELAY_S, opened_s  # the 101 answer waited
    assert reset_s >= DELAY_S, reset_s  # and so did the reset answer
