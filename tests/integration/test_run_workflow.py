"""The whole OpenEnvRunWorkflow on real parts: Temporal dev server, SeaweedFS, counter env, tiny model."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import uuid
from typing import Any

import boto3
import pytest
from safetensors.numpy import load as load_safetensors
from temporalio import activity
from temporalio.client import WorkflowFailureError

from activities.control import ControlActivities
from api.runs import RunService
from kiln.core.artifacts.adapters import pointer_key
from kiln.core.artifacts.manifest import manifest_key
from kiln.core.artifacts.store import S3Store
from kiln.core.contracts import parse_run_request
from kiln.core.records import RevalidationInput
from tests.support.connection_counter import ConnectionCounter
from tests.support.kiln_workers import running_workers
from tests.support.servers import example_env_argv, free_port, serve_app_process
from tests.support.waiting import workflow_result
from workflows.options import WORKFLOW_NAME

pytestmark = pytest.mark.asyncio

SMALL_RUN = {
    "kind": "train",
    "groups": 4,
    "group_size": 4,
    "max_steps": 4,
    "max_action_tokens": 48,
    "output_adapter": "counter-agent",
    "training_config": {"epochs": 2, "lora_rank": 4, "lora_alpha": 8},
}


def _s3(settings: Any) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint,
        aws_access_key_id=settings.s3_access_key,
        aws_secret_access_key=settings.s3_secret_key,
        region_name="us-east-1",
    )


def _object(settings: Any, uri: str) -> bytes:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return _s3(settings).get_object(Bucket=bucket, Key=key)["Body"].read()


def _replay_counter_env(seed: int, actions: list[int]) -> list[float]:
    """The counter environment's rule, recomputed independently from the seed and the actions."""
    target = random.Random(seed).randint(8, 12)
    count, rewards = 0, []
    for amount in actions:
        count += amount
        rewards.append(0.0 if count > target else 1.0)
        if count >= target:
            break
    return rewards


async def test_train_run_end_to_end(kiln_settings: Any, counter_env_url: str) -> None:
    settings = kiln_settings()
    request = parse_run_request({**SMALL_RUN, "environment_urls": [counter_env_url]})
    async with running_workers(settings) as client:
        service = RunService(client, settings)
        status, created = await service.submit(request)
        assert created is True
        run_id = status.run_id
        final = await workflow_result(client.get_workflow_handle(run_id))
        described = await service.status(run_id)

    assert final["state"] == "completed" and described.state == "completed"
    # Wall-clock latency is reported in status (never in artifacts), with the policy's tokens.
    assert final["progress"]["model_latency_ms"] > 0.0
    assert final["progress"]["model_tokens"] > 0
    assert described.temporal_ui.endswith(f"/workflows/{run_id}")
    artifacts = {a["name"]: a for a in final["artifacts"]}
    assert {"rollouts.jsonl", "replay.json", "summary.json", "train_receipt.json"} <= set(artifacts)
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(artifacts)

    # Every manifest digest equals the SHA-256 of the bytes actually in S3.
    manifest_bytes = _s3(settings).get_object(Bucket=settings.s3_bucket, Key=manifest_key(run_id))["Body"].read()
    manifest = json.loads(manifest_bytes)
    assert "sha256:" + hashlib.sha256(manifest_bytes).hexdigest() == final["manifest"]["sha256"]
    assert len(manifest["artifacts"]) == len(final["artifacts"])
    for entry in manifest["artifacts"]:
        data = _object(settings, entry["uri"])
        assert len(data) == entry["bytes"]
        assert "sha256:" + hashlib.sha256(data).hexdigest() == entry["sha256"]

    # groups × group_size episodes, and each return is what the environment actually sent.
    lines = _object(settings, artifacts["rollouts.jsonl"]["uri"]).decode().splitlines()
    assert len(lines) == 4
    episodes = 0
    replay = json.loads(_object(settings, artifacts["replay.json"]["uri"]))
    for line, group in zip(lines, replay["groups"]):
        completions = json.loads(line)["completions"]
        assert len(completions) == 4
        for completion, candidate in zip(completions, group["candidates"]):
            episodes += 1
            actions = [ex["action"]["amount"] for ex in candidate["exchanges"]]
            wire_rewards = [ex["result"]["observation"]["reward"] for ex in candidate["exchanges"]]
            assert wire_rewards == _replay_counter_env(group["seed"], actions)
            penalty = -1.0 if candidate["termination"] == "invalid_model_action" else 0.0
            assert completion["reward"] == sum(wire_rewards) + penalty
            assert completion["reward"] == candidate["episode_return"]
    assert episodes == 16
    summary = json.loads(_object(settings, artifacts["summary.json"]["uri"]))
    assert summary["rollout_count"] == 16
    assert summary["dataset_sha256"] == artifacts["rollouts.jsonl"]["sha256"]

    # The trained adapter's weights differ from the initial LoRA (whose B matrices are zero).
    tensors = load_safetensors(_object(settings, artifacts["adapter/adapter_model.safetensors"]["uri"]))
    lora_b = [name for name in tensors if "lora_B" in name]
    assert lora_b, "the adapter has no LoRA B matrices"
    assert max(float(abs(tensors[name]).max()) for name in lora_b) > 0.0
    assert final["training"]["trained"] is True and final["training"]["steps"] > 0


