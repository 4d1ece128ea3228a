"""Per-token log-probs (chunked, at the sampling temperature) and the GRPO / ECHO / KL loss terms.

All loss functions take shifted per-token tensors of shape ``(B, T-1)``; masks are float 0/1 and
enter by multiplication, so a masked position contributes an exactly-zero gradient. Reductions
divide by a caller-given ``denominator`` (the action-token count, or the number of sequences with
observations, of the whole optimizer step), so summing the terms of several micro-batches gives
exactly the loss of the step in one batch: results do not depend on the micro-batch size.
:func:`exact_kls` gives the exact full-vocabulary KL between two policies' next-token
distributions from their hidden states, in position chunks (the drift figures).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Elements of one chunk of fp32 logits (16 Mi floats = 64 MiB): the sequence is scored in chunks
# of ``LOGIT_CHUNK_ELEMENTS // (rows · vocab)`` positions, never the whole (B, T, V) at once.
LOGIT_CHUNK_ELEMENTS = 1 << 24


def _scoring_temperature(temperature: float) -> float:
    # T=0 is greedy decoding: there is no sampled distribution; score the untempered logits.
    return float(temperature) if temperature and temperature > 0 else 1.0


def _chunk_logprobs(head: Any, hidden: torch.Tensor, labels: torch.Tensor, temperature: float):
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    flat = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return flat.view(labels.shape)


def _chunk_logprobs_entropy(head: Any, hidden: torch.Tensor, labels: torch.Tensor, temperature: float):
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_p = F.log_softmax(logits, dim=-1)
    picked = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked, -(torch.exp(log_p) * log_p).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits/T)[labels]`` from full ``logits[:, :-1]``; shape ``(B, T-1)``, float32.

    For already-materialised logits (probes, tests); training uses :func:`sequence_logprobs`.
    """
    t = _scoring_temperature(temperature)
    shifted = logits[:, :-1, :].float()
    if t != 1.0:
        shifted = shifted / t
    flat = -F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels.reshape(-1), reduction="none")
    return flat.view(labels.shape)


def _split(model: Any) -> tuple[Any, Any]:
    """(decoder backbone, output head) of a causal LM, PEFT-wrapped or not."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return lm.get_decoder(), lm.get_output_embeddings()


def backbone(model: Any) -> Any:
    """The decoder backbone (ids → last hidden states) of a causal LM, PEFT-wrapped or not."""
    return _split(model)[0]


def output_head(model: Any) -> Any:
    """The output head (hidden state → vocabulary logits) of a causal LM, PEFT-wrapped or not."""
    return _split(model)[1]


def sequence_hidden(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The backbone's last hidden states at positions ``0 … T−2`` (each predicts the next token),
    ``(B, T-1, d)``: what :func:`sequence_logprobs` feeds the output head."""
    backbone, _ = _split(model)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return hidden.last_hidden_state[:, :-1, :]


