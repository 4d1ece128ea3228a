"""Run Kiln's real workers in-process for a test (one torch import for the whole suite)."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import AsyncIterator, Sequence

from temporalio.client import Client

from workers.client import connect_client
from workers.factory import build_workers


@contextlib.asynccontextmanager
async def running_workers(
    settings: object, roles: Sequence[str] = ("control", "gpu"), **kwargs: object
) -> AsyncIterator[Client]:
    client = await connect_client(settings)  # type: ignore[arg-type]
    workers = build_workers(
        client, settings, roles, sticky_timeout=timedelta(seconds=1), **kwargs  # type: ignore[arg-type]
    )
    for worker in workers:
        await worker.__aenter__()
    try:
        yield client
    finally:
        for worker in reversed(workers):
            await worker.__aexit__(None, None, None)
