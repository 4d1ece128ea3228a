"""``kiln.client`` against the real stack: uvicorn-served API, Temporal dev server, SeaweedFS, the
counter environment and in-process control + gpu workers with the tiny model.

- a train run end to end: typed events while it runs, the completed ``RunView``, the run in the
  listing, a verified download and the offline verification of what was downloaded;
- a run that fails at discovery raises ``environment_unavailable`` (the code its status records);
- a submit naming a model the workers do not serve is a 400 ``model_not_served`` that names the
  served models and the default, and starts no run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kiln.client import (
    Client,
    KilnError,
    ProgressMade,
    RunEnded,
    RunView,
    TrainingConfig,
)
from kiln.core.errors import EnvironmentUnavailable, ModelNotServed
from tests.integration.test_api_helpers import serve_api, unreachable_url
from tests.support.kiln_workers import running_workers

pytestmark = pytest.mark.asyncio

SMALL = {"groups": 2, "group_size": 2, "max_steps": 2, "max_action_tokens": 32, "seed_start": 40}


async def _run_count(client: Any, queue: str) -> int:
    return len([w async for w in client.list_workflows(f"TaskQueue = '{queue}'")])


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_client_trains_follows_downloads_and_verifies(
    kiln_settings: Any, counter_env_url: str, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "config.json").write_text("{}")
    settings = kiln_settings(models_dir=models)
    async with running_workers(settings) as temporal:
        with serve_api(settings) as url, Client(url) as kiln:
            submitted = await asyncio.to_thread(
                kiln.train, counter_env_url, output_adapter="client-agent", wait=False,
                training_config=TrainingConfig(epochs=1, lora_rank=4, lora_alpha=8), **SMALL,
            )
            assert isinstance(submitted, RunView) and submitted.kind == "train"
            events = await asyncio.to_thread(lambda: list(kiln.follow(submitted.run_id, poll_s=0.3)))
            final = events[-1]
            assert isinstance(final, RunEnded) and final.state == "completed", final.view.failure
            assert [e for e in events if isinstance(e, RunEnded)] == [final]
            collected = [e for e in events if isinstance(e, ProgressMade)]
            assert collected and collected[-1].progress.rollouts_completed == 4 == collected[-1].progress.rollouts_total
            view = final.view
            assert view.training is not None and view.training.trained and view.training.steps >= 1
            assert view.manifest is not None and view.promoted is True

            # The same run through the other calls: status, listing, wait (returns it, no raise).
            assert (await asyncio.to_thread(kiln.status, view.run_id)).manifest == view.manifest
            listed = await asyncio.to_thread(kiln.runs, "completed")
            row = next(r for r in listed.runs if r.run_id == view.run_id)
            assert row.kind == "train" and row.output_adapter == "client-agent" and row.promoted is True
            assert (await asyncio.to_thread(kiln.wait, view.run_id)).run_id == view.run_id

            # Download: every artifact the manifest declares, bytes hashing to its digests.
            folder = tmp_path / "run"
            written = await asyncio.to_thread(kiln.download, view.run_id, folder)
            manifest_bytes = (folder / "manifest.json").read_bytes()
            assert "sha256:" + hashlib.sha256(manifest_bytes).hexdigest() == view.manifest.sha256
            manifest = json.loads(manifest_bytes)
            assert len(written) == len(manifest["artifacts"]) + 1
            for entry in manifest["artifacts"]:
                data = (folder / entry["name"]).read_bytes()
                assert "sha256:" + hashlib.sha256(data).hexdigest() == entry["sha256"]
            report = await asyncio.to_thread(Client.verify, folder)
            assert report["run_id"] == view.run_id
            assert report["bundles"]["."]["rollouts"] == 4

            # A run that fails at discovery raises the code its status records.
            with pytest.raises(EnvironmentUnavailable) as failed:
                await asyncio.to_thread(
                    kiln.rollout, unreachable_url(), preflight=False, poll_s=0.3, timeout_s=120, **SMALL
                )
            assert failed.value.code == "environment_unavailable" and failed.value.stage == "discovery"

            # An unserved model: refused at submit, naming the served models and the default; no run.
            before = await _run_count(temporal, settings.control_task_queue)
            with pytest.raises(ModelNotServed) as refused:
                await asyncio.to_thread(
                    kiln.train, counter_env_url, output_adapter="nope-agent", model="qwen3-4b", **SMALL
                )
            assert refused.value.code == "model_not_served"
            assert refused.value.details == {
                "field": "model", "model": "qwen3-4b", "served": ["llama"],
                "default": settings.default_model_path.name,
            }
            assert "served models: llama" in refused.value.message
            raw = httpx.post(f"{url}/v1/openenv/runs", json={
                "kind": "rollout", "environment_urls": [counter_env_url], "model": "qwen3-4b"}, timeout=30)
            assert raw.status_code == 400 and raw.json()["code"] == "model_not_served"
            assert await _run_count(temporal, settings.control_task_queue) == before

            # Request errors are the same KilnError codes, before anything is sent.
            with pytest.raises(KilnError) as invalid:
                await asyncio.to_thread(kiln.train, counter_env_url, output_adapter="x", group_size=0)
            assert invalid.value.code == "openenv_invalid_request"
