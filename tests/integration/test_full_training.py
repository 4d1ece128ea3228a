"""Full fine-tuning on real parts (issue 40): a 2-iteration online run with
``training_config.adapter: full`` (Temporal dev server, SeaweedFS, real workers, the tiny demo
model, the counter ``openenv`` server). Iteration 2 samples under iteration 1's full weights (its
behaviour identity names their digest), each iteration publishes a full model folder whose digest
is its receipt's, the held-out evaluation's candidate samples under the final weights, ``verify --run`` passes, and every retained byte the manifest reports is the
size of the stored object (brute force from the S3 listing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from api.runs import RunService
from kiln.core.artifacts.store import S3Store
from kiln.core.contracts import parse_run_request
from kiln.core.policy.identity import model_content_sha256
from kiln.core.rollout.verify.run import verify_run
from tests.support.kiln_workers import running_workers
from tests.support.run_folders import download_run
from tests.support.waiting import workflow_result

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

RUN = {
    "kind": "train",
    "groups": 2,
    "group_size": 4,
    "max_steps": 6,
    "max_action_tokens": 48,
    "iterations": 2,
    "output_adapter": "counter-full",
    "training_config": {"adapter": "full", "echo": None, "epochs": 1, "learning_rate": 1e-4},
    "environment_eval": {"groups": 2, "group_size": 1},
}


def _listed_sizes(store: S3Store) -> dict[str, int]:
    """Every object of the bucket and its size, from the S3 listing itself."""
    sizes: dict[str, int] = {}
    for page in store.client.get_paginator("list_objects_v2").paginate(Bucket=store.bucket):
        for item in page.get("Contents", []):
            sizes[item["Key"]] = int(item["Size"])
    return sizes


@pytest.mark.timeout(600)
async def test_two_full_iterations_chain_verify_and_count_their_bytes(
    kiln_settings: Any, counter_env_url: str, tmp_path: Path
) -> None:
    settings = kiln_settings()
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(parse_run_request({**RUN, "environment_urls": [counter_env_url]}))
        final = await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=540)
    assert final["state"] == "completed", final.get("failure")
    curve = final["iterations"]
    assert [r["iteration"] for r in curve] == [1, 2] and all(r["trained"] for r in curve)
    assert curve[0]["behavior_adapter_sha256"] is None
    assert curve[1]["behavior_adapter_sha256"] == curve[0]["adapter_sha256"]  # sampled by iteration 1's weights

    store = S3Store.from_settings(settings)
    manifest = json.loads(store.get_key(f"runs/{final['run_id']}/manifest.json"))
    folder = download_run(store, final["run_id"], manifest, tmp_path / "run")
    for k, row in ((1, curve[0]), (2, curve[1])):
        weights = folder / f"iterations/{k:06d}/adapter"
        assert sorted(p.name for p in weights.iterdir()) == ["config.json", "model.safetensors"]
        assert model_content_sha256(weights) == row["adapter_sha256"]  # the digest names the full weights
        receipt = json.loads((folder / f"iterations/{k:06d}/train_receipt.json").read_bytes())
        assert receipt["config"]["adapter"] == "full"
        assert receipt["adapter"] == {"kind": "full", "sha256": row["adapter_sha256"],
                                      "bytes": sum(p.stat().st_size for p in weights.iterdir())}
    assert json.loads((folder / "iterations/000002/train_receipt.json").read_bytes())["base_adapter_sha256"] == \
        curve[0]["adapter_sha256"]
    assert model_content_sha256(folder / "adapter") == curve[1]["adapter_sha256"]

    # the held-out evaluation's candidate side sampled under the final full weights
    candidate = json.loads((folder / "environment_eval/candidate/summary.json").read_bytes())
    assert candidate["behavior_policy"]["adapter_sha256"] == curve[1]["adapter_sha256"]

    report = verify_run(folder)
    assert report["evaluations"]["environment_eval/"]["paired_groups"] == 2
    assert [r["sampled_by"] for r in report["iterations"]] == [None, curve[0]["adapter_sha256"]]
    assert [r["adapter_sha256"] for r in report["iterations"]] == [r["adapter_sha256"] for r in curve]

    # Retained bytes: every manifest entry's size is its object's size in the bucket listing, so
    # the budget publication charged (the sum of entries) is the listing's sum over those entries;
    # the full weights count once per iteration and once more as the final adapter.
    listed = _listed_sizes(store)
    prefix = f"s3://{store.bucket}/"
    entries = manifest["artifacts"]
    assert all(e["uri"].startswith(prefix) for e in entries)
    assert [e["bytes"] for e in entries] == [listed[e["uri"].removeprefix(prefix)] for e in entries]
    reported = sum(e["bytes"] for e in entries)
    assert reported == sum(listed[e["uri"].removeprefix(prefix)] for e in entries) <= settings.retained_budget_bytes
    weights = [e for e in entries if e["name"].endswith("adapter/model.safetensors")]
    assert sorted(e["name"] for e in weights) == ["adapter/model.safetensors",
                                                  "iterations/000001/adapter/model.safetensors",
                                                  "iterations/000002/adapter/model.safetensors"]
    assert weights[0]["bytes"] == (folder / "adapter/model.safetensors").stat().st_size


@pytest.mark.timeout(300)
async def test_a_plan_whose_full_weights_exceed_the_budget_is_refused_at_admission(
    kiln_settings: Any, counter_env_url: str, tiny_model_dir: Path
) -> None:
    # brute force: the float32 tiny model's own files (KILN_DEVICE cpu, KILN_DTYPE auto: float32)
    one = sum((tiny_model_dir / name).stat().st_size for name in ("model.safetensors", "config.json"))
    settings = kiln_settings(retained_budget_bytes=3 * one - 1, device="cpu")  # 2 iterations + the final: 3 copies
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(parse_run_request({**RUN, "environment_urls": [counter_env_url]}))
        handle = client.get_workflow_handle(status.run_id)
        with pytest.raises(WorkflowFailureError) as failed:
            await workflow_result(handle, timeout_s=240)
        final = await handle.query("status")
    assert failed.value.cause.type == "full_training_unsupported"
    assert final["state"] == "failed"
    failure = final["failure"]
    assert (failure["code"], failure["retryable"]) == ("full_training_unsupported", False), failure
    assert "KILN_RETAINED_BUDGET_BYTES" in failure["hint"] and "retains 3 copies" in failure["message"]
    assert final["iterations"] == []  # nothing ran
    assert failure["details"] == {"field": "training_config.adapter", "weights_bytes": one, "copies": 3,
                                  "budget_bytes": 3 * one - 1}
