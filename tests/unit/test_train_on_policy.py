"""Learning that holds over many iterations, on a tiny random Qwen3: old log-probs from one
pre-update pass, penalty completions trained, the policy's movement measured, ``target_kl``, the
epoch order seeded by the iteration, float16 refused, Muon's update scale matched to AdamW's."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from kiln.core.training_config import TrainingConfig
from kiln.core.errors import TrainingFailed  # noqa: E402
from kiln.core.train.batches import collate, group_rows, pack_microbatches  # noqa: E402
from kiln.core.train.checkpoints import unpack_folder  # noqa: E402
from kiln.core.train.losses import sequence_logprobs  # noqa: E402
from kiln.core.train.model import attach_lora, load_base_model  # noqa: E402
from kiln.core.train.optim import build_optimizer  # noqa: E402
from kiln.core.train.plan import epoch_order, step_schedule  # noqa: E402
from kiln.core.train.trainer import prepare_training, train_grpo  # noqa: E402
from tests.unit.test_train_support import (  # noqa: E402
    BEHAVIOR,
    X_TOKEN,
    Y_TOKEN,
    bandit_groups,
    build_tiny_qwen3,
    completion,
    context,
    logprob_of,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_qwen3(tmp_path_factory.mktemp("on-policy-model") / "model")


def _config(**overrides) -> TrainingConfig:
    return TrainingConfig(**{"seed": 5, "epochs": 1, "optimizer": "adamw", "learning_rate": 2e-2,
                             "echo": None, "kl_coeff": 0.0, **overrides})


def _train(model_path: Path, out: Path, config: TrainingConfig, groups=None, **kwargs):
    return train_grpo(model_path=model_path, groups=groups or bandit_groups(4), config=config, output_dir=out,
                      expected_behavior_policy=BEHAVIOR, **kwargs)


def test_old_logprobs_are_one_no_grad_pass_before_step_1(model_path, tmp_path):
    """Every row's old log-probs — also those of the group visited last — equal a no-grad pass of
    the untrained policy over all rows, bitwise, and are kept in the checkpoint."""
    config = _config(checkpoint_interval=4)  # 4 groups, one per step: the checkpoint after the epoch
    result = _train(model_path, tmp_path / "run", config)
    cached = load_file(str(tmp_path / "run" / "checkpoints" / "step-000004" / "logprobs.safetensors"))
    groups = bandit_groups(4)
    # The same pass, computed here on a freshly loaded, untrained policy (same LoRA seed).
    model = attach_lora(load_base_model(model_path, "cpu"), rank=config.lora_rank, alpha=config.lora_alpha,
                        seed=config.seed, base_adapter_dir=None)
    rows = [row for g, group in enumerate(groups) for row in group_rows(group, group_index=g, warning_filter=True, vocab_size=300)]
    expected = {}
    with torch.no_grad():
        for micro in pack_microbatches(rows, config.max_tokens_per_microbatch):
            batch = collate(micro)
            logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.labels)
            for b, row in enumerate(micro):
                expected[row.key] = logprobs[b, : row.length - 1]
    assert {f"old.{g}.{c}" for g, c in expected} == {k for k in cached if k.startswith("old.")}
    for (g, c), values in expected.items():
        assert torch.equal(cached[f"old.{g}.{c}"], values), (g, c)
    history = result.receipt["steps"]
    assert history[0]["max_ratio_deviation"] == 0.0  # step 1 is exactly on-policy
    # From step 2 on the ratio sees the earlier updates, also in epoch 1 (not a first-visit score).
    assert all(h["max_ratio_deviation"] > 0.0 for h in history[1:]), history
    assert result.receipt["grpo"]["importance"] == "pre_update_logprobs"


def test_penalty_completions_contribute_gradient(model_path, tmp_path):
    """A completion without a final action keeps its (penalised) reward by default and is trained:
    its action becomes less likely; dropping it leaves the groups without reward variation."""
    def group(g: int) -> dict:
        comps = [completion(g, X_TOKEN) for _ in range(3)]
        comps.append(completion(g, Y_TOKEN, harness_code="MODEL_ACTION_NO_OUTPUT", reward=-1.0))
        return {"messages": [{"role": "user", "content": f"seed {g}"}], "completions": comps}

    groups = [group(g) for g in range(2)]
    assert TrainingConfig().on_no_output == "penalty"
    result = _train(model_path, tmp_path / "penalty", _config(), groups=groups)
    assert result.receipt["selection"]["no_output_rollouts_discarded"] == 0
    assert result.receipt["token_counts"]["action_tokens"] == 2 * 4 * 4  # every completion trained
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    before = [logprob_of(base, context(g), Y_TOKEN) for g in range(2)]
    tuned = PeftModel.from_pretrained(base, str(result.adapter_dir)).eval()
    after = [logprob_of(tuned, context(g), Y_TOKEN) for g in range(2)]
    assert all(a < b - 0.5 for a, b in zip(after, before)), (before, after)
    with pytest.raises(TrainingFailed) as err:
        _train(model_path, tmp_path / "drop", _config(on_no_output="drop"), groups=groups)
    assert err.value.code == "zero_groups"


def test_target_kl_stops_at_the_recorded_step(model_path, tmp_path):
    target = 1e-4
    result = _train(model_path, tmp_path / "stopped", _config(epochs=2, target_kl=target), keep_state=True)
    stop = result.receipt["early_stop"]
    history = result.receipt["steps"]
    assert stop is not None and stop["target_kl"] == target and stop["approx_kl"] > target
    assert stop["step"] >= 2  # step 1 is on-policy: its approximate KL is exactly 0
    assert history[0]["approx_kl"] == 0.0
    assert [h["step"] for h in history] == list(range(1, stop["step"]))
    assert all(h["approx_kl"] <= target for h in history)
    assert result.steps == stop["steps_taken"] == stop["step"] - 1 == result.early_stop_step - 1
    # The optimizer took exactly the steps before the stop.
    folder = unpack_folder(result.final_state.read_bytes(), tmp_path / "state")
    saved = torch.load(io.BytesIO((folder / "optimizer.pt").read_bytes()), weights_only=True)
    assert {float(v["step"]) for v in saved["state"].values()} == {float(stop["step"] - 1)}
    assert json.loads((folder / "state.json").read_text())["optimizer_steps_total"] == stop["step"] - 1
    # Without target_kl every planned step runs.
    whole = _train(model_path, tmp_path / "whole", _config(epochs=2))
    assert whole.receipt["early_stop"] is None and whole.steps == 8 > result.steps


def test_policy_drift_is_recorded(model_path, tmp_path):
    result = _train(model_path, tmp_path / "drift", _config(epochs=2))
    drift = result.receipt["policy_drift"]
    assert drift["action_tokens"] == result.receipt["token_counts"]["action_tokens"]
    assert drift["kl_to_previous"] > 0.01
    # From the base model the starting policy is the base: both measure the same divergence.
    assert drift["kl_to_base"] == pytest.approx(drift["kl_to_previous"], rel=1e-5)
    assert (result.kl_to_previous, result.kl_to_base) == (drift["kl_to_previous"], drift["kl_to_base"])
    still = _train(model_path, tmp_path / "still", _config(learning_rate=1e-9))
    assert still.receipt["policy_drift"]["kl_to_previous"] < 1e-9 < drift["kl_to_previous"]


def _independent_logprobs(model_path: Path, adapter_dir: Path | None, groups) -> list[list[tuple]]:
    """Per group, per row: log-probs, action mask, env mask and observation length, from one
    padded forward per group of a freshly loaded base model (with ``adapter_dir`` on it when
    given): another code path than the trainer's passes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kiln.core.train.batches import build_group_batch

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    out = []
    with torch.no_grad():
        for group in groups:
            batch = build_group_batch(group, warning_filter=True, vocab_size=300)
            logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.labels)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1, :]
            out.append([(logprobs[b], batch.action_mask[b], batch.env_mask[b], batch.obs_lengths[b], logits[b])
                        for b in range(logprobs.shape[0])])
    return out


