"""train_grpo end to end on a tiny random Qwen3: learning, ECHO, determinism, resume, identity."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kiln.core.canonical import pretty_json  # noqa: E402
from kiln.core.training_config import TrainingConfig
from kiln.core.errors import PolicyIdentityChanged, RunCancelled, TrainingFailed  # noqa: E402
from kiln.core.policy.identity import ADAPTER_FILES  # noqa: E402
from kiln.core.train.batches import build_group_batch  # noqa: E402
from kiln.core.train.model import adapter_content_sha256  # noqa: E402
from kiln.core.train.trainer import train_grpo  # noqa: E402
from tests.support.train_reference import evaluate  # noqa: E402
from tests.unit.test_train_support import (  # noqa: E402
    BEHAVIOR,
    X_TOKEN,
    Y_TOKEN,
    bandit_groups,
    build_tiny_qwen3,
    context,
    logprob_of,
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_qwen3(tmp_path_factory.mktemp("train-model") / "model")


def _base(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


def _load(model_path, adapter_dir):
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(model_path), str(adapter_dir)).eval()


def _bytes(adapter_dir: Path) -> dict[str, bytes]:
    return {name: (adapter_dir / name).read_bytes() for name in ADAPTER_FILES}


@pytest.fixture(scope="module")
def bandit_run(model_path, tmp_path_factory):
    """GRPO only (ECHO off), default epochs and optimizer (Muon), the tiny model's learning rate."""
    steps = []
    config = TrainingConfig(echo=None, seed=0, learning_rate=2e-2, optimizer="muon", is_level="token", kl_coeff=0.1)
    result = train_grpo(
        model_path=model_path,
        groups=bandit_groups(4),
        config=config,
        output_dir=tmp_path_factory.mktemp("bandit"),
        expected_behavior_policy=BEHAVIOR,
        progress=steps.append,
    )
    return result, steps


def test_grpo_learns_rewarded_action(model_path, bandit_run):
    result, steps = bandit_run
    base = _base(model_path)
    tuned = _load(model_path, result.adapter_dir)
    for g in range(4):
        before_x = logprob_of(base, context(g), X_TOKEN)
        after_x = logprob_of(tuned, context(g), X_TOKEN)
        assert after_x > before_x + 2.0, (g, before_x, after_x)
        assert logprob_of(tuned, context(g), Y_TOKEN) < logprob_of(base, context(g), Y_TOKEN)
    assert result.steps == 16 and [s["step"] for s in steps] == list(range(1, 17))
    assert set(steps[0]) == {
        "step", "total_steps", "loss", "policy_loss", "env_ce", "kl", "clip_fraction", "grad_norm",
        "learning_rate", "action_tokens", "tokens_per_s", "microbatches", "max_ratio_deviation", "approx_kl",
    }
    assert all(s["total_steps"] == 16 and s["action_tokens"] == 16 for s in steps)


def test_only_step_one_is_on_policy_and_the_clip_acts_later(bandit_run):
    history = bandit_run[0].receipt["steps"]
    first = [h for h in history if h["epoch"] == 0]
    later = [h for h in history if h["epoch"] > 0]
    assert len(first) == 4
    # old = every row's log-probs before step 1: ratio exactly 1 at step 1 only
    assert history[0]["max_ratio_deviation"] == 0.0 and history[0]["clip_fraction"] == 0.0
    assert all(h["max_ratio_deviation"] > 0.0 for h in history[1:])
    assert any(h["clip_fraction"] > 0.0 for h in later)


