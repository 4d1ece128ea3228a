"""The family matrix on the hf engine: one train run per family, each property checked against it.

Families: qwen3, qwen3_5 (the hub's vision-language layout), qwen3_next, qwen3_moe, gpt_oss
(harmony tokenizer and template), llama, gemma3 and granitemoehybrid (a Mamba hybrid); tiny random
models with each family's real layer pattern (:mod:`tests.support.family_models`) and each
template family's tokenizer. One run per family (Temporal dev server, SeaweedFS, the counter env;
one iteration, thinking off, constrained actions) is shared by the parametrised tests:

- the run collects, trains one iteration, its receipt names the family entry's LoRA targets and
  the downloaded run verifies offline (``kiln openenv verify --run``);
- the sampler's log-probs and one-pass scoring (the trainer's forward) agree within
  :data:`TOLERANCE`, with the trained adapter;
- the adapter's samples differ from the base's (same prompt, same seed);
- batch invariance wherever the family claims it (every family here): a row's ids and log-probs
  are bit-identical alone and beside other rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln.core.policy.families import FAMILIES

pytestmark = pytest.mark.asyncio

TOLERANCE = 1e-4  # float32 on CPU (docs/models.md "Batch-invariant sampling": one-pass scoring)
# case -> template family of its tokenizer
MATRIX = {"qwen3": "qwen3", "qwen3_5": "qwen3", "qwen3_next": "qwen3", "qwen3_moe": "qwen3",
          "gpt_oss": "harmony", "llama": "llama3", "gemma3": "gemma", "granitemoehybrid": "qwen3"}
TRAIN = {
    "kind": "train", "groups": 2, "group_size": 4, "max_steps": 3, "max_action_tokens": 24, "thinking": False,
    "constrained_actions": True, "seed_start": 3,
    "training_config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8, "on_no_output": "penalty"},
}
_RUNS: dict[str, tuple[Path, Path, dict]] = {}
_RUNTIMES: dict[str, Any] = {}


async def _trained(case: str, kiln_settings: Any, counter_env_url: str, factory: Any) -> tuple[Path, Path, dict]:
    """(model folder, downloaded run folder, final status) of ``case``'s one run (made once)."""
    if case in _RUNS:
        return _RUNS[case]
    from api.runs import RunService
    from kiln.core.artifacts.store import S3Store
    from kiln.core.contracts import parse_run_request
    from tests.support.family_models import build_family_folder
    from tests.support.kiln_workers import running_workers
    from tests.support.run_folders import download_run
    from tests.support.waiting import workflow_result

    root = factory.mktemp(f"matrix-{case}")
    folder = build_family_folder(case, root / "model", template=MATRIX[case])
    settings = kiln_settings(model_path=folder, device="cpu", dtype="float32")
    request = parse_run_request({**TRAIN, "environment_urls": [counter_env_url], "output_adapter": f"m-{case}"})
    async with running_workers(settings) as client:
        status, _ = await RunService(client, settings).submit(request)
        final = await workflow_result(client.get_workflow_handle(status.run_id), timeout_s=480)
    assert final["state"] == "completed", final.get("failure")
    store = S3Store.from_settings(settings)
    manifest = json.loads(store.get_key(f"runs/{final['run_id']}/manifest.json"))
    _RUNS[case] = (folder, download_run(store, final["run_id"], manifest, root / "run"), final)
    return _RUNS[case]


def _runtime(folder: Path) -> Any:
    from kiln.core.policy.runtime import PolicyRuntime

    if str(folder) not in _RUNTIMES:
        _RUNTIMES[str(folder)] = PolicyRuntime.load(folder, device="cpu", dtype="float32")
    return _RUNTIMES[str(folder)]


def _prompt(rt: Any) -> list[int]:
    return rt.encode_prompt([{"role": "system", "content": "Act in the environment."},
                             {"role": "user", "content": "Count is 3. Target is 10."}], thinking=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(MATRIX))
async def test_each_family_collects_trains_one_iteration_and_verifies(
    case: str, kiln_settings: Any, counter_env_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from typer.testing import CliRunner

    from kiln.cli.app import app as cli_app

    _folder, run, final = await _trained(case, kiln_settings, counter_env_url, tmp_path_factory)
    assert final["training"]["trained"] is True and final["training"]["selection"]["rollouts_submitted"] == 8
    lines = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [len(line["completions"]) for line in lines] == [4, 4]
    family = FAMILIES[case]
    receipt = json.loads((run / "train_receipt.json").read_text())
    assert receipt["lora_targets"] == {"modules": sorted(family.lora_modules),
                                       "parameters": sorted(family.lora_parameters)}
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(family.lora_modules)
    shown = CliRunner().invoke(cli_app, ["openenv", "verify", "--run", str(run)])
    assert shown.exit_code == 0, shown.output


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(MATRIX))
async def test_sampler_and_one_pass_scoring_agree_and_the_adapter_changes_samples(
    case: str, kiln_settings: Any, counter_env_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder, run, _ = await _trained(case, kiln_settings, counter_env_url, tmp_path_factory)
    rt = _runtime(folder)
    prompt = _prompt(rt)
    adapter = run / "adapter"
    tuned = rt.sample([prompt, prompt], [7, 8], max_new_tokens=12, temperature=1.0, thinking=False,
                      adapter_dir=adapter)
    base = rt.sample([prompt, prompt], [7, 8], max_new_tokens=12, temperature=1.0, thinking=False)
    for sample in tuned:
        scored = rt.logprobs_of(prompt, sample.ids, temperature=1.0, thinking=False, adapter_dir=adapter)
        assert len(scored) == len(sample.logprobs) > 0
        assert max(abs(a - b) for a, b in zip(scored, sample.logprobs)) < TOLERANCE
    # Same prompt, same seeds: the trained adapter's distribution is not the base's.
    assert [(s.ids, s.logprobs) for s in tuned] != [(s.ids, s.logprobs) for s in base]
    base_scored = rt.logprobs_of(prompt, tuned[0].ids, temperature=1.0, thinking=False)
    assert base_scored != tuned[0].logprobs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(MATRIX))
async def test_rows_are_batch_invariant_where_the_family_claims_it(
    case: str, kiln_settings: Any, counter_env_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder, run, _ = await _trained(case, kiln_settings, counter_env_url, tmp_path_factory)
    if not FAMILIES[case].batch_invariant:
        pytest.skip(f"{case} does not claim batch invariance (its entry says so; docs/models.md)")
    rt = _runtime(folder)
    prompt = _prompt(rt)
    other = rt.encode_prompt([{"role": "user", "content": "Count is 9."}], thinking=False)
    adapter = run / "adapter"
    alone = rt.sample([prompt], [5], max_new_tokens=12, temperature=1.0, thinking=False, adapter_dir=adapter)[0]
    crowd = rt.sample([other, prompt, other, prompt], [1, 5, 2, 6], max_new_tokens=12, temperature=1.0,
                      thinking=False, adapter_dir=adapter)
    assert (crowd[1].ids, crowd[1].logprobs) == (alone.ids, alone.logprobs)
