"""``python -m workers control|gpu|all``: run Kiln workers against the configured Temporal and S3.

This is how a GPU machine joins: point ``KILN_TEMPORAL_ADDRESS``/``KILN_S3_*`` at the shared
servers, set ``KILN_MODEL_PATH`` to the local model folder, and run ``python -m workers gpu``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from kiln.artifacts.store import S3Store
from kiln.errors import KilnError
from kiln.settings import load_settings
from workers.client import connect_client
from workers.factory import ROLES, build_workers


async def _main(roles: list[str]) -> None:
    settings = load_settings()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    temporal_metrics = server = None
    if settings.metrics_port is not None:
        from workers.metrics import MetricsServer, TemporalMetrics

        temporal_metrics = TemporalMetrics()
        server = MetricsServer(settings.metrics_host, settings.metrics_port, temporal_metrics)
        print(f"kiln worker metrics on http://{settings.metrics_host}:{server.port}/metrics", flush=True)
    client = await connect_client(settings, runtime=temporal_metrics.runtime if temporal_metrics else None)
    store = S3Store.from_settings(settings)
    try:
        store.ensure_bucket()  # an external S3 (compose, cloud) may start without Kiln's bucket
    except KilnError as error:
        print(f"warning: could not ensure bucket {settings.s3_bucket}: {error}", flush=True)
    workers = build_workers(client, settings, roles, store=store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"kiln workers {'+'.join(roles)} polling {settings.effective_temporal_address}", flush=True)
    async with _all(workers):
        await stop.wait()
    if server is not None:
        server.stop()


class _all:
    def __init__(self, workers: list) -> None:
        self.workers = workers

    async def __aenter__(self) -> None:
        for worker in self.workers:
            await worker.__aenter__()

    async def __aexit__(self, *exc: object) -> None:
        for worker in reversed(self.workers):
            await worker.__aexit__(None, None, None)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in (*ROLES, "all"):
        print("usage: python -m workers control|gpu|all", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(level=logging.WARNING)
    roles = list(ROLES) if args[0] == "all" else [args[0]]
    asyncio.run(_main(roles))


if __name__ == "__main__":
    main()
