"""Per-run model choice on real parts: Temporal dev server, SeaweedFS, counter env, two tiny models.

The workers serve their default model plus every folder of ``KILN_MODELS_DIR`` (here: a copy of
the tiny demo model, a Qwen3-style ChatML template with a thinking mode, and a tiny Llama-3-template
model without one), one gpu task queue per model. A run naming a model is sampled by that model
(its behaviour identity carries that folder's content digest), ``thinking: "auto"`` resolves per
model and the resolved bool is what the bundle records; an unknown model is refused at admission.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from temporalio.client import WorkflowFailureError

from api.runs import RunService
from kiln.core.contracts import parse_run_request
from kiln.core.policy.identity import model_content_sha256
from kiln.core.policy.runtime import PolicyRuntime
from tests.support.connection_counter import ConnectionCounter
from tests.support.kiln_workers import running_workers
from tests.support.models import shared_family_model
from tests.support.waiting import workflow_result
from workflows.options import WORKFLOW_NAME

pytestmark = pytest.mark.asyncio

ROLLOUT = {"kind": "rollout", "groups": 1, "group_size": 2, "max_steps": 2, "max_action_tokens": 32, "seed_start": 7}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("served-models")
    shutil.copytree(tiny_model_dir, root / "tiny")
    shutil.copytree(shared_family_model("llama3", tmp_path_factory), root / "llama")
    return root


def _object(settings: Any, uri: str) -> bytes:
    s3 = boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint,
        aws_access_key_id=settings.s3_access_key,
        aws_secret_access_key=settings.s3_secret_key,
        region_name="us-east-1",
    )
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def _bundle(settings: Any, final: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    artifacts = {a["name"]: a for a in final["artifacts"]}
    summary = json.loads(_object(settings, artifacts["summary.json"]["uri"]))
    lines = [json.loads(line) for line in _object(settings, artifacts["rollouts.jsonl"]["uri"]).decode().splitlines()]
    return summary, lines


def _check_sampled_by(runtime: PolicyRuntime, lines: list[dict[str, Any]], header: str) -> int:
    """Every first context decodes to ``runtime``'s own template, and one forward pass of that model
    reproduces each recorded action's log-probs within 1e-4."""
    checked = 0
    for line in lines:
        for completion in line["completions"]:
            pieces = completion["tokens"]["pieces"]
            assert header in runtime.decode(pieces[0]["ids"])
            prefix: list[int] = []
            for piece in pieces:
                if piece["kind"] == "action" and piece["ids"]:
                    recomputed = runtime.logprobs_of(prefix, piece["ids"], temperature=1.0)
                    assert max(abs(a - b) for a, b in zip(recomputed, piece["logprobs"])) < 1e-4
                    checked += 1
                prefix += piece["ids"]
    return checked


@pytest.mark.timeout(300)
async def test_runs_name_their_model_and_thinking_auto_resolves_per_model(
    kiln_settings: Any, counter_env_url: str, models_dir: Path
) -> None:
    # The default model's folder does not exist: a run routed to the default queue would fail with
    # model_not_found, so completing runs prove each was routed to its own model's queue.
    settings = kiln_settings(models_dir=models_dir, model_path=models_dir / "absent-default")
    finals: dict[str, dict[str, Any]] = {}
    async with running_workers(settings) as client:
        service = RunService(client, settings)
        for model in ("tiny", "llama"):
            status, created = await service.submit(
                parse_run_request({**ROLLOUT, "environment_urls": [counter_env_url], "model": model})
            )
            assert created
            finals[model] = await workflow_result(client.get_workflow_handle(status.run_id))
        # thinking on, explicitly, for a template without a thinking mode: refused when the
        # gpu worker resolves the policy, naming the field.
        bad = {**ROLLOUT, "environment_urls": [counter_env_url], "model": "llama", "thinking": True}
        handle = await client.start_workflow(
            WORKFLOW_NAME, bad, id=str(uuid.uuid4()), task_queue=settings.control_task_queue
        )
        with pytest.raises(WorkflowFailureError) as failure:
            await workflow_result(handle)
        refused = await handle.query("status")

    assert failure.value.cause.type == "model_unsupported"
    assert refused["failure"]["details"] == {"field": "thinking"}
    assert "thinking was requested but the chat template of" in refused["failure"]["message"]
    assert str(models_dir / "llama") in refused["failure"]["message"]

    digests = {name: model_content_sha256(models_dir / name) for name in ("tiny", "llama")}
    assert digests["tiny"] != digests["llama"]
    headers = {"tiny": "<|im_start|>user", "llama": "<|start_header_id|>user<|end_header_id|>"}
    recorded_thinking = {}
    for model, final in finals.items():
        assert final["state"] == "completed", final.get("failure")
        assert final["behavior_policy"]["base_model_sha256"] == digests[model]
        summary, lines = _bundle(settings, final)
        assert summary["behavior_policy"]["base_model_sha256"] == digests[model]
        policies = {c["openenv"]["behavior_policy"]["base_model_sha256"] for line in lines for c in line["completions"]}
        assert policies == {digests[model]}
        recorded_thinking[model] = summary["thinking"]
        runtime = PolicyRuntime.load(models_dir / model, device="cpu", dtype="float32")
        assert _check_sampled_by(runtime, lines, headers[model]) >= 2
    # auto: on for the Qwen3-style template with <think>, off for the Llama-3 template.
    assert recorded_thinking == {"tiny": True, "llama": False}
    assert finals["tiny"]["behavior_policy"] != finals["llama"]["behavior_policy"]


