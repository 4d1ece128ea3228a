"""gpt-oss's harmony format through the whole stack (Temporal dev server, SeaweedFS, the counter env,
the hf engine): a tiny gpt-oss (sliding + full attention with sinks, routed experts) with the harmony
tokenizer and template, warmed up on the turn format (:mod:`tests.support.model_builders`).

One train run (thinking ``auto``, which harmony resolves on; constrained actions): every recorded
action holds both channels (the analysis message, ``<|end|>``, the final channel's header and
text, ``<|return|>``), the action the environment received is the final channel's text, the whole
action (both channels) is the trainable segment, one iteration trains, and the downloaded run
verifies offline (``kiln openenv verify --run``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln.core.policy import harmony as h

pytestmark = [pytest.mark.asyncio, pytest.mark.heavy]

TRAIN = {
    "kind": "train", "groups": 2, "group_size": 4, "max_steps": 4, "max_action_tokens": 48,
    "constrained_actions": True, "seed_start": 3, "output_adapter": "harmony-out",
    "training_config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8, "on_no_output": "penalty"},
}


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_harmony_run_collects_both_channels_trains_and_verifies(
    kiln_settings: Any, counter_env_url: str, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from api.runs import RunService
    from kiln.cli.app import app as cli_app
    from kiln.core.artifacts.store import S3Store
    from kiln.core.contracts import parse_run_request
    from tests.support.model_builders import build_harmony_model
    from tests.support.kiln_workers import running_workers
    from tests.support.run_folders import download_run
    from tests.support.waiting import workflow_result
    from kiln.core.policy.families import FAMILIES

    folder = build_harmony_model(tmp_path / "gpt-oss")
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    settings = kiln_settings(model_path=folder, device="cpu", dtype="float32")
    request = parse_run_request({**TRAIN, "environment_urls": [counter_env_url]})
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(request)
        final = await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=780)
    assert final["state"] == "completed", final.get("failure")
    assert final["training"]["trained"] is True and final["training"]["selection"]["rollouts_submitted"] == 8
    store = S3Store.from_settings(settings)
    manifest = json.loads(store.get_key(f"runs/{final['run_id']}/manifest.json"))
    run = download_run(store, final["run_id"], manifest, tmp_path / "run")
    receipt = json.loads((run / "train_receipt.json").read_text())
    family = FAMILIES["gpt_oss"]
    assert receipt["lora_targets"] == {"modules": sorted(family.lora_modules),
                                       "parameters": sorted(family.lora_parameters)}
    end, stop = tok.convert_tokens_to_ids([h.END, h.RETURN])
    header = tok.encode(h.START + "assistant" + h.FINAL_HEADER, add_special_tokens=False)
    completions = [c for line in (run / "rollouts.jsonl").read_text().splitlines()
                   for c in json.loads(line)["completions"]]
    assert len(completions) == 8
    actions = 0
    for completion in completions:
        pieces = [p["ids"] for p in completion["tokens"]["pieces"] if p["kind"] == "action"]
        texts = [seg["content"] for seg in completion["trajectory"] if seg["kind"] == "action"]
        observed = [seg["content"] for seg in completion["trajectory"] if seg["kind"] == "observation"]
        count = 0
        for ids, text, observation in zip(pieces, texts, observed):
            # Both channels in the recorded (trainable) ids: analysis, <|end|>, the final header, <|return|>.
            assert ids[-1] == stop and end in ids
            at = next(i for i in range(len(ids)) if ids[i : i + len(header)] == header)
            final_text = tok.decode(ids[at + len(header) : -1]).strip()
            assert h.split_action(text, thinking=True)[1] == final_text
            # The environment received the final channel's action: its count is the sum of them.
            count += json.loads(final_text)["amount"]
            assert observation.startswith(f"Count is {count}.")
            actions += 1
    assert actions >= 8
    shown = CliRunner().invoke(cli_app, ["openenv", "verify", "--run", str(run)])
    assert shown.exit_code == 0, shown.output
