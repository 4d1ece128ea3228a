"""GRPO policy surrogate, ECHO observation cross-entropy and k1 KL — on per-token log-probs.

All functions take shifted per-token tensors of shape ``(B, T-1)``; masks are float 0/1 and enter
by multiplication, so a masked position contributes an exactly-zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CISPO_MAX_WEIGHT = 5.0  # R5.2 cispo_max_weight: truncation cap of the recorded importance ratio


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p(labels[b, j] | prefix)`` from ``logits[:, :-1]``; shape ``(B, T-1)``, float32."""
    shifted = logits[:, :-1, :].float()
    flat = -F.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), labels.reshape(-1), reduction="none"
    )
    return flat.view(labels.shape)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_epsilon: float,
    max_ratio: float = CISPO_MAX_WEIGHT,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip surrogate, token-mean over every action token of the batch.

    ``ratio = exp(logp - old)``; objective ``min(r·A, clip(r, 1-ε, 1+ε)·A)`` where the unclipped
    ratio is first truncated at ``max_ratio`` (truncated importance sampling: a stale token with a
    negative advantage cannot dominate the batch). With ``old = logp.detach()`` the ratio is exactly
    1 and the gradient is the on-policy policy gradient ``A·∇logp``.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(-1)
    unclipped = torch.clamp(ratio, max=max_ratio) * adv
    clipped = torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon) * adv
    per_token = -torch.minimum(unclipped, clipped)
    count = action_mask.sum().clamp(min=1.0)
    loss = (per_token * action_mask).sum() / count
    with torch.no_grad():
        was_clipped = ((unclipped != clipped) & (action_mask > 0)).float().sum() / count
    return loss, {"clip_fraction": float(was_clipped.item())}


def echo_loss(
    logprobs: torch.Tensor, env_mask: torch.Tensor, obs_lengths: torch.Tensor
) -> torch.Tensor:
    """ECHO env CE: per sequence ``Σ CE over env targets / full observation length``, mean over the
    sequences that have any observation token (0 when none has)."""
    per_seq = -(logprobs * env_mask).sum(dim=-1)
    has_obs = (obs_lengths > 0).float()
    per_seq = per_seq / obs_lengths.clamp(min=1.0) * has_obs
    return per_seq.sum() / has_obs.sum().clamp(min=1.0)


def kl_k1(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> torch.Tensor:
    """k1 estimator ``logp - logp_ref``, token-mean over action tokens."""
    count = action_mask.sum().clamp(min=1.0)
    return ((logprobs - ref_logprobs) * action_mask).sum() / count


@dataclass
class LossParts:
    total: torch.Tensor
    policy: float
    env_ce: float
    kl: float
    clip_fraction: float
