"""One seed group → one padded training batch (right padding, shifted next-token targets).

Row ``b`` holds completion ``b``. Shifted tensors have length ``T-1``: position ``j`` scores token
``ids[j+1]`` from the logits at ``j`` (the log-prob of token t is predicted from position t-1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.train.advantages import group_advantages
from kiln.train.tokens import tokenize_completion


@dataclass
class GroupBatch:
    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long
    labels: torch.Tensor  # (B, T-1) long: input_ids[:, 1:]
    action_mask: torch.Tensor  # (B, T-1) float: 1 where the target is an action token
    env_mask: torch.Tensor  # (B, T-1) float: 1 where the target is an ECHO observation token
    obs_lengths: torch.Tensor  # (B,) float: all observation tokens per row (ECHO normaliser)
    behavior_logprobs: torch.Tensor | None  # (B, T-1) float recorded log-probs, or None
    advantages: torch.Tensor  # (B,) float
    rewards: list[float]
    tokens: int  # non-padding tokens in the batch

    @property
    def action_tokens(self) -> int:
        return int(self.action_mask.sum().item())

    def to(self, device: torch.device) -> "GroupBatch":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return GroupBatch(
            input_ids=move(self.input_ids),
            attention_mask=move(self.attention_mask),
            labels=move(self.labels),
            action_mask=move(self.action_mask),
            env_mask=move(self.env_mask),
            obs_lengths=move(self.obs_lengths),
            behavior_logprobs=move(self.behavior_logprobs),
            advantages=move(self.advantages),
            rewards=self.rewards,
            tokens=self.tokens,
        )


def build_group_batch(
    group: dict[str, Any],
    *,
    warning_filter: bool,
    vocab_size: int | None = None,
    pad_id: int = 0,
) -> GroupBatch:
    """Tokenise, pad and mask every completion of ``group``; attach its advantages."""
    completions = group["completions"]
    rows = [
        tokenize_completion(c, warning_filter=warning_filter, vocab_size=vocab_size)
        for c in completions
    ]
    rewards = [float(c["reward"]) for c in completions]
    width = max(len(r.ids) for r in rows)
    width = max(width, 2)
    bsz = len(rows)
    input_ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attention = torch.zeros((bsz, width), dtype=torch.long)
    action = torch.zeros((bsz, width), dtype=torch.float32)
    env = torch.zeros((bsz, width), dtype=torch.float32)
    have_lp = all(r.behavior_logprobs is not None for r in rows)
    behavior = torch.zeros((bsz, width), dtype=torch.float32) if have_lp else None
    obs_lengths = torch.zeros((bsz,), dtype=torch.float32)
    for b, row in enumerate(rows):
        n = len(row.ids)
        input_ids[b, :n] = torch.tensor(row.ids, dtype=torch.long)
        attention[b, :n] = 1
        action[b, :n] = torch.tensor(row.is_action, dtype=torch.float32)
        env[b, :n] = torch.tensor(row.is_env_target, dtype=torch.float32)
        obs_lengths[b] = float(row.observation_tokens)
        if behavior is not None:
            behavior[b, :n] = torch.tensor(row.behavior_logprobs, dtype=torch.float32)
    return GroupBatch(
        input_ids=input_ids,
        attention_mask=attention,
        labels=input_ids[:, 1:].clone(),
        action_mask=action[:, 1:].contiguous(),
        env_mask=env[:, 1:].contiguous(),
        obs_lengths=obs_lengths,
        behavior_logprobs=None if behavior is None else behavior[:, 1:].contiguous(),
        advantages=torch.tensor(group_advantages(rewards), dtype=torch.float32),
        rewards=rewards,
        tokens=int(attention.sum().item()),
    )