@pytest.mark.timeout(120)
async def test_unknown_model_is_refused_at_admission_without_contact(kiln_settings: Any, models_dir: Path) -> None:
    settings = kiln_settings(models_dir=models_dir)
    listener = ConnectionCounter()
    request = {**ROLLOUT, "environment_urls": [f"http://127.0.0.1:{listener.port}"], "model": "qwen3-4b"}
    try:
        async with running_workers(settings, roles=("control",)) as client:
            handle = await client.start_workflow(
                WORKFLOW_NAME, request, id=str(uuid.uuid4()), task_queue=settings.control_task_queue
            )
            with pytest.raises(WorkflowFailureError) as failure:
                await workflow_result(handle)
            status = await handle.query("status")
    finally:
        listener.close()
    assert failure.value.cause.type == "model_not_served"
    assert status["failure"]["stage"] == "admission"
    assert status["failure"]["details"] == {"field": "model", "model": "qwen3-4b", "served": ["llama", "tiny"]}
    assert "served models: llama, tiny" in status["failure"]["message"]
    assert listener.accepted == 0


@pytest.mark.timeout(300)
async def test_default_model_with_thinking_auto_publishes_the_bytes_of_thinking_true(
    kiln_settings: Any, counter_env_url: str
) -> None:
    """No ``model``, ``thinking`` left at its default (auto): the demo model's template has a
    thinking mode, so the run is exactly today's ``thinking: true`` run, byte for byte."""
    settings = kiln_settings()
    digests = []
    async with running_workers(settings) as client:
        service = RunService(client, settings)
        for extra in ({}, {"thinking": True}):
            request = parse_run_request({**ROLLOUT, "environment_urls": [counter_env_url], **extra})
            status, created = await service.submit(request)
            assert created
            final = await workflow_result(client.get_workflow_handle(status.run_id))
            assert final["state"] == "completed"
            # metrics.jsonl holds wall-clock figures: the reproducible artifacts are the others.
            digests.append({a["name"]: a["sha256"] for a in final["artifacts"] if a["name"] != "metrics.jsonl"})
            summary, _ = _bundle(settings, final)
            assert summary["thinking"] is True
    assert digests[0] == digests[1]
    assert set(digests[0]) == {"rollouts.jsonl", "replay.json", "summary.json"}


@pytest.mark.timeout(180)
async def test_preflight_seals_the_named_models_identity(kiln_settings: Any, models_dir: Path) -> None:
    """A training contract for a run naming a model carries that model's identity."""
    from api.app import create_app
    from tests.integration.test_api_helpers import asgi_client

    settings = kiln_settings(models_dir=models_dir)
    async with running_workers(settings) as client:
        async with asgi_client(create_app(settings, client=client)) as http:
            sealed = await http.post("/v1/openenv/training/preflight", json={"output_adapter": "out", "model": "llama"})
            assert sealed.status_code == 200, sealed.text
            unknown = await http.post("/v1/openenv/training/preflight", json={"output_adapter": "out", "model": "nope"})
    assert sealed.json()["behavior_policy"]["base_model_sha256"] == model_content_sha256(models_dir / "llama")
    assert unknown.status_code == 400
    body = unknown.json()
    assert body["code"] == "model_not_served"
    # The default (the workers' KILN_MODEL_PATH folder) is named too, so the user sees what to drop.
    assert body["details"] == {"field": "model", "model": "nope", "served": ["llama", "tiny"],
                               "default": settings.model_path.name}
