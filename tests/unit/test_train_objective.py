"""The GRPO objective on a tiny random Qwen3: KL pulls toward the base, micro-batching is exact,
admission of the sampling settings (temperature, constrained decoding)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from kiln.core.training_config import TrainingConfig
from kiln.core.errors import PolicyIdentityChanged, TrainingFailed  # noqa: E402
from kiln.core.policy.identity import inference_config, with_inference  # noqa: E402
from kiln.core.train.trainer import train_grpo  # noqa: E402
from tests.unit.test_train_support import BEHAVIOR, bandit_groups, build_tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_qwen3(tmp_path_factory.mktemp("objective-model") / "model")


def _mean_kl_to_base(model_path: Path, adapter_dir: Path, groups: list[dict]) -> float:
    """Exact mean KL(π_adapter ‖ π_base) of the next-token distributions at action targets."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32), str(adapter_dir)
    ).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for group in groups:
            for completion in group["completions"]:
                ids, positions = [], []
                for piece in completion["tokens"]["pieces"]:
                    if piece["kind"] == "action":
                        positions.extend(range(len(ids) - 1, len(ids) - 1 + len(piece["ids"])))
                    ids.extend(piece["ids"])
                x = torch.tensor([ids])
                tuned = torch.log_softmax(model(input_ids=x).logits[0, positions], -1)
                with model.disable_adapter():
                    base = torch.log_softmax(model(input_ids=x).logits[0, positions], -1)
                total += float((tuned.exp() * (tuned - base)).sum())
                count += len(positions)
    return total / count


def test_large_k3_coeff_stays_closer_to_base(model_path, tmp_path):
    groups = bandit_groups(4)
    kls = {}
    for coeff in (0.0, 2.0):
        config = TrainingConfig(echo=None, seed=0, learning_rate=2e-2, kl_coeff=coeff, kl_estimator="k3",
                                optimizer="muon", is_level="token")
        result = train_grpo(model_path=model_path, groups=groups, config=config,
                            output_dir=tmp_path / f"k3-{coeff}")
        kls[coeff] = _mean_kl_to_base(model_path, result.adapter_dir, groups)
    assert kls[0.0] > 0.05, kls  # unconstrained training moved the policy
    assert kls[2.0] * 2.0 <= kls[0.0], kls


def test_k1_penalty_acts_on_the_behaviour_policy(model_path, tmp_path):
    """k1 penalises the behaviour policy's log-ratio to the base (a reward penalty): zero for data
    the base itself sampled (the pre-update log-probs are the base's), active once the policy that
    sampled the data has moved, where a large coefficient keeps the next training closer to base."""
    groups = bandit_groups(4)

    def run(name: str, coeff: float, base_adapter_dir: Path | None = None):
        config = TrainingConfig(echo=None, seed=0, learning_rate=2e-2, kl_coeff=coeff, kl_estimator="k1",
                                optimizer="muon", is_level="token")
        return train_grpo(model_path=model_path, groups=groups, config=config, output_dir=tmp_path / name,
                          base_adapter_dir=base_adapter_dir)

    free, penalised = run("free", 0.0), run("penalised", 2.0)
    assert (free.adapter_dir / "adapter_model.safetensors").read_bytes() == \
        (penalised.adapter_dir / "adapter_model.safetensors").read_bytes()
    warm = free.adapter_dir
    kls = {coeff: _mean_kl_to_base(model_path, run(f"warm-{coeff}", coeff, warm).adapter_dir, groups)
           for coeff in (0.0, 2.0)}
    assert kls[2.0] < kls[0.0], kls


# The weights after the step agree within 1e-5 for both optimizers: Kiln's Muon orthogonalises in
# float32 (kiln.core.train.muon), so float-rounding differences of the accumulated gradient stay
# float-rounding differences of the update (torch's bfloat16 Muon turned them into 1.1e-4 here).
@pytest.mark.parametrize("optimizer,atol", [("adamw", 1e-5), ("muon", 1e-5)])
def test_microbatches_of_one_group_equal_one_batch_of_four(model_path, tmp_path, optimizer, atol):
    groups = bandit_groups(4, warning=True)
    weights, history = {}, {}
    for name, budget in (("one", 1 << 20), ("per-group", 4 * 26)):
        config = TrainingConfig(seed=1, epochs=1, groups_per_step=4, max_tokens_per_microbatch=budget,
                                optimizer=optimizer, learning_rate=1e-2, kl_estimator="k3")
        result = train_grpo(model_path=model_path, groups=groups, config=config, output_dir=tmp_path / name)
        weights[name] = load_file(str(result.adapter_dir / "adapter_model.safetensors"))
        history[name] = result.receipt["steps"]
    assert len(history["one"]) == 1 and history["one"][0]["microbatches"] == 1
    assert history["per-group"][0]["microbatches"] == 4
    assert history["one"][0]["action_tokens"] == 64
    moved = 0.0
    for key, tensor in weights["one"].items():
        assert torch.allclose(tensor, weights["per-group"][key], atol=atol, rtol=0), key
        moved = max(moved, float(tensor.abs().max()))
    assert moved > 1e-3  # the step did change the adapter
    for field in ("loss", "policy_loss", "env_ce", "kl"):
        assert history["one"][0][field] == pytest.approx(history["per-group"][0][field], abs=1e-5)