class _SwapSchemaBeforeRevalidation(ControlActivities):
    """Restarts the environment with a changed action schema just before revalidation runs."""

    swap: Any = None

    @activity.defn(name="revalidate_environments")
    async def revalidate_environments(self, inp: RevalidationInput) -> None:  # type: ignore[override]
        await asyncio.to_thread(type(self).swap)
        return await super().revalidate_environments(inp)


async def test_identity_change_fails_run_keeping_its_episodes_unpromoted(kiln_settings: Any) -> None:
    """A changed environment identity fails the run at revalidation, before training: the episodes
    already collected are published as evidence (a manifest, no adapter), and nothing is promoted."""
    port = free_port()
    first = serve_app_process(example_env_argv("counter", port), port=port)
    url = first.__enter__()
    swapped: list[Any] = []

    def swap() -> None:
        first.__exit__(None, None, None)
        second = serve_app_process(example_env_argv("counter", port, schema_variant=2), port=port)
        second.__enter__()
        swapped.append(second)

    _SwapSchemaBeforeRevalidation.swap = staticmethod(swap)
    settings = kiln_settings()
    run_id = str(uuid.uuid4())
    try:
        async with running_workers(settings, control_factory=_SwapSchemaBeforeRevalidation) as client:
            request = {**SMALL_RUN, "groups": 1, "group_size": 2, "max_steps": 2, "environment_urls": [url],
                       "output_adapter": "identity-changed-agent"}  # a name no other test of the bucket publishes
            handle = await client.start_workflow(
                WORKFLOW_NAME, request, id=run_id, task_queue=settings.control_task_queue
            )
            with pytest.raises(WorkflowFailureError) as failure:
                await workflow_result(handle)
            status = await handle.query("status")
    finally:
        for server in swapped:
            server.__exit__(None, None, None)
        if not swapped:
            first.__exit__(None, None, None)
    assert failure.value.cause.type == "environment_identity_changed"
    assert status["failure"]["code"] == "environment_identity_changed"
    assert status["failure"]["stage"] == "revalidation"
    assert "schema.action" in status["failure"]["details"]["changed_fields"]
    store = S3Store.from_settings(settings)
    assert status["state"] == "failed" and status["promoted"] is False
    assert status["manifest"] is not None and store.exists(manifest_key(run_id))
    assert {a["name"] for a in status["artifacts"]} == {"rollouts.jsonl", "replay.json", "summary.json", "metrics.jsonl"}
    assert store.get_key(pointer_key("identity-changed-agent")) is None


