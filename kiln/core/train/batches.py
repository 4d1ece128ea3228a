"""Seed groups → training rows → padded micro-batches (right padding, shifted next-token targets).

A :class:`Row` is one completion with its group's advantage. :func:`pack_microbatches` splits the
rows of one optimizer step into micro-batches whose padded size (rows × longest row) stays within
``max_tokens_per_microbatch`` (a row longer than the budget gets a micro-batch of its own), and
:func:`collate` pads a list of rows into a :class:`GroupBatch`. Shifted tensors have length
``T-1``: position ``j`` scores token ``ids[j+1]`` from the logits at ``j``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from kiln.core.train.advantages import group_advantages
from kiln.core.train.tokens import tokenize_completion


@dataclass(frozen=True)
class Row:
    key: tuple[int, int]  # (group index, completion index): the cache key of old/ref log-probs
    ids: torch.Tensor  # (L,) long
    action: torch.Tensor  # (L-1,) float, shifted
    env: torch.Tensor  # (L-1,) float, shifted
    obs_length: float
    behavior: torch.Tensor | None  # (L-1,) recorded log-probs, shifted, or None
    advantage: float
    reward: float

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class RowShaping:
    """How :func:`group_rows` turns rewards into advantages and what it trains of overlong
    completions (those with an action piece of at least ``max_action_tokens`` ids)."""

    advantage_norm: str = "group_std"  # group_std | none
    overlong: str = "keep"  # keep | mask | soft_penalty
    max_action_tokens: int | None = None
    buffer_tokens: int = 0
    penalty: float = 1.0

    def ramp(self, completion: dict[str, Any]) -> float:
        """0 … 1: 1 when the longest action piece reached ``max_action_tokens``, linear over the
        ``buffer_tokens`` before it, else 0."""
        if self.max_action_tokens is None:
            return 0.0
        longest = max((len(p["ids"]) for p in completion["tokens"]["pieces"] if p["kind"] == "action"), default=0)
        if longest >= self.max_action_tokens:
            return 1.0
        start = self.max_action_tokens - self.buffer_tokens
        return (longest - start) / self.buffer_tokens if self.buffer_tokens and longest > start else 0.0


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
    keys: list[tuple[int, int]] | None = None

    @property
    def action_tokens(self) -> int:
        return int(self.action_mask.sum().item())

    def to(self, device: torch.device) -> "GroupBatch":
        behavior = self.behavior_logprobs
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            labels=self.labels.to(device),
            action_mask=self.action_mask.to(device),
            env_mask=self.env_mask.to(device),
            obs_lengths=self.obs_lengths.to(device),
            behavior_logprobs=None if behavior is None else behavior.to(device),
            advantages=self.advantages.to(device),
        )


def group_rows(
    group: dict[str, Any],
    *,
    group_index: int,
    warning_filter: bool,
    vocab_size: int | None = None,
    env_mask_mode: str = "env_only",
    shaping: RowShaping | None = None,
) -> list[Row]:
    """Tokenise and mask every completion of ``group`` (ECHO targets per ``env_mask_mode``,
    :mod:`kiln.core.train.tokens`); attach the group-normalised advantages. ``shaping``: the advantage
    normalisation and overlong handling (``soft_penalty`` lowers the reward before the advantages;
    ``mask`` zeroes the action mask of a completion that reached the cap, its reward still counts in
    its group's advantages)."""
    shaping = shaping or RowShaping()
    completions = group["completions"]
    ramps = [shaping.ramp(c) if shaping.overlong != "keep" else 0.0 for c in completions]
    rewards = [
        float(c["reward"]) - (shaping.penalty * ramp if shaping.overlong == "soft_penalty" else 0.0)
        for c, ramp in zip(completions, ramps)
    ]
    advantages = group_advantages(rewards, shaping.advantage_norm)
    rows = []
    for index, completion in enumerate(completions):
        tc = tokenize_completion(
            completion, warning_filter=warning_filter, vocab_size=vocab_size, env_mask_mode=env_mask_mode
        )
        ids = tc.ids if len(tc.ids) >= 2 else tc.ids + [0] * (2 - len(tc.ids))
        pad = len(ids) - len(tc.ids)
        action = torch.tensor(tc.is_action + [False] * pad, dtype=torch.float32)[1:]
        if shaping.overlong == "mask" and ramps[index] >= 1.0:
            action = torch.zeros_like(action)
        env = torch.tensor(tc.is_env_target + [False] * pad, dtype=torch.float32)[1:]
        behavior = None
        if tc.behavior_logprobs is not None:
            behavior = torch.tensor(tc.behavior_logprobs + [0.0] * pad, dtype=torch.float32)[1:]
        rows.append(
            Row(
                key=(group_index, index),
                ids=torch.tensor(ids, dtype=torch.long),
                action=action,
                env=env,
                obs_length=float(tc.observation_tokens),
                behavior=behavior,
                advantage=advantages[index],
                reward=rewards[index],
            )
        )
    return rows


def collate(rows: list[Row], pad_id: int = 0) -> GroupBatch:
    """Right-pad ``rows`` into one batch."""
    width = max(r.length for r in rows)
    bsz = len(rows)
    input_ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attention = torch.zeros((bsz, width), dtype=torch.long)
    action = torch.zeros((bsz, width - 1), dtype=torch.float32)
    env = torch.zeros((bsz, width - 1), dtype=torch.float32)
    have_lp = all(r.behavior is not None for r in rows)
    behavior = torch.zeros((bsz, width - 1), dtype=torch.float32) if have_lp else None
    for b, row in enumerate(rows):
        n = row.length
        input_ids[b, :n] = row.ids
        attention[b, :n] = 1
        action[b, : n - 1] = row.action
        env[b, : n - 1] = row.env
        if behavior is not None and row.behavior is not None:  # have_lp: every row has one
            behavior[b, : n - 1] = row.behavior
    return GroupBatch(
        input_ids=input_ids,
        attention_mask=attention,
        labels=input_ids[:, 1:].clone(),
        action_mask=action,
        env_mask=env,
        obs_lengths=torch.tensor([r.obs_length for r in rows], dtype=torch.float32),
        behavior_logprobs=behavior,
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        rewards=[r.reward for r in rows],
        tokens=int(attention.sum().item()),
        keys=[r.key for r in rows],
    )


def pack_microbatches(rows: list[Row], max_tokens: int) -> list[list[Row]]:
    """Greedy in-order packing: each micro-batch's ``len(rows) · max(row length) ≤ max_tokens``."""
    batches: list[list[Row]] = []
    current: list[Row] = []
    width = 0
    for row in rows:
        new_width = max(width, row.length)
        if current and new_width * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, new_width = [], row.length
        current.append(row)
        width = new_width
    if current:
        batches.append(current)
    return batches


def build_group_batch(
    group: dict[str, Any],
    *,
    warning_filter: bool,
    vocab_size: int | None = None,
    pad_id: int = 0,
    group_index: int = 0,
) -> GroupBatch:
    """Every completion of ``group`` in one padded batch (evaluation, tests)."""
    rows = group_rows(group, group_index=group_index, warning_filter=warning_filter, vocab_size=vocab_size)
    return collate(rows, pad_id=pad_id)