def test_drift_and_evaluation_figures_match_an_independent_computation(model_path, tmp_path):
    """The receipt's KL to the previous policy and to the base (exact, over the whole vocabulary),
    and its initial and final evaluation figures, equal the same figures computed here from freshly
    loaded models' full logits with a plain softmax: for a
    training from the base model (whose starting policy is the base) and for one continuing from
    an adapter (where the two KLs differ)."""
    import math

    first = _train(model_path, tmp_path / "first", _config(epochs=2))
    second = _train(model_path, tmp_path / "second", _config(epochs=2), groups=bandit_groups(4),
                    base_adapter_dir=first.adapter_dir)
    base = _independent_logprobs(model_path, None, bandit_groups(4))
    after_first = _independent_logprobs(model_path, first.adapter_dir, bandit_groups(4))
    after_second = _independent_logprobs(model_path, second.adapter_dir, bandit_groups(4))

    def drift(new, start):  # exact KL over the whole vocabulary, from the full logits
        to_previous = to_base = tokens = 0.0
        rows = zip(*(sum(side, []) for side in (new, start, base)))
        for (_, mask, _, _, z_new), (_, _, _, _, z_start), (_, _, _, _, z_base) in rows:
            p = torch.softmax(z_new.double(), dim=-1)
            on = mask > 0
            kl_start = (p * (torch.log(p) - torch.log(torch.softmax(z_start.double(), dim=-1)))).sum(-1)
            kl_base = (p * (torch.log(p) - torch.log(torch.softmax(z_base.double(), dim=-1)))).sum(-1)
            to_previous += float(kl_start[on].sum())
            to_base += float(kl_base[on].sum())
            tokens += float(mask.sum())
        return to_previous / tokens, to_base / tokens

    def figures(scored):  # mean over groups of the env CE per observed row; action log-prob mean
        ce_groups, lp, count = [], 0.0, 0.0
        for group in scored:
            ces = [float(-(l * env).sum()) / float(n) for l, _, env, n, _ in group if float(n) > 0]
            ce_groups.append(sum(ces) / max(1, len(ces)))
            lp += sum(float((l * mask).sum()) for l, mask, _, _, _ in group)
            count += sum(float(mask.sum()) for _, mask, _, _, _ in group)
        return sum(ce_groups) / len(ce_groups), lp / count

    for result, start, new in ((first, base, after_first), (second, after_first, after_second)):
        receipt = result.receipt
        to_previous, to_base = drift(new, start)
        assert receipt["policy_drift"]["kl_to_previous"] == pytest.approx(to_previous, rel=1e-4, abs=1e-7)
        assert receipt["policy_drift"]["kl_to_base"] == pytest.approx(to_base, rel=1e-4, abs=1e-7)
        for side, scored in (("initial", start), ("final", new)):
            env_ce, lp_mean = figures(scored)
            assert receipt["evaluation"][side]["action_logprob_mean"] == pytest.approx(lp_mean, abs=1e-5)
            if receipt["evaluation"][side]["env_ce"] is not None:
                assert receipt["evaluation"][side]["env_ce"] == pytest.approx(env_ce, abs=1e-5)
    # Continuing from an adapter, the base is not the starting policy: the two KLs differ.
    kl = second.receipt["policy_drift"]
    assert kl["kl_to_base"] > 0 and not math.isclose(kl["kl_to_base"], kl["kl_to_previous"], rel_tol=1e-2)


