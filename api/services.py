"""The API's shared clients, created once per app on first use (works with or without lifespan)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from temporalio.client import Client
from temporalio.service import RetryConfig

from api.artifacts import ArtifactService
from api.runs import RunService
from kiln.core.artifacts.store import S3Store
from kiln.core.errors import KilnError, TemporalUnavailable
from kiln.core.settings import Settings
from workers.client import connect_client

# An API request waits about a second for an unreachable Temporal, then answers 503
# ``temporal_unavailable`` (the SDK default retries for ~10 s per call); clients retry on 503.
API_RPC_RETRY = RetryConfig(
    initial_interval_millis=100, max_interval_millis=500, max_elapsed_time_millis=1000, max_retries=4
)


class Services:
    """Temporal client, run service and artifact service of one app instance."""

    def __init__(self, settings: Settings, client: Client | None = None, store: S3Store | None = None) -> None:
        self.settings = settings
        self._client = client
        self._store = store
        self._lock: asyncio.Lock | None = None
        self.temporal_metrics: Any = None  # the Temporal SDK metrics of a client this app connects

    async def client(self) -> Client:
        if self._client is None:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if self._client is None:
                    from workers.metrics import TemporalMetrics

                    self.temporal_metrics = TemporalMetrics()
                    try:
                        self._client = await connect_client(
                            self.settings, runtime=self.temporal_metrics.runtime, retry_config=API_RPC_RETRY
                        )
                    except KilnError:
                        raise
                    except Exception:  # noqa: BLE001 - the SDK raises RuntimeError on refusal
                        raise TemporalUnavailable(
                            f"the Temporal server at {self.settings.effective_temporal_address} is not reachable",
                            hint="start it (`kiln serve` does) or fix KILN_TEMPORAL_ADDRESS",
                        ) from None
        return self._client

    async def runs(self) -> RunService:
        return RunService(await self.client(), self.settings, store=self.artifacts().store)

    def artifacts(self) -> ArtifactService:
        if self._store is None:
            self._store = S3Store.from_settings(self.settings)
        return ArtifactService(self._store)


def services(request: Request) -> Services:
    """FastAPI dependency: the app's ``Services``."""
    found: Any = request.app.state.services
    return found
