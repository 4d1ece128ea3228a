"""Model families on real parts: Temporal dev server, SeaweedFS, the counter env, tiny random models.

- An architecture the family table does not know (a made-up ``model_type``), and a vision-language
  checkpoint of a family with no text-only class (Gemma 3's composite layout), are refused with ``model_unsupported``:
  when the gpu worker starts (one line, exit 1, before polling), at submit and at preflight for a
  run naming it (the CLI exits 2, nothing is queued), and at admission for a workflow started
  directly.
- MoE (qwen3_moe) and gpt-oss (eager attention) collect a rollout and train one iteration on the
  hf engine; the receipt's ``lora_targets`` are the family's, and so is ``adapter_config.json``;
  the bundle verifies offline. (The hybrid families' runs are in ``test_hybrid_runs.py``.)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from temporalio.client import WorkflowFailureError

from api.runs import RunService
from kiln.core.contracts import parse_run_request
from kiln.core.policy.families import FAMILIES
from kiln.core.rollout.verify import verify_bundle
from tests.integration.test_api_helpers import serve_api
from tests.support.model_builders import build_family_folder
from tests.support.kiln_workers import running_workers
from tests.support.topology import REPO_ROOT, child_env
from tests.support.waiting import workflow_result
from tests.unit.test_verify_support import write_bundle
from workflows.options import WORKFLOW_NAME

pytestmark = pytest.mark.asyncio

MADE_UP = {"model_type": "kiln_made_up", "architectures": ["MadeUpForCausalLM"], "hidden_size": 8}
GEMMA3_VL = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
             "text_config": {"model_type": "gemma3_text"}, "vision_config": {"model_type": "siglip_vision_model"}}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("family-models")
    (root / "made-up").mkdir()
    (root / "made-up" / "config.json").write_text(json.dumps(MADE_UP))
    (root / "gemma3-vl").mkdir()
    (root / "gemma3-vl" / "config.json").write_text(json.dumps(GEMMA3_VL))
    return root


async def _queued(client: Any, queue: str) -> int:
    return len([w async for w in client.list_workflows(f"TaskQueue = '{queue}'")])


@pytest.mark.timeout(240)
async def test_worker_start_refuses_an_unknown_architecture_and_an_unservable_family(
    kiln_settings: Any, models_dir: Path, tmp_path: Path
) -> None:
    settings = kiln_settings()
    for name, architecture in (("made-up", "MadeUpForCausalLM"), ("gemma3-vl", "Gemma3ForConditionalGeneration")):
        env = child_env({
            "KILN_TEMPORAL_ADDRESS": settings.temporal_address, "KILN_HOME": str(tmp_path / "home"),
            "KILN_S3_ENDPOINT": settings.s3_endpoint, "KILN_S3_ACCESS_KEY": settings.s3_access_key,
            "KILN_S3_SECRET_KEY": settings.s3_secret_key, "KILN_S3_BUCKET": settings.s3_bucket,
            "KILN_MODEL_PATH": str(models_dir / name), "KILN_DEVICE": "cpu",
            "KILN_GPU_TASK_QUEUE": settings.gpu_task_queue, "KILN_CONTROL_TASK_QUEUE": settings.control_task_queue,
        })
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "workers", "gpu"], cwd=REPO_ROOT, env=env,
            capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
        )
        assert out.returncode == 1, out.stdout + out.stderr
        lines = [line for line in out.stderr.splitlines() if line.strip() and "Warning" not in line]
        assert lines[-1].startswith("error: model_unsupported: "), out.stderr
        assert architecture in lines[-1] and "families" in lines[-1] and "qwen3_moe" in lines[-1]
        assert "Traceback" not in out.stderr and "polling" not in out.stdout
    assert "vision-language checkpoint of gemma3" in lines[-1]


@pytest.mark.timeout(240)
async def test_submit_and_preflight_refuse_a_named_unsupported_model_and_queue_nothing(
    kiln_settings: Any, models_dir: Path, counter_env_url: str
) -> None:
    from typer.testing import CliRunner

    from kiln.cli.app import app as cli_app
    from workers.client import connect_client

    settings = kiln_settings(models_dir=models_dir)
    client = await connect_client(settings)
    outcomes = {}
    with serve_api(settings) as url:
        for model in ("made-up", "gemma3-vl"):
            args = ["openenv", "rollout", "--environment", counter_env_url, "--groups", "1", "--group-size", "2",
                    "--model", model, "--no-follow", "--json"]
            outcomes[model] = await asyncio.to_thread(CliRunner().invoke, cli_app, args, env={"KILN_API_URL": url})
        preflight = await asyncio.to_thread(
            CliRunner().invoke, cli_app,
            ["openenv", "preflight", "--output-adapter", "out", "--model", "made-up", "--json"], env={"KILN_API_URL": url},
        )
    for model, result in outcomes.items():
        assert result.exit_code == 2, result.output
        error = json.loads(result.stdout)["error"]
        assert error["code"] == "model_unsupported" and error["exit_code"] == 2
        assert str(models_dir / model) in error["message"]
    made_up = json.loads(outcomes["made-up"].stdout)["error"]
    assert made_up["details"]["architecture"].startswith("MadeUpForCausalLM")
    assert made_up["details"]["supported"] == sorted(FAMILIES) and "supported families: gemma3, " in made_up["message"]
    composite = json.loads(outcomes["gemma3-vl"].stdout)["error"]
    assert composite["details"]["architecture"].startswith("Gemma3ForConditionalGeneration")
    assert "vision-language checkpoint of gemma3" in composite["message"]
    assert preflight.exit_code == 2 and json.loads(preflight.stdout)["error"]["code"] == "model_unsupported"
    assert await _queued(client, settings.control_task_queue) == 0


@pytest.mark.timeout(180)
async def test_admission_refuses_a_named_unsupported_model(
    kiln_settings: Any, models_dir: Path, counter_env_url: str
) -> None:
    settings = kiln_settings(models_dir=models_dir)
    request = {"kind": "rollout", "groups": 1, "group_size": 2, "environment_urls": [counter_env_url],
               "model": "made-up"}
    async with running_workers(settings, roles=("control",)) as client:
        handle = await client.start_workflow(
            WORKFLOW_NAME, request, id=str(uuid.uuid4()), task_queue=settings.control_task_queue
        )
        with pytest.raises(WorkflowFailureError) as failure:
            await workflow_result(handle)
        status = await handle.query("status")
    assert failure.value.cause.type == "model_unsupported"
    assert status["failure"]["stage"] == "admission"
    assert status["failure"]["details"]["architecture"].startswith("MadeUpForCausalLM")


TRAIN = {
    "kind": "train", "groups": 1, "group_size": 4, "max_steps": 4, "max_action_tokens": 24, "thinking": False,
    "constrained_actions": True, "seed_start": 3,
    "training_config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8, "on_no_output": "penalty"},
}


def _fetch(settings: Any, uri: str) -> bytes:
    s3 = boto3.client("s3", endpoint_url=settings.s3_endpoint, aws_access_key_id=settings.s3_access_key,
                      aws_secret_access_key=settings.s3_secret_key, region_name="us-east-1")
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
async def test_moe_families_collect_and_train_one_iteration_on_hf(
    case: str, kiln_settings: Any, counter_env_url: str, tmp_path: Path
) -> None:
    folder = build_family_folder(case, tmp_path / case, template="qwen3")
    settings = kiln_settings(model_path=folder, device="cpu", dtype="float32")
    request = parse_run_request({**TRAIN, "environment_urls": [counter_env_url], "output_adapter": f"{case}-out"})
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(request)
        final = await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=540)
    assert final["state"] == "completed", final.get("failure")
    artifacts = {a["name"]: a for a in final["artifacts"]}
    lines = [json.loads(x) for x in _fetch(settings, artifacts["rollouts.jsonl"]["uri"]).decode().splitlines()]
    assert [len(line["completions"]) for line in lines] == [4]
    family = FAMILIES[case]
    assert final["training"]["trained"] is True and final["training"]["steps"] == 1
    receipt = json.loads(_fetch(settings, artifacts["train_receipt.json"]["uri"]))
    assert receipt["lora_targets"] == {"modules": sorted(family.lora_modules),
                                       "parameters": sorted(family.lora_parameters)}
    config = json.loads(_fetch(settings, artifacts["adapter/adapter_config.json"]["uri"]))
    assert config["target_modules"] == sorted(family.lora_modules)
    assert config["target_parameters"] == sorted(family.lora_parameters)
    # The bundle verifies offline (its replay digest is the one the run recorded).
    bundle = {name: _fetch(settings, artifacts[name]["uri"]) for name in ("rollouts.jsonl", "replay.json", "summary.json")}
    offline = verify_bundle(write_bundle(tmp_path / "bundle", bundle))
    assert offline["replay_sha256"] == json.loads(bundle["summary.json"])["replay_sha256"]
