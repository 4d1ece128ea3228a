"""A whole run on a qwen3-0.6b-shaped random model (2 layers, Qwen's real 151k vocabulary and the
Qwen3 chat template) on CPU: collect a group of 2, train, verify and replay the rollout.

Tokenisation, the token-in/token-out glue, the 151,936-row embedding/LM head and the memory paths
are the real ones; the weights are random, so actions come from the action grammar. Every scored
token costs a 151,936 × 1,024 head product, so the run is one group (what the shape proves does
not grow with the number of groups; multi-group runs are covered on the tiny model).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import boto3
import pytest

from api.runs import RunService
from kiln.core.contracts import parse_run_request
from kiln.core.rollout.replay_live import replay_bundle
from kiln.core.rollout.verify import verify_bundle
from tests.support.kiln_workers import running_workers
from tests.support.models import shared_random_qwen
from tests.support.waiting import workflow_result
from tests.unit.test_verify_support import write_bundle

pytestmark = pytest.mark.asyncio

RUN = {
    "kind": "train",
    "groups": 1,
    "group_size": 2,
    "max_steps": 3,  # the grammar keeps amounts in 1..5: a third step can overshoot (reward varies)
    "max_action_tokens": 24,
    "thinking": False,
    "constrained_actions": True,
    "output_adapter": "qwen-shaped",
    "training_config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8, "on_no_output": "penalty"},
}


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_random_qwen(tmp_path_factory, shape="qwen3-0.6b", layers=2)


def _fetch(settings: Any, uri: str) -> bytes:
    s3 = boto3.client(
        "s3", endpoint_url=settings.s3_endpoint, aws_access_key_id=settings.s3_access_key,
        aws_secret_access_key=settings.s3_secret_key, region_name="us-east-1",
    )
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.mark.timeout(600)
async def test_qwen_shaped_run_collects_trains_verifies_and_replays(
    kiln_settings: Any, counter_env_url: str, qwen_model: Path, tmp_path: Path
) -> None:
    config = json.loads((qwen_model / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (1024, 2, 151936)
    settings = kiln_settings(model_path=qwen_model, device="cpu", dtype="auto")
    request = parse_run_request({**RUN, "environment_urls": [counter_env_url]})
    started = time.perf_counter()
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(request)
        final = await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=540)
    elapsed = time.perf_counter() - started
    print(f"qwen3-0.6b-shaped 2-layer run: {elapsed:.1f} s")
    assert final["state"] == "completed", final.get("failure")
    # Every candidate overshoots or not at its third step: the group varies and trains one step.
    assert final["training"]["trained"] is True and final["training"]["steps"] == 1
    assert final["training"]["selection"]["no_reward_gradient_groups_skipped"] == 0

    artifacts = {a["name"]: a for a in final["artifacts"]}
    receipt = json.loads(_fetch(settings, artifacts["train_receipt.json"]["uri"]))
    assert receipt["runtime"]["device"] == "cpu" and receipt["runtime"]["dtype"] == "float32"
    assert receipt["config"]["on_no_output"] == "penalty"
    bundle = {name: _fetch(settings, artifacts[name]["uri"]) for name in ("rollouts.jsonl", "replay.json", "summary.json")}
    lines = [json.loads(line) for line in bundle["rollouts.jsonl"].decode().splitlines()]
    assert [len(line["completions"]) for line in lines] == [2]
    policy = lines[0]["completions"][0]["openenv"]["behavior_policy"]
    assert policy["runtime"]["device"] == "cpu" and policy["runtime"]["dtype"] == "float32"
    # Real vocabulary: the prompt ids are Qwen's (<|im_start|> = 151644, <|im_end|> = 151645).
    prompt_ids = lines[0]["completions"][0]["tokens"]["pieces"][0]["ids"]
    assert prompt_ids[0] == 151644 and 151645 in prompt_ids

    summary_path = write_bundle(tmp_path / "bundle", bundle)
    offline = verify_bundle(summary_path)
    assert offline["replay_sha256"] == json.loads(bundle["summary.json"])["replay_sha256"]
    report = await replay_bundle(summary_path)
    assert report["replay_sha256"] == offline["replay_sha256"]
