"""Every per-step figure a train receipt reports equals a brute-force computation.

A step's figures (``loss``, ``policy_loss``, ``env_ce``, ``kl``, ``approx_kl``, ``clip_fraction``,
``max_ratio_deviation``, ``grad_norm``, ``tokens``, with an entropy bonus ``entropy`` and, for stale
data, ``is_ratio_max``, ``is_weight_max``, ``is_truncated_fraction``), under each loss normaliser, are recomputed here from the tiny model's full logits
(one padded forward of all rows, ``model(...).logits`` and a plain ``log_softmax``), the objective
written out from its definition in docs/training.md, and the gradient norm from ``autograd.grad``
of that one-batch loss; the trainer's step runs in several micro-batches. The receipt's
``lora_delta_norm`` is checked against the merged weights of the adapter.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kiln.core.train.batches import collate, group_rows
from kiln.core.train.model import attach_lora, load_base_model, trainable_parameters
from kiln.core.train.step import (
    LogprobCache,
    StepSettings,
    score_old_logprobs,
    train_step,
)
from tests.unit.test_train_support import X_TOKEN, Y_TOKEN, build_tiny_qwen3, completion

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_qwen3(tmp_path_factory.mktemp("figures-model") / "model")


def _groups() -> list[dict]:
    rewards = [[1.0, 0.0, 0.5, 0.2], [0.0, 2.0, 1.0, 1.0]]
    groups = []
    for g, values in enumerate(rewards):
        comps = [completion(g, X_TOKEN if i % 2 == 0 else Y_TOKEN, reward=r, warning=(i == 1))
                 for i, r in enumerate(values)]
        groups.append({"messages": [{"role": "user", "content": f"seed {g}"}], "completions": comps})
    return groups


def _moved_model(model_path: Path):
    """A LoRA policy away from the base, and its rows with their pre-update log-probs cached, then
    moved again (as after earlier steps), so that ratios, clips and KLs are all non-trivial."""
    model = attach_lora(load_base_model(model_path, "cpu"), rank=4, alpha=8, seed=0, base_adapter_dir=None)
    params = [p for _, p in trainable_parameters(model)]
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    rows = [row for g, group in enumerate(_groups())
            for row in group_rows(group, group_index=g, warning_filter=True, vocab_size=300)]
    return model, params, rows, gen


def _brute(model, params, rows, settings: StepSettings, old: torch.Tensor, behavior: torch.Tensor | None):
    """The step's figures from the full logits of one batch (definitions of docs/training.md)."""
    batch = collate(rows)
    t = settings.temperature
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1, :].float()
    lp = torch.log_softmax(logits / t, dim=-1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad(), model.disable_adapter():
        base_logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1, :]
        ref = torch.log_softmax(base_logits.float() / t, -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    mask = batch.action_mask
    on = mask > 0
    n_action = float(mask.sum())
    adv = batch.advantages.unsqueeze(-1).expand_as(lp).clone()
    if settings.kl_estimator == "k1" and settings.kl_coeff > 0:
        adv = adv - settings.kl_coeff * (old - ref)
    r = torch.exp(lp - old)
    eps, high = settings.clip_epsilon, settings.clip_eps_high or settings.clip_epsilon
    weights = torch.ones_like(lp)
    figures = {}
    if behavior is not None:
        ratio = torch.exp(old - behavior)
        weights = torch.clamp(ratio, max=settings.stale_is_max_weight)
        figures.update(is_ratio_max=float(ratio[on].max()), is_weight_max=float(weights[on].max()),
                       is_truncated_fraction=float((ratio[on] > settings.stale_is_max_weight).sum()) / n_action)
    def normalised(term):  # loss_normaliser
        if settings.loss_normaliser == "sequences":  # each row's token mean, averaged over rows
            return sum(term[i][on[i]].sum() / on[i].sum() for i in range(len(rows))) / len(rows)
        if settings.loss_normaliser == "constant":
            return term[on].sum() / (len(rows) * settings.loss_constant_tokens)
        return term[on].sum() / n_action

    if settings.is_level == "cispo":
        term = -torch.clamp(r, max=settings.cispo_max_weight).detach() * adv * lp * weights
        clipped = (r > settings.cispo_max_weight) & on
        p_loss = normalised(term)
    elif settings.is_level == "token":
        a = r * adv
        b = torch.clamp(r, 1 - eps, 1 + high) * adv
        term = -torch.minimum(a, b) * weights
        clipped = (b < a) & on
        p_loss = normalised(term)
    else:  # sequence (GSPO): one ratio per sequence, averaged over sequences
        count = mask.sum(-1)
        s = torch.exp(((lp - old) * mask).sum(-1) / count)
        seq_adv = (adv * mask).sum(-1) / count
        a, b = s * seq_adv, torch.clamp(s, 1 - eps, 1 + high) * seq_adv
        seq_w = (weights * mask).sum(-1) / count
        p_loss = (-torch.minimum(a, b) * seq_w).sum() / len(rows)
        clipped = (b < a).unsqueeze(-1).expand_as(lp) & on
    obs = batch.obs_lengths
    env = sum(-(lp[i] * batch.env_mask[i]).sum() / obs[i] for i in range(len(rows))) / len(rows)
    total = p_loss + settings.echo_lambda * env
    if settings.entropy_coeff > 0:  # the tempered distribution's entropy, from the full logits
        log_all = torch.log_softmax(logits / t, dim=-1)
        entropy = -(log_all.exp() * log_all).sum(-1)[on].sum() / n_action
        total = total - settings.entropy_coeff * entropy
        figures["entropy"] = float(entropy)
    if not settings.kl_on:  # no KL term: the step reports 0
        kl = torch.zeros(())
    elif settings.kl_estimator == "k1":
        kl = ((lp - ref)[on]).sum() / n_action
    else:
        d = ref - lp
        kl = (torch.exp(d) - d - 1)[on].sum() / n_action
        total = total + settings.kl_coeff * kl
    grads = torch.autograd.grad(total, params)
    grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    log_r = (lp - old).detach()
    figures.update(
        loss=float(total), policy_loss=float(p_loss), env_ce=float(env), kl=float(kl),
        approx_kl=float((torch.exp(log_r) - 1 - log_r)[on].sum()) / n_action,
        clip_fraction=float(clipped.sum()) / n_action,
        max_ratio_deviation=float((r.detach() - 1).abs()[on].max()), grad_norm=float(grad_norm),
        tokens=int(batch.attention_mask.sum()))
    return figures


CASES = [
    {"is_level": "token", "kl_estimator": "k1", "kl_coeff": 0.2, "clip_epsilon": 0.2, "clip_eps_high": 0.28},
    {"is_level": "cispo", "kl_estimator": "k3", "kl_coeff": 0.5, "cispo_max_weight": 1.5},
    {"is_level": "sequence", "kl_estimator": "k3", "kl_coeff": 0.1, "clip_epsilon": 0.01},
    {"is_level": "token", "kl_estimator": "k1", "kl_coeff": 0.0, "stale_is_max_weight": 1.3, "temperature": 0.8},
    {"is_level": "cispo", "kl_estimator": "none", "kl_coeff": 0.0, "cispo_max_weight": 1.2, "loss_normaliser": "sequences",
         "entropy_coeff": 0.05, "temperature": 0.7},
    {"is_level": "token", "kl_estimator": "k3", "kl_coeff": 0.1, "loss_normaliser": "constant", "loss_constant_tokens": 16.0,
         "entropy_coeff": 0.2},
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['is_level']}-{c['kl_estimator']}-{i}" for i, c in enumerate(CASES)])
def test_step_figures_equal_a_brute_force_computation(model_path, case):
    model, params, rows, gen = _moved_model(model_path)
    settings = StepSettings(**{"clip_epsilon": 0.2, "echo_lambda": 0.3, "max_grad_norm": 1e9, "recorded": False,
                               "max_tokens_per_microbatch": 60, **case})
    cache = LogprobCache()
    score_old_logprobs(model, rows, cache, settings, torch.device("cpu"))
    behavior = None
    if settings.stale_is_max_weight is not None:  # an older sampler: its log-probs are the old ones shifted
        rows = [replace(r, behavior=cache.old[r.key] - torch.rand(r.length - 1, generator=gen) + 0.3) for r in rows]
        behavior = collate(rows).behavior_logprobs
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    old = collate([replace(r, behavior=cache.old[r.key]) for r in rows]).behavior_logprobs
    expected = _brute(model, params, rows, settings, old, behavior)
    optimizer = torch.optim.SGD(params, lr=0.0)
    values = train_step(model, rows, optimizer, params, settings, cache, torch.device("cpu"))
    assert values["microbatches"] > 1
    assert expected["clip_fraction"] > 0 and expected["approx_kl"] > 1e-3
    assert abs(expected["kl"]) > 1e-3 if settings.kl_on else expected["kl"] == 0.0
    if behavior is not None:
        assert 0 < expected["is_truncated_fraction"] < 1
    for key, value in expected.items():
        assert values[key] == pytest.approx(value, rel=2e-4, abs=1e-6), key


def test_lora_delta_norm_is_the_merged_weight_change(model_path, tmp_path):
    """``lora_delta_norm`` (and each module's) = Frobenius norm of (merged − base) weights."""
    from kiln.core.train.model import lora_delta_norms

    model, _params, _, _ = _moved_model(model_path)
    total, norms = lora_delta_norms(model)
    base = load_base_model(model_path, "cpu").state_dict()
    merged = model.merge_and_unload().state_dict()
    squares = []
    for name, weight in merged.items():
        delta = float(torch.linalg.norm((weight - base[name]).double()))
        if delta > 0:
            squares.append(delta ** 2)
            module = name.removesuffix(".weight")
            assert norms[f"base_model.model.{module}.default"] == pytest.approx(delta, rel=1e-4)
    assert len(squares) == len(norms) > 0
    assert total == pytest.approx(sum(squares) ** 0.5, rel=1e-4)


def test_run_summaries_are_those_of_the_steps(model_path, tmp_path):
    """The receipt's ``loss`` / ``policy_loss`` summaries, each step's ``action_tokens`` and
    ``TrainResult.kl`` (the mean step KL of the last epoch) recomputed from the steps and rows."""
    import math

    from kiln.core.training_config import TrainingConfig
    from kiln.core.train.trainer import train_grpo

    config = TrainingConfig(seed=2, epochs=2, optimizer="adamw", learning_rate=1e-2, kl_coeff=0.1,
                            kl_estimator="k3", groups_per_step=1)
    result = train_grpo(model_path=model_path, groups=_groups(), config=config, output_dir=tmp_path / "run")
    steps = result.receipt["steps"]
    assert len(steps) == 4 and [s["epoch"] for s in steps] == [0, 0, 1, 1]
    for key in ("loss", "policy_loss"):
        values = [s[key] for s in steps]
        assert result.receipt[key] == {"initial": values[0], "final": values[-1], "mean": math.fsum(values) / 4}
    assert result.kl == pytest.approx((steps[2]["kl"] + steps[3]["kl"]) / 2, rel=1e-12)
    per_group = [sum(len(p["ids"]) for c in g["completions"] for p in c["tokens"]["pieces"] if p["kind"] == "action")
                 for g in _groups()]
    assert sorted(s["action_tokens"] for s in steps) == sorted(per_group * 2)