def test_epoch_order_is_seeded_by_the_iteration():
    assert epoch_order(8, 0, 0) == epoch_order(8, 0, 0, iteration=1)  # a single pass is unchanged
    orders = {tuple(epoch_order(8, 0, 0, iteration=k)) for k in range(1, 6)}
    assert len(orders) == 5
    assert step_schedule(8, 0, 2, 1, iteration=3) == step_schedule(8, 0, 2, 1, iteration=3)


def test_float16_training_is_refused(model_path, tmp_path):
    with pytest.raises(TrainingFailed) as err:
        prepare_training(model_path=model_path, groups=bandit_groups(2), config=_config(), work_dir=tmp_path,
                         dtype="float16")
    assert err.value.code == "training_dtype_unsupported"
    assert "bfloat16" in (err.value.hint or "") and "float32" in (err.value.hint or "")


def _update_rms(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 20) -> list[float]:
    """Mean per-step update RMS of each parameter over ``steps`` steps of seeded random gradients."""
    generator = torch.Generator().manual_seed(1)
    totals = [0.0] * len(params)
    for _ in range(steps):
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        for i, (p, b) in enumerate(zip(params, before)):
            totals[i] += float((p.detach() - b).pow(2).mean().sqrt())
    return [t / steps for t in totals]


def _fresh(shapes: list[tuple[int, int]]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_muon_update_scale_is_adamw_like_on_lora_shapes():
    """LoRA A (r × in) and B (out × r) at Qwen3-0.6B shapes, measured against AdamW on the same
    gradients at the same learning rate: Muon's per-step update RMS is the same for every shape
    and within the same order as AdamW's (measured 0.37× AdamW's on uncorrelated gradients),
    where torch's default adjustment makes B's update √(out/r) times larger than A's."""
    shapes = [(16, 1024), (3072, 16), (1024, 16)]
    lr = 1e-3
    params = _fresh(shapes)
    adamw = _update_rms(build_optimizer(TrainingConfig(optimizer="adamw", learning_rate=lr), params)[0], params)
    params = _fresh(shapes)
    optimizer, described = build_optimizer(TrainingConfig(optimizer="muon", learning_rate=lr), params)
    assert described["adjust_lr_fn"] == "match_rms_adamw"
    muon = _update_rms(optimizer, params)
    assert max(muon) / min(muon) < 1.1, muon
    for a, m in zip(adamw, muon):
        assert 0.25 <= m / a <= 1.0, (adamw, muon)
    params = _fresh(shapes)
    original = _update_rms(torch.optim.Muon(params, lr=lr, weight_decay=0.0, adjust_lr_fn="original"), params)
    assert original[1] / original[0] > 5.0, original  # B (3072 × 16) about 8× A (16 × 1024)


def test_one_learning_rate_schedule_over_the_iterations(model_path, tmp_path):
    """Warm-up happens once: iteration 2 continues the schedule at the run's global step."""
    config = _config(warmup_steps=6)  # 4 steps an iteration: the warm-up spans into iteration 2
    first = _train(model_path, tmp_path / "it1", config, keep_state=True, iteration=1, iterations_total=2)
    second = _train(model_path, tmp_path / "it2", config, base_adapter_dir=first.adapter_dir,
                    init_state=first.final_state, iteration=2, iterations_total=2)
    lrs = [h["lr"] for h in first.receipt["steps"] + second.receipt["steps"]]
    assert lrs == pytest.approx([2e-2 * min(1.0, s / 6) for s in range(1, 9)], rel=1e-12)


def test_cosine_horizon_is_the_runs_plan_and_dropped_groups_do_not_bend_it(model_path, tmp_path):
    """The horizon comes from the run's plan (iterations × planned steps, RunRequest.lr_horizon_steps)
    and is recorded; iteration 2 lost a group (3 steps instead of 4) and its learning rates still lie
    on the same cosine curve, where the per-iteration estimate (no lr_horizon_steps) bent it."""
    import math

    from kiln.core.contracts import RunRequest

    request = RunRequest.model_validate({"kind": "train", "output_adapter": "a", "environment_urls": ["http://127.0.0.1:9"], "groups": 4, "iterations": 2,
                                         "training_config": {"epochs": 1, "groups_per_step": 1}})
    assert request.lr_horizon_steps() == 8
    wide = RunRequest.model_validate({"kind": "train", "output_adapter": "a", "environment_urls": ["http://127.0.0.1:9"], "groups": 5, "iterations": 3,
                                      "training_config": {"epochs": 2, "groups_per_step": 2}})
    assert wide.lr_horizon_steps() == 3 * 2 * 3
    config = _config(lr_schedule="cosine")
    curve = [2e-2 * 0.5 * (1 + math.cos(math.pi * (s - 1) / 8)) for s in range(1, 8)]
    lrs = {}
    for name, horizon in (("fixed", 8), ("estimated", None)):
        first = _train(model_path, tmp_path / f"{name}1", config, keep_state=True, iteration=1, iterations_total=2,
                       lr_horizon_steps=horizon)
        second = _train(model_path, tmp_path / f"{name}2", config, groups=bandit_groups(3),
                        base_adapter_dir=first.adapter_dir, init_state=first.final_state, iteration=2,
                        iterations_total=2, lr_horizon_steps=horizon)
        lrs[name] = [h["lr"] for h in first.receipt["steps"] + second.receipt["steps"]]
        if horizon is not None:
            assert [r.receipt["grpo"]["optimizer"]["schedule_horizon_steps"] for r in (first, second)] == [8, 8]
    assert lrs["fixed"] == pytest.approx(curve, rel=1e-12)
    assert lrs["estimated"][:4] == pytest.approx(curve[:4], rel=1e-12)
    assert lrs["estimated"][4] < 0.8 * curve[4]  # the old estimate (horizon 4 + 3): bent at the boundary