def _with_sampling(groups: list[dict], **settings) -> tuple[list[dict], dict]:
    identity = with_inference(BEHAVIOR, {"max_action_tokens": 48, **settings})
    for group in groups:
        for completion in group["completions"]:
            completion["openenv"]["behavior_policy"] = identity
    return groups, identity


def test_recorded_with_constrained_decoding_is_refused(model_path, tmp_path):
    groups, identity = _with_sampling(bandit_groups(2), constrained_actions=True)
    with pytest.raises(TrainingFailed) as err:
        train_grpo(model_path=model_path, groups=groups, config=TrainingConfig(behavior_policy="recorded"),
                   output_dir=tmp_path, expected_behavior_policy=identity)
    assert err.value.code == "training_recorded_constrained"
    assert "constrained" in err.value.message and not (tmp_path / "adapter").exists()


def test_tampered_inference_block_is_refused(model_path, tmp_path):
    groups, identity = _with_sampling(bandit_groups(2), temperature=0.7)
    identity["inference"] = {**identity["inference"], "temperature": 1.0}  # digest now stale
    with pytest.raises(PolicyIdentityChanged) as err:
        train_grpo(model_path=model_path, groups=groups, config=TrainingConfig(), output_dir=tmp_path,
                   expected_behavior_policy=identity)
    assert "inference_config_sha256" in err.value.message


def test_scoring_temperature_comes_from_the_identity(model_path, tmp_path):
    groups, identity = _with_sampling(bandit_groups(2), temperature=0.5)
    result = train_grpo(model_path=model_path, groups=groups, config=TrainingConfig(epochs=1),
                        output_dir=tmp_path, expected_behavior_policy=identity)
    grpo = result.receipt["grpo"]
    assert grpo["scoring_temperature"] == 0.5 and grpo["sampling"] == inference_config(
        {"temperature": 0.5, "max_action_tokens": 48}
    )


def test_inference_digest_covers_every_sampling_setting():
    base = with_inference({"base_model_sha256": "x"}, {})
    assert base["inference"] == {
        "temperature": 1.0, "top_p": 1.0, "thinking": True, "thinking_budget_tokens": None,
        "max_action_tokens": 256, "constrained_actions": False,
    }
    changes = [{"temperature": 0.7}, {"thinking": False}, {"thinking_budget_tokens": 8},
               {"max_action_tokens": 48}, {"constrained_actions": True}]
    digests = {with_inference({}, change)["inference_config_sha256"] for change in changes}
    assert len(digests) == len(changes) and base["inference_config_sha256"] not in digests
    # settings that do not change the sampling distribution do not change the digest
    same = with_inference({}, {"group_size": 8, "concurrency": 2, "max_steps": 3})
    assert same["inference_config_sha256"] == base["inference_config_sha256"]


def test_gradient_checkpointing_gives_the_same_step(model_path, tmp_path):
    groups = bandit_groups(2, warning=True)
    weights = {}
    for flag in (False, True):
        config = TrainingConfig(seed=2, epochs=1, groups_per_step=2, gradient_checkpointing=flag,
                                optimizer="adamw", learning_rate=1e-2)
        result = train_grpo(model_path=model_path, groups=groups, config=config, output_dir=tmp_path / str(flag))
        weights[flag] = load_file(str(result.adapter_dir / "adapter_model.safetensors"))
        assert result.receipt["grpo"]["gradient_checkpointing"] is flag
    for key, tensor in weights[False].items():
        assert torch.allclose(tensor, weights[True][key], atol=1e-6, rtol=0), key


def test_learning_rate_schedule_values():
    from kiln.core.train.optim import learning_rate_at

    constant = [learning_rate_at(s, 6, 1.0, warmup_steps=2, schedule="constant") for s in range(1, 7)]
    assert constant == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    cosine = [learning_rate_at(s, 6, 1.0, warmup_steps=2, schedule="cosine") for s in range(1, 7)]
    # warm-up 1/2, 2/2; then 0.5·(1 + cos(π·k/4)) for k = 0..3 (the first step after warm-up at full rate)
    assert cosine == pytest.approx([0.5, 1.0, 1.0, 0.8535534, 0.5, 0.1464466], abs=1e-7)


def test_resolved_learning_rate_per_optimizer():
    assert TrainingConfig().resolved_learning_rate() == 3e-4  # AdamW
    assert TrainingConfig(optimizer="muon").resolved_learning_rate() == 2e-3
    assert TrainingConfig(optimizer="adamw", learning_rate=3e-4).resolved_learning_rate() == 3e-4
    defaults = TrainingConfig()
    assert (defaults.kl_coeff, defaults.kl_estimator, defaults.is_level, defaults.cispo_max_weight) == (
        0.0, "k1", "cispo", 5.0
    )
