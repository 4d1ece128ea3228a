"""`kiln train grpo --input X.rollouts.jsonl`: training from a saved rollouts file through the API,
the same `train_adapter` activity, and the same on-policy proof."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kiln.cli.app import app as cli_app
from tests.integration.test_api_helpers import serve_api
from tests.support.kiln_workers import running_workers

pytestmark = pytest.mark.asyncio


def _cli(api_url: str, *args: str) -> Any:
    return CliRunner().invoke(cli_app, list(args), env={"KILN_API_URL": api_url, "COLUMNS": "200"})


async def test_train_grpo_from_saved_rollouts(kiln_settings: Any, counter_env_url: str, tmp_path: Path) -> None:
    settings = kiln_settings()
    out = tmp_path / "x.rollouts.jsonl"
    async with running_workers(settings):
        with serve_api(settings) as api_url:
            rollout = await asyncio.to_thread(
                _cli, api_url, "openenv", "rollout", "--environment", counter_env_url,
                "--groups", "3", "--group-size", "4", "--max-steps", "4", "--max-action-tokens", "48",
                "--output", str(out), "--summary-output", str(tmp_path / "x.rollout-summary.json"),
                "--replay-output", str(tmp_path / "x.replay.json"),
            )
            assert rollout.exit_code == 0, rollout.output
            verified = await asyncio.to_thread(
                _cli, api_url, "openenv", "verify", "--summary", str(tmp_path / "x.rollout-summary.json"), "--json"
            )
            assert verified.exit_code == 0, verified.output
            assert json.loads(verified.output)["rollouts"] == 12

            trained = await asyncio.to_thread(
                _cli, api_url, "train", "grpo", "--input", str(out), "--output-adapter", "from-file",
                "--learning-rate", "1e-3", "--epochs", "2", "--lora-rank", "4", "--lora-alpha", "8",
                "--report-to", "tensorboard", "--json",
            )
            assert trained.exit_code == 0, trained.output
            final = json.loads(trained.output[trained.output.index("{"):])
            # report_to reaches dataset runs too: the tracker holds one loss point per step.
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            accumulator = EventAccumulator(str(settings.home / "trackers" / final["run_id"] / "tensorboard"))
            accumulator.Reload()
            losses = [e.value for e in accumulator.Scalars("train/loss")]
            assert len(losses) == final["training"]["steps"] > 0
            assert final["state"] == "completed" and final["kind"] == "train_dataset"
            names = {a["name"]: a for a in final["artifacts"]}
            assert set(names) == {
                "rollouts.jsonl", "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "train_receipt.json",
                "metrics.jsonl",
            }
            import hashlib

            assert names["rollouts.jsonl"]["sha256"] == "sha256:" + hashlib.sha256(out.read_bytes()).hexdigest()
            assert final["training"]["trained"] is True and final["training"]["steps"] > 0

            # A corpus whose behaviour policy names another base model fails closed.
            lines = [json.loads(line) for line in out.read_text().splitlines()]
            for line in lines:
                for completion in line["completions"]:
                    completion["openenv"]["behavior_policy"]["base_model_sha256"] = "sha256:" + "0" * 64
            forged = tmp_path / "forged.rollouts.jsonl"
            forged.write_text("".join(json.dumps(line) + "\n" for line in lines))
            refused = await asyncio.to_thread(
                _cli, api_url, "train", "grpo", "--input", str(forged), "--output-adapter", "forged", "--json",
            )
            assert refused.exit_code == 1
            failed = json.loads(refused.output[refused.output.index("{"):])
            assert failed["state"] == "failed"
            assert failed["failure"]["code"] == "policy_identity_changed"
