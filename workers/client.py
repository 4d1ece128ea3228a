"""The Temporal client every Kiln process uses (API, workers, CLI): one connection recipe."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime

from kiln.settings import Settings


async def connect_client(settings: Settings, *, runtime: Runtime | None = None) -> Client:
    """Connect to the configured Temporal frontend with Kiln's pydantic data converter.

    ``runtime``: a Temporal runtime exporting SDK metrics (see ``kiln.telemetry.prometheus``).
    """
    return await Client.connect(
        settings.effective_temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=pydantic_data_converter,
        runtime=runtime,
    )
