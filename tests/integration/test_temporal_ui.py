"""What the Temporal Web UI shows of a run: summary, details, current details, outcome memo,
handler descriptions — read back from the real dev server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.sdk.v1 import WorkflowMetadata

from api.runs import RunService
from kiln.core.contracts import parse_run_request
from tests.integration.test_api_helpers import unreachable_url
from tests.support.kiln_workers import running_workers
from tests.support.servers import free_port, stop_process
from tests.support.waiting import workflow_result
from tests.support.watching import parse_scrape

pytestmark = pytest.mark.asyncio
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
async def test_summary_details_memo_and_descriptions(kiln_settings: Any) -> None:
    settings = kiln_settings()
    url = unreachable_url()
    request = parse_run_request({"kind": "rollout", "environment_urls": [url], "groups": 2, "group_size": 2})
    async with running_workers(settings, roles=("control",)) as client:
        status, _ = await RunService(client, settings).submit(request)
        handle = client.get_workflow_handle(status.run_id)
        with pytest.raises(Exception):
            await workflow_result(handle)
        description = await handle.describe()
        assert await description.static_summary() == f"rollout on {url}"
        details = await description.static_details() or ""
        assert f"**environments** {url}" in details and "**groups** 2 × 2" in details
        memo = await description.memo()
        assert memo["state"] == "failed"  # None values (no return, no promotion) are not kept
        assert memo.get("mean_return") is None and memo.get("promoted") is None
        metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
        assert metadata.current_details == (
            "**phase** failed · **groups** 0/2 · **rollouts** 0/4\n\n"
            f"**failure** environment_unavailable: GET {url}/health: connection refused"
        )
        queries = {q.name: q.description for q in metadata.definition.query_definitions}
        signals = {s.name: s.description for s in metadata.definition.signal_definitions}
        assert queries["status"].startswith("The run's status")
        assert signals["slot_granted"] and signals["queue_position"]


@pytest.mark.timeout(120)
async def test_worker_process_serves_metrics_on_kiln_metrics_port(kiln_settings: Any) -> None:
    settings = kiln_settings()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILN_METRICS_PORT": str(port),
           "KILN_TEMPORAL_ADDRESS": settings.temporal_address, "KILN_S3_ENDPOINT": settings.s3_endpoint,
           "KILN_S3_ACCESS_KEY": settings.s3_access_key, "KILN_S3_SECRET_KEY": settings.s3_secret_key,
           "KILN_S3_BUCKET": settings.s3_bucket, "KILN_CONTROL_TASK_QUEUE": settings.control_task_queue,
           "KILN_HOME": str(settings.home)}
    proc = subprocess.Popen([sys.executable, "-m", "workers", "control"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                    text = resp.read().decode("utf-8")
                if "temporal_" in text:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        scrape = parse_scrape(text)
        names = {name for name, _ in scrape}
        assert "kiln_s3_bytes_written_total" in names
        assert any(name.startswith("temporal_") for name in names), sorted(names)[:20]
    finally:
        stop_process(proc)
