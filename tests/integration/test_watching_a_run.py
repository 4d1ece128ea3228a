"""Watching a training run: live status within 2 s, metrics.jsonl, TensorBoard, Prometheus.

Real Temporal, SeaweedFS, counter environment, tiny model, in-process workers and API.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import pytest

from api.app import create_app
from kiln.core.settings import Settings
from tests.integration.test_api_helpers import asgi_client
from tests.support.watching import metered_workers, parse_scrape, scrape_url, total, value

pytestmark = pytest.mark.asyncio

RUN = {
    "kind": "train",
    "groups": 2,
    "group_size": 3,
    "max_steps": 3,
    "max_action_tokens": 32,
    "output_adapter": "watched",
    "report_to": "tensorboard",
    "training_config": {"epochs": 24, "lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-4,
                        "kl_coeff": 0.1},  # KL on: the metrics and the receipt carry its figures
}


@pytest.mark.timeout(420)
async def test_status_metrics_tensorboard_and_prometheus_follow_a_run(
    kiln_settings: Any, counter_env_url: str
) -> None:
    settings: Settings = kiln_settings()
    async with metered_workers(settings) as (client, worker_metrics, temporal):
        app = create_app(settings, client=client)
        app.state.services.temporal_metrics = temporal
        worker_url = f"http://127.0.0.1:{worker_metrics.port}/metrics"
        async with asgi_client(app) as http:
            worker_before = scrape_url(worker_url)
            api_before = parse_scrape((await http.get("/metrics")).text)

            created = await http.post("/v1/openenv/runs", json={**RUN, "environment_urls": [counter_env_url]})
            assert created.status_code == 202, created.text
            run_id = created.json()["run_id"]

            # Poll status; record when each step first became visible.
            seen_at: dict[int, float] = {}
            during: tuple[dict[Any, float], dict[Any, float]] | None = None
            while True:
                status = (await http.get(f"/v1/openenv/runs/{run_id}")).json()
                now = time.time()
                step = (status.get("training_progress") or {}).get("step")
                if step is not None:
                    seen_at.setdefault(int(step), now)
                    if during is None:  # scrape both while the run trains
                        during = (scrape_url(worker_url), parse_scrape((await http.get("/metrics")).text))
                if status["state"] != "running":
                    break
                await asyncio.sleep(0.1)
            assert status["state"] == "completed", status.get("failure")
            steps = status["training"]["steps"]
            assert steps in (24, 48)  # epochs × groups kept by selection

            # metrics.jsonl: in the manifest; one line per group and per step; losses = the receipt's.
            manifest = (await http.get(f"/v1/openenv/runs/{run_id}/artifacts")).json()
            assert "metrics.jsonl" in {a["name"] for a in manifest["artifacts"]}
            raw = (await http.get(f"/v1/openenv/runs/{run_id}/artifacts/metrics.jsonl")).content
            lines = [json.loads(line) for line in raw.splitlines()]
            assert lines[0] == {"schema": "kiln.run-metrics.v1", "run_id": run_id}
            groups = [e for e in lines if e.get("kind") == "group"]
            train = [e for e in lines if e.get("kind") == "train_step"]
            assert [g["group_index"] for g in groups] == [0, 1]
            assert all(g["episodes"] == 3 and g["label"] == "group" for g in groups)
            receipt = (await http.get(f"/v1/openenv/runs/{run_id}/artifacts/train_receipt.json")).json()
            assert [e["step"] for e in train] == list(range(1, steps + 1))
            assert [e["loss"] for e in train] == [h["loss"] for h in receipt["steps"]]
            assert [e["kl"] for e in train] == [h["kl"] for h in receipt["steps"]]
            assert all(e["learning_rate"] == 1e-4 and e["tokens_per_s"] > 0 for e in train)
            mean_returns = [g["mean_return"] for g in groups]
            assert statistics.fmean(mean_returns) == pytest.approx(status["mean_return"])

            # Latency: each step (or a later one) appeared in status within 2 s of happening.
            happened = {e["step"]: e["time"] for e in train}
            latencies = []
            for s, t in happened.items():
                shown = [at for seen, at in seen_at.items() if seen >= s]
                if shown:
                    latencies.append(min(shown) - t)
            assert len(seen_at) >= 3, seen_at  # several distinct steps were visible while training
            print(f"status latency over {len(latencies)} steps: median {statistics.median(latencies):.3f} s, "
                  f"max {max(latencies):.3f} s")
            assert statistics.median(latencies) < 2.0 and max(latencies) < 2.0

            # TensorBoard: the scalars read back equal metrics.jsonl.
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            accumulator = EventAccumulator(str(settings.home / "trackers" / run_id / "tensorboard"))
            accumulator.Reload()
            loss = accumulator.Scalars("train/loss")
            assert [e.step for e in loss] == list(range(1, steps + 1))
            assert [e.value for e in loss] == pytest.approx([e["loss"] for e in train], rel=1e-6)
            reward = accumulator.Scalars("group/mean_return")
            assert [e.value for e in reward] == pytest.approx(mean_returns)

            # Prometheus, during the run: collection is counted, the run is counted as running.
            assert during is not None
            worker_during, api_during = during
            episodes = "kiln_episodes_collected_total"
            assert total(worker_during, episodes) - total(worker_before, episodes) == 6
            assert total(worker_during, "kiln_training_steps_total") > total(worker_before, "kiln_training_steps_total")
            assert value(api_during, "kiln_runs", state="running") >= 1
            # ... and after it: the worker's and the API's series moved; Temporal SDK metrics are there.
            worker_after = scrape_url(worker_url)
            assert total(worker_after, "kiln_episodes_collected_total") - total(worker_before, "kiln_episodes_collected_total") == 6
            assert total(worker_after, "kiln_training_steps_total") - total(worker_before, "kiln_training_steps_total") == steps
            assert total(worker_after, "kiln_environment_steps_collected_total") > total(worker_before, "kiln_environment_steps_collected_total")
            rt = "kiln_environment_round_trip_seconds_count"
            assert value(worker_after, rt, kind="step") > value(worker_before, rt, kind="step")
            assert total(worker_after, "kiln_s3_bytes_written_total") > total(worker_before, "kiln_s3_bytes_written_total")
            assert total(worker_after, "kiln_training_tokens_per_second") > 0
            assert total(worker_after, "kiln_sampling_tokens_per_second") > 0
            assert any(name.startswith("temporal_activity_execution") for name, _ in worker_after)
            api_after = parse_scrape((await http.get("/metrics")).text)
            assert value(api_after, "kiln_runs", state="completed") >= value(api_before, "kiln_runs", state="completed") + 1
            # This run no longer counts as running (runs of other tests on the shared server may).
            assert value(api_after, "kiln_runs", state="running") <= value(api_during, "kiln_runs", state="running") - 1
            assert any(name.startswith("temporal_request") for name, _ in api_after)
            assert all("run_id" not in dict(labels) for _, labels in api_after)

            # Temporal UI: the outcome memo and the summary.
            description = await client.get_workflow_handle(run_id).describe()
            memo = await description.memo()
            assert memo["state"] == "completed" and memo["promoted"] is True
            assert memo["mean_return"] == pytest.approx(status["mean_return"])
            assert await description.static_summary() == f"train on {counter_env_url} → watched"
            assert "**report_to** tensorboard" in (await description.static_details() or "")
            listed = (await http.get("/v1/openenv/runs", params={"state": "completed"})).json()["runs"]
            row = next(r for r in listed if r["run_id"] == run_id)
            assert row["promoted"] is True and row["mean_return"] == pytest.approx(status["mean_return"])
