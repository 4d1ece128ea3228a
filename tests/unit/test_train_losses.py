"""Loss masks and surrogate behaviour on a real (tiny) model's logits."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kiln.core.train.batches import build_group_batch  # noqa: E402
from kiln.core.train.losses import (  # noqa: E402
    echo_loss,
    kl_k1_penalty,
    kl_k3,
    policy_loss,
    sequence_logprobs,
    token_logprobs,
    truncated_is_weights,
)
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


def test_token_clip_counts_tokens_where_the_clipped_term_won():
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 1)
    lp = torch.zeros(4, 1, requires_grad=True)
    # ratios 1.5 (A>0: clipped wins), 10 (A<0: unclipped −10 is smaller, keeps its gradient),
    # 0.5 (A>0: unclipped 0.5 < 0.8 wins), 0.5 (A<0: clipped −0.8 < −0.5 wins)
    old = torch.log(torch.tensor([[1 / 1.5], [1 / 10.0], [2.0], [2.0]]))
    loss, stats = policy_loss(lp, old, adv, mask, clip_epsilon=0.2)
    assert float(loss.detach()) == pytest.approx(-(1.2 - 10.0 + 0.5 - 0.8) / 4, rel=1e-6)
    loss.backward()
    # d/dlp of −r·A/4 = −r·A/4 where unclipped won, 0 where the clipped term won
    assert lp.grad[:, 0].tolist() == pytest.approx([0.0, 10.0 / 4, -0.5 / 4, 0.0], rel=1e-6)
    assert stats["clipped_tokens"] == 2.0 and stats["action_tokens"] == 4.0
    assert stats["max_ratio_deviation"] == pytest.approx(9.0, rel=1e-6)


def test_cispo_keeps_gradient_with_truncated_stop_gradient_weight():
    adv = torch.tensor([-1.0, 2.0])
    mask = torch.ones(2, 1)
    lp = torch.tensor([[-0.1], [-0.2]], requires_grad=True)
    old = lp.detach() - torch.log(torch.tensor([[10.0], [0.5]]))  # ratios 10 and 0.5
    loss, stats = policy_loss(lp, old, adv, mask, clip_epsilon=0.2, is_level="cispo", cispo_max_weight=5.0)
    loss.backward()
    # gradient −sg(min(r, 5))·A / n: the r=10, A<0 token still gets +5/2 (dual-clip PPO gave 0)
    assert lp.grad[:, 0].tolist() == pytest.approx([5.0 / 2, -0.5 * 2.0 / 2], rel=1e-5)
    assert float(loss.detach()) == pytest.approx(-(5.0 * -1.0 * -0.1 + 0.5 * 2.0 * -0.2) / 2, rel=1e-5)
    assert stats["clipped_tokens"] == 1.0


def test_sequence_level_ratio_is_length_normalised():
    lp = torch.zeros(1, 3, requires_grad=True)
    old = torch.tensor([[-0.3, 0.0, -0.3]])  # mean log-ratio over the 2 action tokens = 0.3
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, stats = policy_loss(lp, old, torch.tensor([1.0]), mask, clip_epsilon=0.5, is_level="sequence")
    r = math.exp(0.3)
    assert float(loss.detach()) == pytest.approx(-r, rel=1e-6)  # (r·A summed over 2 tokens) / 2
    loss.backward()
    # d(−r)/dlp_t = −r · mask_t / 2 for each action token
    assert lp.grad[0].tolist() == pytest.approx([-r / 2, 0.0, -r / 2], rel=1e-6)
    assert stats["clipped_tokens"] == 0.0


def test_k3_value_and_gradient_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    value = kl_k3(lp, ref, mask)
    # token 0: d = ref−lp = −1 → e^−1 + 1 − 1 = 0.367879; token 1: d = 1 → e − 1 − 1 = 0.718282
    assert float(value.detach()) == pytest.approx((math.exp(-1) + math.exp(1) - 2.0) / 2, rel=1e-6)
    value.backward()
    # ∂/∂lp = (1 − e^d)/n: token 0 (policy above ref) +0.316 → descent lowers it; token 1 −0.859
    assert lp.grad[0].tolist() == pytest.approx(
        [(1 - math.exp(-1)) / 2, (1 - math.exp(1)) / 2, 0.0], rel=1e-6
    )
    # the gradient depends on the reference (the old k1-in-loss did not)
    lp2 = lp.detach().clone().requires_grad_(True)
    kl_k3(lp2, ref - 50.0, mask).backward()
    assert not torch.allclose(lp2.grad, lp.grad)


def test_k1_penalty_lowers_advantage_where_policy_exceeds_reference():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-2.0, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    penalty = kl_k1_penalty(old, ref, mask)
    assert penalty.tolist() == [[1.0, -1.0, 0.0]]
    assert not penalty.requires_grad
    # folded into the advantage with kl_coeff 0.1: A=1 → 0.9 where π_old > π_ref, 1.1 where below
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0]).unsqueeze(-1) - 0.1 * penalty
    loss, _ = policy_loss(lp, old, adv, mask, clip_epsilon=0.2)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-0.9 / 2, -1.1 / 2, 0.0], rel=1e-6)


def test_temperature_scoring_matches_tempered_softmax(tiny_model):
    batch = _batch()
    out = tiny_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    want = torch.log_softmax(out.logits[:, :-1].float() / 0.7, dim=-1).gather(
        -1, batch.labels.unsqueeze(-1)
    ).squeeze(-1)
    got = sequence_logprobs(tiny_model, batch.input_ids, batch.attention_mask, batch.labels, temperature=0.7)
    assert torch.allclose(got, want, atol=1e-5)
    # chunked over positions (3 per chunk) gives the same values and the same gradients
    chunked = sequence_logprobs(
        tiny_model, batch.input_ids, batch.attention_mask, batch.labels, temperature=0.7,
        chunk_elements=3 * 2 * 300,
    )
    assert torch.allclose(chunked, want, atol=1e-5)
    weight = tiny_model.model.layers[-1].mlp.down_proj.weight
    grads = []
    for elements in (1 << 26, 3 * 2 * 300):
        tiny_model.zero_grad(set_to_none=True)
        lp = sequence_logprobs(tiny_model, batch.input_ids, batch.attention_mask, batch.labels,
                               temperature=0.7, chunk_elements=elements)
        (lp * batch.action_mask).sum().backward()
        grads.append(weight.grad.clone())
    tiny_model.zero_grad(set_to_none=True)
    assert grads[0].abs().sum() > 0 and torch.allclose(grads[0], grads[1], atol=1e-6)


def test_ratio_one_gives_policy_gradient():
    lp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor([2.0]), torch.ones(1, 2), clip_epsilon=0.2)
    loss.backward()
    assert lp.grad.tolist() == [[-1.0, -1.0]]  # -A / n_tokens per token


def test_truncated_is_weights_cap_the_behaviour_ratio():
    # proximal/behaviour ratios 1, 3, 0.5 and e^100 (saturates at e^80), the last position masked
    proximal = torch.tensor([[0.0, math.log(3.0), math.log(0.5), 100.0, 5.0]])
    behavior = torch.zeros_like(proximal)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    weights, stats = truncated_is_weights(proximal, behavior, mask, 2.0)
    assert weights.tolist() == [[1.0, 2.0, pytest.approx(0.5), 2.0, 0.0]]
    assert stats["is_weight_max"] == 2.0 and stats["is_truncated_tokens"] == 2.0
    assert stats["is_ratio_max"] == pytest.approx(math.exp(80.0), rel=1e-5) and math.isfinite(stats["is_ratio_max"])


def test_is_weights_scale_each_token_term_without_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logprobs.detach().clone()  # ratio 1: the PPO term is −A per token
    advantages = torch.tensor([1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = torch.tensor([[2.0, 0.25, 7.0]], requires_grad=True)
    loss, _ = policy_loss(logprobs, old, advantages, mask, clip_epsilon=0.2, is_weights=weights)
    assert loss.item() == pytest.approx(-(2.0 + 0.25) / 2)
    loss.backward()
    assert logprobs.grad.tolist() == [[pytest.approx(-1.0), pytest.approx(-0.125), 0.0]]
    assert weights.grad is None


def test_sequence_level_term_weighs_every_sequence_the_same():
    """GSPO: a 1-token and a 4-token sequence with opposite advantages, at ratio 1: the loss is the
    mean of the per-sequence terms, and each sequence's gradient, summed over its tokens, is
    −A/N whatever its length."""
    lp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    advantages = torch.tensor([1.0, -0.5])
    loss, stats = policy_loss(lp, torch.zeros(2, 4), advantages, mask, clip_epsilon=3e-4, is_level="sequence")
    assert float(loss.detach()) == pytest.approx(-(1.0 - 0.5) / 2, rel=1e-6)
    loss.backward()
    per_sequence = (lp.grad * mask).sum(dim=-1)
    assert per_sequence.tolist() == pytest.approx([-1.0 / 2, 0.5 / 2], rel=1e-6)
    assert lp.grad[1].tolist() == pytest.approx([0.5 / 8] * 4, rel=1e-6)  # spread over its 4 tokens
    assert stats["clipped_tokens"] == 0.0
    # With a step-wide denominator (2 sequences in the whole step), one micro-batch's share.
    half, _ = policy_loss(lp.detach()[:1], torch.zeros(1, 4), advantages[:1], mask[:1], clip_epsilon=3e-4,
                          is_level="sequence", sequence_denominator=2.0)
    assert float(half) == pytest.approx(-0.5, rel=1e-6)


def test_sequence_level_has_its_own_small_epsilon():
    from kiln.core.training_config import TrainingConfig

    config = TrainingConfig()
    assert config.sequence_clip_epsilon == 3e-4 and config.clip_epsilon == 0.2


@pytest.mark.timeout(60)
def test_exact_kls_match_a_full_softmax_whatever_the_chunk():
    """:func:`exact_kls` equals ``Σ p·(log p − log q)`` from full softmaxes, at a temperature,
    for chunks of one position, of three, and all at once."""
    from kiln.core.train.losses import exact_kls

    torch.manual_seed(3)
    head = torch.nn.Linear(8, 50, bias=False)
    hp, hq1, hq2 = (torch.randn(7, 8) for _ in range(3))
    t = 0.7

    def brute(a, b):
        p = torch.softmax(head(a).double() / t, dim=-1)
        q = torch.softmax(head(b).double() / t, dim=-1)
        return (p * (p.log() - q.log())).sum(-1)

    for chunk in (1, 50 * 2 * 3 * 3, 1 << 24):
        kl1, kl2 = exact_kls(head, hp, [hq1, hq2], temperature=t, chunk_elements=chunk)
        assert torch.allclose(kl1, brute(hp, hq1), rtol=1e-6, atol=1e-9)
        assert torch.allclose(kl2, brute(hp, hq2), rtol=1e-6, atol=1e-9)
    assert float(exact_kls(head, hp, [hp])[0].abs().max()) == 0.0
