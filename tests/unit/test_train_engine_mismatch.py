"""The trainer's correction of another engine's sampling gap: data whose behaviour identity names
the vllm engine is weighted by ``min(π_trainer / π_engine, cap)`` on its recorded log-probs, and
the receipt's ``engine_mismatch`` block records the gap; hf data gets neither (its receipt and
effective config read as before the setting existed)."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

from kiln.core.training_config import TrainingConfig
from kiln.core.errors import TrainingFailed  # noqa: E402
from kiln.core.train.trainer import train_grpo  # noqa: E402
from tests.unit.test_train_support import BEHAVIOR, bandit_groups, build_tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.timeout(240)

# what the vllm engine's behaviour identity adds (kiln.core.policy.engine.engine_identity_fields)
VLLM = {**BEHAVIOR, "runtime": {**BEHAVIOR["runtime"], "engine": {"name": "vllm", "version": "0.32.0"}}}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_qwen3(tmp_path_factory.mktemp("engine-mismatch") / "model")


def _base_action_logprobs(model_path, completion: dict) -> list[list[float]]:
    """Reference loop: the base model's log-prob of every action token, per action piece (what a
    fresh adapter, whose LoRA B is zero, gives the trainer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    ids, spans = [], []
    for piece in completion["tokens"]["pieces"]:
        if piece["kind"] == "action":
            spans.append((len(ids), len(piece["ids"])))
        ids.extend(piece["ids"])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return [[float(logprobs[start + i - 1, ids[start + i]]) for i in range(n)] for start, n in spans]


def _as_engine_data(model_path, groups: list[dict], identity: dict, shift: float) -> list[dict]:
    """The groups, re-labelled as sampled with ``identity``, each action piece's recorded log-probs
    the base model's own moved by ``shift`` (an engine whose numbers differ from the trainer's)."""
    out = copy.deepcopy(groups)
    for group in out:
        for completion in group["completions"]:
            completion["openenv"]["behavior_policy"] = identity
            pieces = [p for p in completion["tokens"]["pieces"] if p["kind"] == "action"]
            for piece, values in zip(pieces, _base_action_logprobs(model_path, completion)):
                piece["logprobs"] = [v + shift for v in values]
    return out


def _config(**overrides) -> TrainingConfig:
    return TrainingConfig(**{"seed": 1, "epochs": 1, "echo": None, "learning_rate": 1e-2, **overrides})


def _train(model_path, tmp_path, name, groups, identity, **overrides):
    return train_grpo(model_path=model_path, groups=groups, config=_config(**overrides),
                      output_dir=tmp_path / name, expected_behavior_policy=identity)


def test_hf_data_has_no_engine_block_and_no_engine_setting(model_path, tmp_path):
    result = _train(model_path, tmp_path, "hf", bandit_groups(2), BEHAVIOR)
    assert "engine_mismatch" not in result.receipt
    assert "engine_is_max_weight" not in result.receipt["config"]
    assert all("is_weight_max" not in step for step in result.receipt["steps"])


def test_vllm_data_is_weighted_and_the_gap_is_recorded(model_path, tmp_path):
    base = bandit_groups(2)
    exact = _train(model_path, tmp_path, "hf", base, BEHAVIOR)
    # the engine's recorded log-probs are 0.5 nats above the trainer's: every weight is e^-0.5
    result = _train(model_path, tmp_path, "vllm", _as_engine_data(model_path, base, VLLM, 0.5), VLLM)
    block = result.receipt["engine_mismatch"]
    assert block["engine"] == "vllm" and block["correction"] == "truncated_is" and block["is_cap"] == 2.0
    tokens = sum(len(p["logprobs"]) for g in base for c in g["completions"]
                 for p in c["tokens"]["pieces"] if p["kind"] == "action")
    assert block["tokens"] == tokens
    assert block["mean_abs_delta"] == pytest.approx(0.5, abs=1e-4)
    assert block["max_abs_delta"] == pytest.approx(0.5, abs=1e-4)
    assert block["is_weight_mean"] == pytest.approx(math.exp(-0.5), abs=1e-4)
    assert block["is_truncated_fraction"] == 0.0
    assert result.receipt["config"]["engine_is_max_weight"] == 2.0
    steps = result.receipt["steps"]
    assert all(s["is_weight_max"] == pytest.approx(math.exp(-0.5), abs=1e-4) for s in steps)
    # the weights scale the policy term: the first step's loss is e^-0.5 times the hf run's
    assert steps[0]["policy_loss"] == pytest.approx(math.exp(-0.5) * exact.receipt["steps"][0]["policy_loss"],
                                                    rel=1e-4)


def test_the_cap_truncates_and_the_uncorrected_cases_say_why(model_path, tmp_path):
    base = bandit_groups(2)
    below = _as_engine_data(model_path, base, VLLM, -3.0)  # the trainer's probability e^3 times the engine's
    capped = _train(model_path, tmp_path, "capped", below, VLLM, engine_is_max_weight=1.5)
    block = capped.receipt["engine_mismatch"]
    assert block["is_cap"] == 1.5 and block["is_truncated_fraction"] == 1.0 and block["is_weight_max"] == 1.5
    recorded = _train(model_path, tmp_path, "recorded", below, VLLM, behavior_policy="recorded")
    block = recorded.receipt["engine_mismatch"]
    assert block["correction"] == "none" and block["reason"] == "behavior_policy_recorded"
    assert "is_cap" not in block and block["mean_abs_delta"] == pytest.approx(3.0, abs=1e-4)


def test_vllm_data_without_recorded_logprobs_is_refused(model_path, tmp_path):
    groups = copy.deepcopy(bandit_groups(1, logprobs=False))
    for completion in groups[0]["completions"]:
        completion["openenv"]["behavior_policy"] = VLLM
    with pytest.raises(TrainingFailed) as failed:
        _train(model_path, tmp_path, "none", groups, VLLM)
    assert failed.value.code == "invalid_training_data" and "vllm engine" in str(failed.value)
    assert not (tmp_path / "none" / "adapter").exists()