def sequence_logprobs(
    model: Any,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_elements: int = LOGIT_CHUNK_ELEMENTS,
    hidden: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> Any:
    """Per-token ``log p(labels | prefix)`` at temperature ``T``, shape ``(B, T-1)``, float32.

    One backbone forward (skipped when ``hidden``, :func:`sequence_hidden`'s output, is given),
    then the output head over chunks of positions. With gradients on, each
    chunk runs under activation checkpointing, so only the hidden states are kept for backward and
    the logits of one chunk are alive at a time (peak logits memory ``chunk_elements`` floats
    instead of ``B·T·V``). Values are identical to :func:`token_logprobs` on the full logits.
    ``with_entropy``: returns ``(logprobs, entropy)``, the second the per-position entropy of the
    tempered next-token distribution (``(B, T-1)``, with gradient), from the same chunks.
    """
    head = output_head(model)
    if hidden is None:
        if input_ids is None or attention_mask is None:
            raise ValueError("sequence_logprobs needs input_ids and attention_mask, or hidden")
        hidden = sequence_hidden(model, input_ids, attention_mask)
    t = _scoring_temperature(temperature)
    rows, length = labels.shape
    vocab = int(head.weight.shape[0])
    step = max(1, chunk_elements // max(1, rows * vocab))
    chunk = _chunk_logprobs_entropy if with_entropy else _chunk_logprobs
    if step >= length:
        return chunk(head, hidden, labels, t)
    parts = []
    for start in range(0, length, step):
        h = hidden[:, start : start + step, :]
        y = labels[:, start : start + step]
        if torch.is_grad_enabled():
            parts.append(checkpoint(chunk, head, h, y, t, use_reentrant=False))
        else:
            parts.append(chunk(head, h, y, t))
    if with_entropy:
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
    return torch.cat(parts, dim=1)


@torch.no_grad()
def exact_kls(
    head: Any,
    hidden_p: torch.Tensor,
    hidden_qs: list[torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_elements: int = LOGIT_CHUNK_ELEMENTS,
    heads_q: list[Any] | None = None,
) -> list[torch.Tensor]:
    """Per position, the exact ``KL(p ‖ q) = Σ_v p(v)·(log p(v) − log q(v))`` over the whole
    vocabulary, for each ``q`` in ``hidden_qs``: ``p = softmax(head(hidden_p)/T)``, ``q`` likewise
    from its hidden states (all ``(N, d)``, the same N positions) through ``heads_q[i]`` when given
    (another model's head: full training), else ``head``. Returns one ``(N,)`` float64
    tensor per ``q`` (the fp32 logits are taken to float64 first). Positions are taken in chunks so that the logits alive at a time stay within
    ``chunk_elements`` floats (as :func:`sequence_logprobs`); no ``(N, V)`` tensor is ever built."""
    t = _scoring_temperature(temperature)
    vocab = int(head.weight.shape[0])
    step = max(1, chunk_elements // max(1, 2 * vocab * (1 + len(hidden_qs))))  # float64: 2 floats each
    out: list[list[torch.Tensor]] = [[] for _ in hidden_qs]
    for start in range(0, int(hidden_p.shape[0]), step):
        # float64 from the fp32 logits: a policy that barely moved gets a KL near 0, not fp32 noise
        log_p = F.log_softmax(head(hidden_p[start : start + step]).float().double() / t, dim=-1)
        p = torch.exp(log_p)
        for i, hidden_q in enumerate(hidden_qs):
            head_q = heads_q[i] if heads_q is not None else head
            log_q = F.log_softmax(head_q(hidden_q[start : start + step]).float().double() / t, dim=-1)
            out[i].append((p * (log_p - log_q)).sum(dim=-1).clamp(min=0.0))
    empty = hidden_p.new_zeros((0,), dtype=torch.float64)
    return [torch.cat(parts) if parts else empty for parts in out]


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def sequence_ratio(log_ratio: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised sequence ratio ``exp(mean over action tokens of logp − old)``, ``(B, 1)``."""
    count = action_mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return torch.exp((log_ratio * action_mask).sum(dim=-1, keepdim=True) / count)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_epsilon: float,
    clip_eps_high: float | None = None,
    is_level: str = "token",
    cispo_max_weight: float = 5.0,
    denominator: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    sequence_denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO surrogate summed over action tokens / ``denominator`` (default: this batch's count);
    for ``sequence`` summed over sequences / ``sequence_denominator`` (default: this batch's
    sequences with an action token).

    ``advantages`` is ``(B,)`` or per token ``(B, T-1)``. ``is_level``:

    - ``token``: ``−min(r·A, clip(r, 1−ε, 1+ε_high)·A)`` with ``r = exp(logp − old)`` per token;
    - ``sequence`` (GSPO): ``−min(s·A, clip(s, 1−ε, 1+ε_high)·A)`` per *sequence*, with one ratio
      per sequence ``s = exp(mean_t(logp − old))`` and the sequence's advantage (the mean of its
      tokens' advantages), averaged over sequences: each sequence weighs the same whatever its
      length;
    - ``cispo``: ``−sg(min(r, cispo_max_weight))·A·logp`` (the IS weight is a constant; every
      token keeps a gradient, large ratios are truncated rather than zeroed).

    For ``token`` and ``cispo``, ``denominator`` may be a per-row ``(B, 1)`` tensor: each row's
    terms are divided by their own normaliser (``loss_normaliser: sequences``).

    ``is_weights`` (``(B, T-1)``, no gradient), when given, multiplies each token's term: the
    truncated behaviour importance weight of a stale batch (:func:`truncated_is_weights`).

    Returns the loss and ``{"clipped_tokens", "action_tokens", "max_ratio_deviation"}`` (the largest
    per-token ``|r − 1|``; for ``sequence`` also per token): tokens whose clipped term won
    (PPO: the min picked the clipped branch with a strictly smaller value, so the token has no
    gradient; CISPO: the weight was truncated).
    """
    adv = _per_token(advantages)
    log_ratio = logprobs - old_logprobs
    high = clip_epsilon if clip_eps_high is None else clip_eps_high
    if is_level == "cispo":
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, max=cispo_max_weight).detach()
        per_token = -weight * adv * logprobs
        clipped_mask = ratio.detach() > cispo_max_weight
    elif is_level == "sequence":
        return _sequence_loss(
            log_ratio, adv.expand_as(logprobs), action_mask, clip_epsilon, high, sequence_denominator, is_weights
        )
    else:
        ratio = torch.exp(log_ratio)
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        clipped_mask = (clipped < unclipped).detach()
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    if denominator is None:
        denominator = action_mask.sum().clamp(min=1.0)
    if isinstance(denominator, torch.Tensor) and denominator.dim() > 0:  # per row (B, 1): sequence means
        loss = (per_token * action_mask / denominator).sum()
    else:
        loss = (per_token * action_mask).sum() / denominator
    with torch.no_grad():
        return loss, _loss_stats(log_ratio, action_mask, clipped_mask.float() * action_mask)


def _loss_stats(log_ratio: torch.Tensor, action_mask: torch.Tensor, clipped: torch.Tensor) -> dict[str, float]:
    """A policy term's figures: clipped tokens (the sum of ``clipped``, a count per token or per
    row), action tokens, and the largest ``|ratio - 1|`` over the action tokens (0 without any)."""
    deviation = (
        ((torch.exp(log_ratio) - 1.0).abs() * action_mask).max() if action_mask.any() else log_ratio.new_zeros(())
    )
    return {
        "clipped_tokens": float(clipped.sum().item()),
        "action_tokens": float(action_mask.sum().item()),
        "max_ratio_deviation": float(deviation.item()),
    }


def _sequence_loss(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    action_mask: torch.Tensor,
    low: float,
    high: float,
    denominator: float | torch.Tensor | None,
    is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GSPO term of :func:`policy_loss`: one clipped ratio and one advantage per sequence,
    summed over sequences with an action token and divided by ``denominator``."""
    count = action_mask.sum(dim=-1)
    has_action = (count > 0).to(log_ratio.dtype)
    seq_adv = (adv * action_mask).sum(dim=-1) / count.clamp(min=1.0)
    ratio = sequence_ratio(log_ratio, action_mask).squeeze(-1)
    unclipped = ratio * seq_adv
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * seq_adv
    per_seq = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_seq = per_seq * ((is_weights.detach() * action_mask).sum(dim=-1) / count.clamp(min=1.0))
    if denominator is None:
        denominator = has_action.sum().clamp(min=1.0)
    loss = (per_seq * has_action).sum() / denominator
    with torch.no_grad():
        clipped_seq = (clipped < unclipped).to(log_ratio.dtype) * has_action
        return loss, _loss_stats(log_ratio, action_mask, clipped_seq * count)


def truncated_is_weights(
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    max_weight: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``min(π_prox / π_behaviour, max_weight)`` per action token (no
    gradient; 0 off action tokens) and ``{"is_ratio_max", "is_weight_max", "is_truncated_tokens"}``
    over the action tokens (the largest untruncated ratio, the largest weight, how many tokens
    were truncated)."""
    with torch.no_grad():
        # the log-ratio saturates at 80 so a reported ratio stays finite (e^80 ≫ any max_weight)
        log_ratio = torch.clamp(proximal_logprobs - behavior_logprobs, max=80.0)
        ratio = torch.exp(log_ratio) * action_mask
        weights = torch.clamp(ratio, max=max_weight) * action_mask
        on = action_mask > 0
        stats = {
            "is_ratio_max": float(ratio[on].max().item()) if on.any() else 0.0,
            "is_weight_max": float(weights[on].max().item()) if on.any() else 0.0,
            "is_truncated_tokens": float(((ratio > max_weight) & on).sum().item()),
        }
    return weights, stats


def echo_loss(
    logprobs: torch.Tensor,
    env_mask: torch.Tensor,
    obs_lengths: torch.Tensor,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """ECHO env CE: per sequence ``Σ CE over env targets / full observation length``, summed over
    the sequences that have any observation token and divided by ``denominator`` (default: their
    count in this batch; 0 when none has)."""
    per_seq = -(logprobs * env_mask).sum(dim=-1)
    has_obs = (obs_lengths > 0).float()
    per_seq = per_seq / obs_lengths.clamp(min=1.0) * has_obs
    if denominator is None:
        denominator = has_obs.sum().clamp(min=1.0)
    return per_seq.sum() / denominator


def kl_k3(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """k3 estimator of KL(π‖π_ref): ``exp(ref − logp) − (ref − logp) − 1`` per action token.

    Non-negative, zero iff ``logp = ref``; its gradient ``(1 − exp(ref − logp))·∇logp`` pushes
    ``logp`` down where the policy is above the reference and up where below."""
    delta = ref_logprobs - logprobs
    per_token = torch.exp(delta) - delta - 1.0
    if denominator is None:
        denominator = action_mask.sum().clamp(min=1.0)
    return (per_token * action_mask).sum() / denominator


def kl_k1_penalty(old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """k1 per-token KL ``logp_old − logp_ref`` on action tokens (no gradient): subtracted, times
    ``kl_coeff``, from each token's advantage, i.e. a per-token reward penalty."""
    return ((old_logprobs - ref_logprobs) * action_mask).detach()