def test_receipt_contents(model_path, bandit_run):
    result, _ = bandit_run
    receipt = result.receipt
    assert receipt["schema"] == "kiln.train-receipt.v1" and receipt["status"] == "success"
    assert receipt["adapter_sha256"] == adapter_content_sha256(result.adapter_dir)
    from kiln.core.canonical import digest_json

    assert receipt["training_data_sha256"] == digest_json(bandit_groups(4))
    from kiln.core.policy.identity import adapter_content_sha256 as runtime_adapter_digest
    from kiln.core.policy.identity import model_content_sha256

    assert receipt["adapter_sha256"] == runtime_adapter_digest(result.adapter_dir)
    assert receipt["base_model_sha256"] == model_content_sha256(model_path)
    assert receipt["config"]["echo"] is None and receipt["config"]["learning_rate"] == 2e-2
    grpo = receipt["grpo"]
    assert grpo["optimizer"]["name"] == "muon" and grpo["optimizer"]["learning_rate"] == 2e-2
    assert grpo["optimizer"]["implementation"] == "kiln.core.train.muon" and grpo["optimizer"]["ns_dtype"] == "float32"
    assert grpo["kl_estimator"] == "k1" and grpo["kl_coeff"] == 0.1
    assert grpo["kl_application"] == "advantage_penalty_stop_gradient"
    assert grpo["is_level"] == "token" and grpo["groups_per_step"] == 1
    assert receipt["echo"]["enabled"] is False
    assert receipt["token_counts"]["action_tokens"] == 64
    assert len(receipt["steps"]) == 16 and receipt["lora_delta_norm"] > 0
    assert receipt["selection"]["groups_submitted"] == 4
    on_disk = (result.adapter_dir.parent / "train_receipt.json").read_bytes()
    assert on_disk == pretty_json(receipt)


def test_saved_adapter_reproduces_trainer_logprobs(model_path, bandit_run):
    result, _ = bandit_run
    tuned = _load(model_path, result.adapter_dir)
    batches = [build_group_batch(g, warning_filter=True) for g in bandit_groups(4)]
    sums = evaluate(tuned, batches, torch.device("cpu"))["action_logprob_sums"]
    for got_row, want_row in zip(sums, result.final_action_logprob_sums):
        for got, want in zip(got_row, want_row):
            assert abs(got - want) <= 1e-5


def test_echo_lowers_observation_ce(model_path, bandit_run, tmp_path):
    config = TrainingConfig(seed=0, echo={"lambda": 0.5}, learning_rate=2e-2, optimizer="muon", is_level="token",
                            kl_coeff=0.1)
    result = train_grpo(
        model_path=model_path, groups=bandit_groups(4, warning=True), config=config,
        output_dir=tmp_path,
    )
    echo = result.receipt["echo"]
    assert echo["enabled"] and echo["lambda"] == 0.5 and echo["warning_filter"] is True
    assert echo["final_env_ce"] < 0.5 * echo["initial_env_ce"]
    no_echo = bandit_run[0].receipt["echo"]
    assert echo["final_env_ce"] < no_echo["final_env_ce"]
    counts = result.receipt["token_counts"]
    assert counts["warning_tokens_filtered"] == 4 * 4 * 3
    assert counts["env_tokens_after_warning_filter"] == 4 * 4 * 12


