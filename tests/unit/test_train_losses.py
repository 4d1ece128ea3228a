"""Loss masks and surrogate behaviour on a real (tiny) model's logits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kiln.train.batches import build_group_batch  # noqa: E402
from kiln.train.losses import echo_loss, policy_loss, token_logprobs  # noqa: E402
from tests.unit.test_train_support import (  # noqa: E402
    X_TOKEN,
    Y_TOKEN,
    build_tiny_qwen3,
    completion,
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    path = build_tiny_qwen3(tmp_path_factory.mktemp("train-losses") / "model")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _batch(warning_filter=True):
    group = {
        "messages": [],
        "completions": [
            completion(0, X_TOKEN, warning=True, turns=2),
            completion(0, Y_TOKEN, warning=False, turns=3),
        ],
    }
    return build_group_batch(group, warning_filter=warning_filter, vocab_size=300)


def _logit_grad(model, batch, term):
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    logits = out.logits
    logits.retain_grad()
    lp = token_logprobs(logits, batch.labels)
    if term == "policy":
        loss, _ = policy_loss(
            lp, lp.detach(), batch.advantages, batch.action_mask, clip_epsilon=0.2
        )
    else:
        loss = echo_loss(lp, batch.env_mask, batch.obs_lengths)
    loss.backward()
    # row j of the logits predicts target j (shifted); the last row predicts nothing
    return logits.grad[:, :-1, :].abs().sum(-1), logits.grad[:, -1, :]


def test_policy_gradient_only_at_action_targets(tiny_model):
    batch = _batch()
    grad_rows, last = _logit_grad(tiny_model, batch, "policy")
    masked = batch.action_mask == 0
    assert torch.all(grad_rows[masked] == 0)
    assert torch.all(grad_rows[~masked] > 0)
    assert torch.all(last == 0)


@pytest.mark.parametrize("warning_filter", [True, False])
def test_echo_gradient_only_at_env_targets(tiny_model, warning_filter):
    batch = _batch(warning_filter)
    grad_rows, last = _logit_grad(tiny_model, batch, "echo")
    masked = batch.env_mask == 0
    assert torch.all(grad_rows[masked] == 0)
    assert torch.all(grad_rows[~masked] > 0)
    assert torch.all(last == 0)
    # the warning tokens (ids 40-42) are targets only without the filter
    real = batch.attention_mask[:, 1:] > 0
    warning_targets = (batch.labels >= 40) & (batch.labels <= 42) & real
    assert bool(torch.all(batch.env_mask[warning_targets] == (0.0 if warning_filter else 1.0)))
    assert torch.all(batch.env_mask * batch.action_mask == 0)


def test_echo_normalised_by_full_observation_length():
    lp = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-1.0, -1.0, -1.0, -1.0]])
    env = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    obs = torch.tensor([4.0, 0.0])  # row 0: 4 observation tokens, 2 of them warning; row 1: none
    assert float(echo_loss(lp, env, obs)) == pytest.approx((2.0 + 3.0) / 4.0)


def test_recorded_ratio_clips_and_truncates():
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 1)
    lp = torch.zeros(2, 1, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 1.5], [1 / 10.0]]))  # ratios 1.5 and 10
    loss, stats = policy_loss(lp, old, adv, mask, clip_epsilon=0.2)
    # row 0: A>0, ratio 1.5 → clipped to 1.2 (no gradient);
    # row 1: A<0, min(10 truncated to 5, 1.2)·(-1) picks -5 (no gradient)
    assert float(loss.detach()) == pytest.approx(-(1.2 * 1.0 + 5.0 * -1.0) / 2)
    loss.backward()
    assert lp.grad.tolist() == [[0.0], [0.0]]
    assert stats["clip_fraction"] == 1.0


def test_ratio_one_gives_policy_gradient():
    lp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor([2.0]), torch.ones(1, 2), clip_epsilon=0.2)
    loss.backward()
    assert lp.grad.tolist() == [[-1.0, -1.0]]  # -A / n_tokens per token
