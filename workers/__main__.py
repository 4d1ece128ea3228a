"""``python -m workers control|gpu|sampler|trainer|all``: run Kiln workers against the configured
Temporal and S3. ``gpu`` samples and trains (one base model); ``sampler`` only samples (collection,
evaluation, replay) and ``trainer`` only trains (``KILN_TRAIN_DEVICES`` ranks): 1 trainer + N
samplers run the same requests as one gpu worker (docs/deploying.md "Worker roles").

This is how a GPU machine joins: point ``KILN_TEMPORAL_ADDRESS``/``KILN_S3_*`` at the shared
servers, set ``KILN_MODEL_PATH`` to the local model folder (and ``KILN_MODELS_DIR`` for more
models: one gpu task queue per model, see docs/models.md), and run ``python -m workers gpu``.

At start a worker connects with bounded, logged retries (Temporal may come up later), then makes
sure Kiln's search attributes exist on the namespace (creating missing ones; where the namespace
refuses, it exits with one line giving the command to run). ``python -m workers
ensure-search-attributes`` does only that and exits (a compose init service).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from kiln.core.artifacts.store import S3Store
from kiln.core.errors import KilnError
from kiln.core.settings import Settings, load_settings
from workers.client import connect_with_retry
from workers.factory import GPU_ROLES, ROLES, build_workers
from workers.search_attributes import ensure_search_attributes

ENSURE = "ensure-search-attributes"
USAGE = f"usage: python -m workers control|gpu|sampler|trainer|all|{ENSURE}"


async def _prepared_client(settings: Settings, *, runtime=None):
    client = await connect_with_retry(settings, runtime=runtime)
    created = await ensure_search_attributes(client, settings.temporal_namespace)
    if created:
        print(f"created search attributes {', '.join(created)} on namespace {settings.temporal_namespace}", flush=True)
    return client


async def _ensure_only() -> None:
    settings = load_settings()
    await _prepared_client(settings)
    print(f"search attributes ready on namespace {settings.temporal_namespace}", flush=True)


async def _main(roles: list[str]) -> None:
    settings = load_settings()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    temporal_metrics = server = None
    if settings.metrics_port is not None:
        from workers.metrics import MetricsServer, TemporalMetrics

        temporal_metrics = TemporalMetrics()
        server = MetricsServer(settings.metrics_host, settings.metrics_port, temporal_metrics)
        print(f"kiln worker metrics on http://{settings.metrics_host}:{server.port}/metrics", flush=True)
    client = await _prepared_client(settings, runtime=temporal_metrics.runtime if temporal_metrics else None)
    store = S3Store.from_settings(settings, outage_wait=True)
    try:
        store.impatient().ensure_bucket()  # an external S3 may lack Kiln's bucket (no outage wait here)
    except KilnError as error:
        print(f"warning: could not ensure bucket {settings.s3_bucket}: {error}", flush=True)
    if set(roles) & set(GPU_ROLES):
        # Import torch/transformers before polling: a gpu worker that says "polling" takes a task
        # at once, instead of spending its first heartbeat timeout importing (cold-start timeouts).
        import kiln.core.policy.runtime  # noqa: F401 - imported for its import time only
    workers = build_workers(client, settings, roles, store=store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    queues = ", ".join(worker.task_queue for worker in workers)
    print(f"kiln workers {'+'.join(roles)} polling {settings.effective_temporal_address} ({queues})", flush=True)
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
    if len(args) != 1 or args[0] not in (*ROLES, *GPU_ROLES, "all", ENSURE):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kiln.expected").setLevel(logging.INFO)  # expected waits: one INFO line each
    try:
        if args[0] == ENSURE:
            asyncio.run(_ensure_only())
            _exit_now(0)
        asyncio.run(_main(list(ROLES) if args[0] == "all" else [args[0]]))
    except KilnError as error:
        # One line an operator can act on (the message names settings and commands, never secrets).
        print(f"error: {error}" + (f" — {error.hint}" if error.hint else ""), file=sys.stderr, flush=True)
        _exit_now(1)


def _exit_now(code: int) -> None:
    """Exit with ``code`` at once: with a Temporal client still open, interpreter finalisation can
    abort in the SDK's runtime thread (``PyGILState_Release``) and turn the status into SIGABRT."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