def test_deterministic_and_resume_is_bit_exact(model_path, tmp_path):
    config = TrainingConfig(seed=3, checkpoint_interval=5, epochs=3)
    groups = bandit_groups(3, warning=True)
    sunk: list[int] = []
    first = train_grpo(
        model_path=model_path, groups=groups, config=config, output_dir=tmp_path / "a",
        checkpoint_sink=lambda step, folder: sunk.append(step),
    )
    second = train_grpo(
        model_path=model_path, groups=groups, config=config, output_dir=tmp_path / "b"
    )
    assert sunk == [5]  # 3 groups × 3 epochs = 9 steps
    assert first.steps == 9
    assert _bytes(first.adapter_dir) == _bytes(second.adapter_dir)

    # interrupt after step 7 (cancellation between steps), then resume from the step-5 checkpoint
    calls = {"n": 0}

    def cancel_after_seven():
        calls["n"] += 1
        return calls["n"] > 7

    with pytest.raises(RunCancelled):
        train_grpo(model_path=model_path, groups=groups, config=config, output_dir=tmp_path / "c",
                   should_cancel=cancel_after_seven)
    checkpoint = tmp_path / "saved-step-5"
    shutil.copytree(tmp_path / "c" / "checkpoints" / "step-000005", checkpoint)
    resumed = train_grpo(model_path=model_path, groups=groups, config=config,
                         output_dir=tmp_path / "d", resume_from=checkpoint)
    assert _bytes(resumed.adapter_dir) == _bytes(first.adapter_dir)
    assert resumed.receipt["resumed_from_step"] == 5
    assert resumed.receipt["steps"] == first.receipt["steps"]
    assert resumed.receipt["echo"] == first.receipt["echo"]

    assert resumed.receipt["checkpoint"] == {"used": True, "step": 5, "reason": None,
                                             "written_by": first.receipt["trainer"]}
    assert "checkpoint" not in first.receipt

    # Another seed: the checkpoint is not this training's, so it restarts from step 0 (never fails)
    # and trains exactly what a fresh training of that config trains.
    other = TrainingConfig(seed=4, checkpoint_interval=5, epochs=3)
    restarted = train_grpo(model_path=model_path, groups=groups, config=other, output_dir=tmp_path / "e",
                           resume_from=checkpoint)
    fresh = train_grpo(model_path=model_path, groups=groups, config=other, output_dir=tmp_path / "f")
    assert _bytes(restarted.adapter_dir) == _bytes(fresh.adapter_dir) != _bytes(first.adapter_dir)
    assert restarted.receipt["resumed_from_step"] is None and restarted.steps == 9
    assert restarted.receipt["checkpoint"] == {
        "used": False, "step": 5, "reason": "the checkpoint's settings_sha256 differs from this training's",
        "written_by": first.receipt["trainer"]}


def test_policy_identity_mismatch(model_path, tmp_path):
    groups = bandit_groups(2)
    policy = groups[1]["completions"][2]["openenv"]["behavior_policy"]
    policy["adapter_sha256"] = "sha256:" + "1" * 64
    with pytest.raises(PolicyIdentityChanged) as err:
        train_grpo(model_path=model_path, groups=groups, config=TrainingConfig(),
                   output_dir=tmp_path, expected_behavior_policy=BEHAVIOR)
    assert err.value.code == "policy_identity_changed"
    assert not (tmp_path / "adapter").exists()


def test_zero_groups(model_path, tmp_path):
    flat = bandit_groups(1, reward=1.0)  # no reward variation
    with pytest.raises(TrainingFailed) as err:
        train_grpo(model_path=model_path, groups=flat, config=TrainingConfig(), output_dir=tmp_path)
    assert err.value.code == "zero_groups"
    with pytest.raises(TrainingFailed):
        train_grpo(model_path=model_path, groups=[], config=TrainingConfig(), output_dir=tmp_path)


def test_recorded_policy_with_kl_and_warm_start(model_path, bandit_run, tmp_path):
    config = TrainingConfig(behavior_policy="recorded", kl_coeff=0.1, epochs=2, optimizer="muon", is_level="token")
    result = train_grpo(model_path=model_path, groups=bandit_groups(2), config=config,
                        output_dir=tmp_path / "r", base_adapter_dir=bandit_run[0].adapter_dir)
    history = result.receipt["steps"]
    assert result.receipt["grpo"]["importance"] == "recorded"
    assert result.receipt["base_adapter_sha256"] == bandit_run[0].receipt["adapter_sha256"]
    assert history[0]["kl"] != 0.0  # warm-started adapter differs from the base at step 1
    assert any(h["clip_fraction"] > 0 for h in history)

    no_lp = bandit_groups(1, logprobs=False)
    with pytest.raises(TrainingFailed) as err:
        train_grpo(model_path=model_path, groups=no_lp, config=config, output_dir=tmp_path / "n")
    assert err.value.code == "invalid_training_data"