async def test_unreachable_url_fails_at_discovery_naming_url_and_route(kiln_settings: Any) -> None:
    settings = kiln_settings()
    url = f"http://127.0.0.1:{free_port()}"
    run_id = str(uuid.uuid4())
    async with running_workers(settings, roles=("control",)) as client:
        handle = await client.start_workflow(
            WORKFLOW_NAME,
            {**SMALL_RUN, "environment_urls": [url]},
            id=run_id,
            task_queue=settings.control_task_queue,
        )
        with pytest.raises(WorkflowFailureError):
            await workflow_result(handle)
        status = await handle.query("status")
    failure = status["failure"]
    assert failure["code"] == "environment_unavailable"
    assert failure["stage"] == "discovery"
    assert f"{url}/health" in failure["message"]


async def test_invalid_request_rejected_at_admission_without_contact(kiln_settings: Any) -> None:
    settings = kiln_settings()
    listener = ConnectionCounter()
    url = f"http://127.0.0.1:{listener.port}"
    bad = {**SMALL_RUN, "group_size": 1, "environment_urls": [url]}
    try:
        async with running_workers(settings, roles=("control",)) as client:
            handle = await client.start_workflow(
                WORKFLOW_NAME, bad, id=str(uuid.uuid4()), task_queue=settings.control_task_queue
            )
            with pytest.raises(WorkflowFailureError) as failure:
                await workflow_result(handle)
            status = await handle.query("status")
    finally:
        listener.close()
    assert failure.value.cause.type == "openenv_invalid_request"
    assert status["failure"]["stage"] == "admission"
    assert "group_size" in status["failure"]["message"]
    assert listener.accepted == 0
    # The API rejects the same request before any workflow starts, with the same code.
    from kiln.core.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as api_error:
        parse_run_request(bad)
    assert api_error.value.code == "openenv_invalid_request"


