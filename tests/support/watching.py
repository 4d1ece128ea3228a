"""Test helpers for watching runs: workers + API wired to Prometheus metrics, scrape parsing."""

from __future__ import annotations

import contextlib
import urllib.request
from datetime import timedelta
from typing import Any, AsyncIterator

from prometheus_client.parser import text_string_to_metric_families

from workers.client import connect_client
from workers.factory import build_workers
from workers.metrics import MetricsServer, TemporalMetrics


def parse_scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def value(scrape: dict[Any, float], name: str, **labels: str) -> float:
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


def total(scrape: dict[Any, float], name: str) -> float:
    return sum(v for (n, _), v in scrape.items() if n == name)


def scrape_url(url: str) -> dict[Any, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return parse_scrape(resp.read().decode("utf-8"))


@contextlib.asynccontextmanager
async def metered_workers(settings: Any) -> AsyncIterator[tuple[Any, MetricsServer, TemporalMetrics]]:
    """Control + gpu workers whose client exports Temporal SDK metrics, and a ``/metrics`` server."""
    temporal = TemporalMetrics()
    server = MetricsServer("127.0.0.1", 0, temporal)
    client = await connect_client(settings, runtime=temporal.runtime)
    workers = build_workers(client, settings, ("control", "gpu"), sticky_timeout=timedelta(seconds=1))
    for worker in workers:
        await worker.__aenter__()
    try:
        yield client, server, temporal
    finally:
        for worker in reversed(workers):
            await worker.__aexit__(None, None, None)
        server.stop()
