"""Run Kiln's real workers for a test: in-process (one torch import for the whole suite), or one
more gpu worker in a child process (both cores)."""

from __future__ import annotations

import contextlib
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Sequence

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


def settings_for_tests(temporal_server: str, s3_server: dict[str, str], model_path: Path, home: Path, /,
                       **overrides: object) -> Any:
    """Settings pointing at the session's servers, with task queues of their own; ``overrides``
    (any setting, ``model_path`` and ``home`` included) win."""
    from kiln.core.settings import Settings

    suffix = uuid.uuid4().hex[:8]
    values: dict[str, object] = {
        "home": home,
        "temporal_address": temporal_server,
        "s3_endpoint": s3_server["endpoint"],
        "s3_access_key": s3_server["access_key"],
        "s3_secret_key": s3_server["secret_key"],
        "s3_bucket": s3_server["bucket"],
        "model_path": model_path,
        "control_task_queue": f"kiln-control-{suffix}",
        "gpu_task_queue": f"kiln-gpu-{suffix}",
        "temporal_ui_url": "http://127.0.0.1:8233",
    }
    values.update(overrides)
    return Settings(**values)


CHILD_WORKER_FIELDS = ("temporal_address", "s3_endpoint", "s3_access_key", "s3_secret_key", "s3_bucket",
                       "model_path", "control_task_queue", "gpu_task_queue")


@contextlib.contextmanager
def child_gpu_worker(settings: Any, home: Path) -> Iterator[None]:
    """One more gpu worker on ``settings``' gpu task queue, in a child Python process with its own
    home (``serve_gpu_worker``), stopped by PID on exit: a run's groups, evaluation sides and
    trainings then spread over both processes, so both cores work."""
    from tests.support.child_call import start_child, stop_child

    values = {name: str(getattr(settings, name)) for name in CHILD_WORKER_FIELDS}
    child = start_child("tests.support.kiln_workers:serve_gpu_worker", settings={**values, "home": str(home)})
    try:
        yield
    finally:
        stop_child(child)


def serve_gpu_worker(settings: dict[str, str]) -> None:
    """A gpu worker for ``Settings(**settings)`` until the process is killed (``child_gpu_worker``)
    or its parent is gone (a test process killed hard leaves no worker behind)."""
    import asyncio
    import os

    from kiln.core.settings import Settings

    parent = os.getppid()

    async def serve() -> None:
        async with running_workers(Settings(**settings), roles=("gpu",)):
            while os.getppid() == parent:
                await asyncio.sleep(1.0)

    asyncio.run(serve())