async def test_temporal_cli_starts_the_same_run(kiln_settings: Any, counter_env_url: str) -> None:
    """`temporal workflow start --type OpenEnvRunWorkflow --input '{…}'` runs a real (rollout) run."""
    import subprocess

    from kiln.devstack import temporal_binary

    settings = kiln_settings()
    run_id = str(uuid.uuid4())
    request = {
        "kind": "rollout",
        "environment_urls": [counter_env_url],
        "groups": 1,
        "group_size": 2,
        "max_steps": 2,
        "max_action_tokens": 32,
    }
    async with running_workers(settings) as client:
        started = await asyncio.to_thread(
            subprocess.run,
            [
                temporal_binary(), "workflow", "start",
                "--address", settings.temporal_address,
                "--type", WORKFLOW_NAME,
                "--task-queue", settings.control_task_queue,
                "--workflow-id", run_id,
                "--input", json.dumps(request),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert started.returncode == 0, started.stderr
        final = await workflow_result(client.get_workflow_handle(run_id))
    assert final["state"] == "completed" and final["kind"] == "rollout"
    assert final["progress"]["rollouts_completed"] == 2
    assert {a["name"] for a in final["artifacts"]} == {
        "rollouts.jsonl", "replay.json", "summary.json", "metrics.jsonl"}
    assert final["training"] is None


async def test_same_rollout_twice_gives_identical_artifacts(kiln_settings: Any, counter_env_url: str) -> None:
    """Seeded per (seed, candidate, step): two runs of one request publish byte-identical files."""
    settings = kiln_settings()
    request = {
        "kind": "rollout",
        "environment_urls": [counter_env_url],
        "groups": 2,
        "group_size": 3,
        "max_steps": 4,
        "max_action_tokens": 48,
        "seed_start": 41,
    }
    digests = []
    async with running_workers(settings) as client:
        service = RunService(client, settings)
        for _ in range(2):
            status, created = await service.submit(parse_run_request(request))
            assert created
            final = await workflow_result(client.get_workflow_handle(status.run_id))
            assert final["state"] == "completed"
            # metrics.jsonl carries wall-clock figures (latency): the one non-reproducible file.
            digests.append({a["name"]: a["sha256"] for a in final["artifacts"] if a["name"] != "metrics.jsonl"})
            assert "metrics.jsonl" in {a["name"] for a in final["artifacts"]}
    assert digests[0] == digests[1]
    assert set(digests[0]) == {"rollouts.jsonl", "replay.json", "summary.json"}


async def test_over_budget_run_publishes_nothing(kiln_settings: Any, counter_env_url: str) -> None:
    """Retained-byte budget: exceeding it fails publication before anything is written."""
    settings = kiln_settings(retained_budget_bytes=4096)
    run_id = str(uuid.uuid4())
    adapter = f"budget-{run_id[:8]}"
    request = {
        **SMALL_RUN,
        "groups": 1,
        "group_size": 2,
        "max_steps": 2,
        "output_adapter": adapter,
        "environment_urls": [counter_env_url],
        "allow_empty_training": True,  # a tiny group may have no reward variation: still publish
    }
    async with running_workers(settings) as client:
        handle = await client.start_workflow(
            WORKFLOW_NAME, request, id=run_id, task_queue=settings.control_task_queue
        )
        with pytest.raises(WorkflowFailureError) as failure:
            await workflow_result(handle)
        status = await handle.query("status")
    assert failure.value.cause.type == "retained_budget_exceeded"
    assert status["failure"]["stage"] == "publication"
    assert "4096" in status["failure"]["message"]
    store = S3Store.from_settings(settings)
    assert not store.exists(manifest_key(run_id))
    from kiln.core.artifacts.adapters import pointer_key

    assert store.get_key(pointer_key(adapter)) is None
    assert status["manifest"] is None and status["artifacts"] == []


async def test_constrained_actions_run_never_emits_invalid_actions(kiln_settings: Any, counter_env_url: str) -> None:
    """--constrained-actions: with thinking off, every answer parses and validates (temperature 1.5)."""
    settings = kiln_settings()
    request = {
        "kind": "rollout",
        "environment_urls": [counter_env_url],
        "groups": 2,
        "group_size": 4,
        "max_steps": 4,
        "max_action_tokens": 32,
        "temperature": 1.5,
        "thinking": False,
        "constrained_actions": True,
    }
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(parse_run_request(request))
        final = await workflow_result(client.get_workflow_handle(status.run_id))
    stats = final["rollout_stats"]
    assert stats["rollouts"] == 8
    assert stats["invalid_model_action_count"] == 0
    assert stats["done_count"] + stats["max_steps_count"] == 8
    summary = json.loads(_object(settings, next(a for a in final["artifacts"] if a["name"] == "summary.json")["uri"]))
    assert summary["constrained_actions"] is True


async def test_portfolio_round_robin_with_per_environment_reset_options(kiln_settings: Any) -> None:
    """Two environments, whole groups round-robin, per-URL reset templates, seed inserted."""
    from kiln.core.canonical import digest_json
    from tests.support.servers import serve_example_env

    settings = kiln_settings()
    with serve_example_env("counter") as first, serve_example_env("counter", schema_variant=2) as second:
        templates = [{"difficulty": "easy", "seed": 999}, {}]
        request = {
            "kind": "rollout",
            "environment_urls": [first, second],
            "environment_reset_options": templates,
            "groups": 4,
            "group_size": 2,
            "max_steps": 2,
            "max_action_tokens": 32,
            "seed_start": 10,
        }
        async with running_workers(settings) as client:
            status, _ = await RunService(client, settings).submit(parse_run_request(request))
            final = await workflow_result(client.get_workflow_handle(status.run_id))
    assert final["state"] == "completed"
    assert final["reset_plan_sha256"] == digest_json([{"difficulty": "easy"}, {}])
    replay = json.loads(_object(settings, next(a for a in final["artifacts"] if a["name"] == "replay.json")["uri"]))
    assert [g["environment_index"] for g in replay["groups"]] == [0, 1, 0, 1]
    assert [g["seed"] for g in replay["groups"]] == [10, 11, 12, 13]
    assert [g["reset_payload"] for g in replay["groups"]] == [
        {"difficulty": "easy", "seed": 10}, {"seed": 11}, {"difficulty": "easy", "seed": 12}, {"seed": 13},
    ]
    assert [env["identity"]["base_url"] for env in replay["environments"]] == [first, second]
    assert len({env["identity"]["schema_sha256"] for env in replay["environments"]}) == 2
