"""Full fine-tuning (training_config.adapter: full): the gradient of every base weight against the
LoRA path's (at B = 0 the loss is the same, and LoRA's B gradient is ``scale · G_W · Aᵀ`` of the
full path's weight gradient ``G_W``), every tensor moving, the full-weights folder and its receipt,
a second iteration from the first's weights, the runtime serving the weights without touching its
base, and the settings full training refuses. The request digest of the default (lora) is pinned."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pydantic import ValidationError  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from kiln.core.errors import FullTrainingUnsupported  # noqa: E402
from kiln.core.policy.identity import adapter_content_sha256, is_full_weights, model_content_sha256  # noqa: E402
from kiln.core.train.batches import group_rows  # noqa: E402
from kiln.core.train.full import load_full_model  # noqa: E402
from kiln.core.train.model import attach_lora, load_base_model, trainable_parameters  # noqa: E402
from kiln.core.train.step import LogprobCache, StepSettings, train_step  # noqa: E402
from kiln.core.train.trainer import train_grpo  # noqa: E402
from kiln.core.training_config import TrainingConfig  # noqa: E402
from tests.support.models import make_lora_adapter, shared_tiny_model  # noqa: E402
from tests.unit.test_train_support import bandit_groups, build_tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.timeout(300)

RANK, ALPHA = 4, 8.0
FULL = {"adapter": "full", "seed": 3, "epochs": 1, "learning_rate": 1e-3, "groups_per_step": 2}


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_qwen3(tmp_path_factory.mktemp("full-model") / "model")


def _step(model, rows):
    settings = StepSettings(clip_epsilon=0.2, kl_coeff=0.0, kl_estimator="none", echo_lambda=0.05,
                            max_grad_norm=1e9, recorded=False, is_level="cispo", max_tokens_per_microbatch=96,
                            entropy_coeff=0.01)
    named = trainable_parameters(model)
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.0)  # the gradient is compared, the weights stay
    figures = train_step(model, rows, optimizer, [p for _, p in named], settings, LogprobCache(), torch.device("cpu"))
    return figures, {name: p.grad.clone() for name, p in named if p.grad is not None}


def test_full_gradient_is_the_lora_gradient_through_its_factors(qwen3_path):
    rows = [r for g, group in enumerate(bandit_groups(2, warning=True)) for r in group_rows(group, group_index=g,
                                                                                          warning_filter=True)]
    full = load_full_model(qwen3_path, "cpu", "float32", trainable=True)
    lora = attach_lora(load_base_model(qwen3_path, "cpu"), rank=RANK, alpha=ALPHA, seed=3, base_adapter_dir=None)
    full_figures, full_grads = _step(full, rows)
    lora_figures, lora_grads = _step(lora, rows)
    # B = 0: the LoRA model computes the base function, so the step's loss is the same
    for key in ("loss", "policy_loss", "env_ce", "entropy"):
        assert full_figures[key] == pytest.approx(lora_figures[key], abs=1e-6), key
    assert full_figures["env_ce"] > 0
    # every base tensor is trained and gets a gradient (nothing is frozen)
    assert set(full_grads) == {n for n, _ in full.named_parameters()}
    assert all(float(g.abs().max()) > 0 for g in full_grads.values())
    # dL/dB = scale · dL/dW · Aᵀ for y = W x + scale · B A x
    scale = ALPHA / RANK
    modules = dict(lora.named_modules())
    checked = 0
    for name, grad_b in lora_grads.items():
        if not name.endswith("lora_B.default.weight"):
            continue
        owner = name.removesuffix(".lora_B.default.weight")
        a = modules[owner].lora_A["default"].weight.detach()
        weight = owner.removeprefix("base_model.model.") + ".weight"
        expected = scale * full_grads[weight] @ a.T
        assert torch.allclose(grad_b, expected, atol=1e-6, rtol=1e-4), name
        checked += 1
    assert checked == 2 * 7  # 2 layers × (q k v o gate up down)


def _train(path: Path, out: Path, **kwargs):
    return train_grpo(model_path=path, groups=bandit_groups(2, warning=True),
                      config=TrainingConfig.model_validate(FULL), output_dir=out, **kwargs)


def test_full_training_moves_every_tensor_and_names_its_weights(qwen3_path, tmp_path):
    first = _train(qwen3_path, tmp_path / "one", keep_state=True)
    folder = first.adapter_dir
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert is_full_weights(folder)
    base = load_file(str(qwen3_path / "model.safetensors"))
    trained = load_file(str(folder / "model.safetensors"))
    assert set(trained) == set(base)
    assert all(not torch.equal(trained[k], base[k]) for k in base), [k for k in base if torch.equal(trained[k], base[k])]
    receipt = first.receipt
    digest = model_content_sha256(folder)
    assert receipt["adapter_sha256"] == digest == adapter_content_sha256(folder)
    assert receipt["adapter"] == {"kind": "full", "sha256": digest,
                                  "bytes": sum(p.stat().st_size for p in folder.iterdir())}
    assert receipt["config"]["adapter"] == "full"
    assert receipt["lora_delta_norm"] is None and "lora_targets" not in receipt
    # the weight deltas, brute force from the two files
    for key in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        if key in base:
            expected = float(torch.linalg.vector_norm(trained[key] - base[key]))
            assert receipt["weights_delta_norms"][key] == pytest.approx(expected, rel=1e-5)
    drift = receipt["policy_drift"]
    assert drift["kl_to_previous"] == drift["kl_to_base"] > 0  # π_start is the base itself

    # iteration 2 starts from iteration 1's weights and continues its optimizer state
    second = _train(qwen3_path, tmp_path / "two", base_adapter_dir=folder, init_state=first.final_state,
                    iteration=2)
    assert second.receipt["base_adapter_sha256"] == digest
    assert second.receipt["continued_from"] == {"adapter_sha256": digest, "optimizer_state_sha256":
                                                first.final_state_sha256, "optimizer_steps_before": first.steps}
    drift2 = second.receipt["policy_drift"]
    assert 0 < drift2["kl_to_previous"] < drift2["kl_to_base"]
    assert second.receipt["adapter_sha256"] != digest


def test_full_training_from_a_lora_adapter_is_refused(qwen3_path, tmp_path):
    adapter = make_lora_adapter(qwen3_path, tmp_path / "lora")
    with pytest.raises(FullTrainingUnsupported) as info:
        _train(qwen3_path, tmp_path / "out", base_adapter_dir=adapter)
    assert info.value.code == "full_training_unsupported" and not info.value.retryable
    assert "adapter full" in info.value.message and "Error" not in info.value.message


def test_settings_full_training_refuses():
    with pytest.raises(ValidationError, match="adapter full does not support the KL penalty"):
        TrainingConfig(adapter="full", kl_coeff=0.1)
    assert TrainingConfig(adapter="full", kl_coeff=0.1, kl_estimator="none").adapter == "full"
    with pytest.raises(ValidationError):
        TrainingConfig(adapter="partial")


@pytest.mark.timeout(300)
def test_the_runtime_serves_full_weights_beside_an_untouched_base(tmp_path, tmp_path_factory):
    from kiln.core.policy.runtime import PolicyRuntime

    model_dir = shared_tiny_model(tmp_path_factory)
    config = TrainingConfig(adapter="full", echo=None, seed=3, epochs=1, learning_rate=5e-2)
    rt = PolicyRuntime.load(model_dir, device="cpu", dtype="auto")
    prompt = rt.encode_prompt([{"role": "user", "content": "Count is 2. Target is 10."}], thinking=True)

    def sample(adapter_dir=None):
        return [(s.ids, s.logprobs) for s in rt.sample([prompt], [5], max_new_tokens=8, temperature=1.0,
                                                       adapter_dir=adapter_dir)]

    before = sample()
    weights = {n: p.detach().clone() for n, p in rt.model.named_parameters()}
    with rt.training_lease() as lease:  # full training takes its own copy, never the lent base
        result = train_grpo(model_path=model_dir, groups=bandit_groups(2), config=config,
                            output_dir=tmp_path / "full", shared_base=lease, device=rt.device, dtype=rt.dtype)
    assert all(torch.equal(p, weights[n]) for n, p in rt.model.named_parameters())
    assert sample() == before
    full = sample(result.adapter_dir)
    assert full != before
    assert rt.identity(result.adapter_dir)["adapter_sha256"] == result.receipt["adapter_sha256"]
    # the served weights score the sampled ids as the trained model does (one forward, brute force)
    ids, logprobs = full[0]
    trained = load_full_model(result.adapter_dir, "cpu", "float32", trainable=False)
    with torch.no_grad():
        logits = trained(input_ids=torch.tensor([prompt + ids[:-1]]), use_cache=False).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1:], dim=-1).gather(-1, torch.tensor(ids).unsqueeze(-1))
    assert torch.allclose(torch.tensor(logprobs), expected.squeeze(-1), atol=1e-4)
    assert sample() == before  # the base again after the full weights


def test_the_lora_default_digests_and_identifies_as_before():
    from kiln.core.contracts import parse_run_request
    from kiln.core.errors import InvalidRequest
    from kiln.core.request_digest import request_digest
    from kiln.core.train.plan import plan_training
    from kiln.core.train.resume import settings_digest
    from tests.unit.test_online_plan import BASE

    # pinned before the setting existed (tests/unit/test_online_plan.py)
    pinned = "sha256:5f225581baf49279bb2f41d15bc7bd751e6784a74e0366b3117bae6b605d65d7"
    assert request_digest(parse_run_request(BASE)) == pinned
    assert request_digest(parse_run_request({**BASE, "training_config": {"adapter": "lora"}})) == \
        request_digest(parse_run_request({**BASE, "training_config": {}}))
    full = parse_run_request({**BASE, "training_config": {"adapter": "full"}})
    assert request_digest(full) != request_digest(parse_run_request({**BASE, "training_config": {}}))
    # the checkpoint identity (settings digest) and the receipt's config leave the default out
    assert settings_digest(TrainingConfig(adapter="lora")) == settings_digest(TrainingConfig())
    groups = bandit_groups(2)
    lora_plan = plan_training(groups, TrainingConfig(adapter="lora"), None, None)
    assert "adapter" not in lora_plan.effective_config
    assert lora_plan.identity == plan_training(groups, TrainingConfig(), None, None).identity
    full_plan = plan_training(groups, TrainingConfig(adapter="full"), None, None)
    assert full_plan.effective_config["adapter"] == "full"
    assert full_plan.identity["settings_sha256"] != lora_plan.identity["settings_sha256"]
    with pytest.raises(InvalidRequest, match="adapter full does not support max_staleness"):
        parse_run_request({**BASE, "iterations": 2, "max_staleness": 1, "training_config": {"adapter": "full"}})


def test_admission_refuses_the_vllm_engine_and_a_plan_over_the_retained_budget(qwen3_path):
    from kiln.core.contracts import parse_run_request
    from kiln.core.full_admission import full_weight_bytes, require_full_fits
    from tests.unit.test_online_plan import BASE

    full = parse_run_request({**BASE, "iterations": 3, "training_config": {"adapter": "full"}})
    lora = parse_run_request({**BASE, "iterations": 3})
    # brute force: every tensor's elements × 4 bytes, plus the safetensors header and config.json
    state = load_file(str(qwen3_path / "model.safetensors"))
    raw = (qwen3_path / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    one = sum(t.numel() for t in state.values()) * 4 + header + (qwen3_path / "config.json").stat().st_size
    assert full_weight_bytes(qwen3_path, "float32") == one
    assert full_weight_bytes(qwen3_path, "float32") == len(raw) + (qwen3_path / "config.json").stat().st_size
    fits = {"engine": "hf", "model_dir": qwen3_path, "dtype": "float32"}
    require_full_fits(full, **fits, budget_bytes=4 * one)  # 3 iterations + the final adapter: 4 copies
    with pytest.raises(FullTrainingUnsupported) as info:
        require_full_fits(full, **fits, budget_bytes=4 * one - 1)
    assert info.value.details == {"field": "training_config.adapter", "weights_bytes": one, "copies": 4,
                                  "budget_bytes": 4 * one - 1}
    assert "KILN_RETAINED_BUDGET_BYTES" in info.value.hint
    require_full_fits(lora, **fits, budget_bytes=1)  # LoRA runs are not estimated here
    with pytest.raises(FullTrainingUnsupported, match="not served by the vllm engine"):
        require_full_fits(full, **{**fits, "engine": "vllm"}, budget_bytes=1 << 40)


def test_a_full_training_resumes_from_its_checkpoint_to_the_same_weights(qwen3_path, tmp_path):
    from kiln.core.errors import RunCancelled

    groups = bandit_groups(3)
    config = TrainingConfig(adapter="full", seed=3, checkpoint_interval=2, epochs=2, learning_rate=1e-3)  # 6 steps
    whole = train_grpo(model_path=qwen3_path, groups=groups, config=config, output_dir=tmp_path / "whole")
    calls = {"n": 0}

    def cancel_after_three() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    with pytest.raises(RunCancelled):
        train_grpo(model_path=qwen3_path, groups=groups, config=config, output_dir=tmp_path / "killed",
                   should_cancel=cancel_after_three)
    checkpoint = tmp_path / "killed" / "checkpoints" / "step-000002"
    resumed = train_grpo(model_path=qwen3_path, groups=groups, config=config, output_dir=tmp_path / "again",
                         resume_from=checkpoint)
    assert resumed.receipt["checkpoint"]["used"] is True and resumed.receipt["resumed_from_step"] == 2
    assert (resumed.adapter_dir / "model.safetensors").read_bytes() == \
        (whole.adapter_dir / "model.safetensors").read_bytes()
    assert resumed.receipt["adapter_sha256"] == whole.receipt["adapter_sha256"]
    # a LoRA checkpoint of the same data and seed is not this training's (the settings digest differs)
    lora = train_grpo(model_path=qwen3_path, groups=groups, config=TrainingConfig(seed=3, checkpoint_interval=2,
                      epochs=2, learning_rate=1e-3), output_dir=tmp_path / "lora", resume_from=checkpoint)
    assert lora.receipt["checkpoint"]["used"] is False and "settings" in lora.receipt["checkpoint"]["reason"]
