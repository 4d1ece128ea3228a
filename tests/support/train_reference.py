"""An independent computation of the trainer's evaluation figures, for tests: one padded forward
per group (``build_group_batch``), not the trainer's per-row passes, so a test comparing the two
checks the trainer's figures against another code path."""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.core.train.batches import GroupBatch
from kiln.core.train.losses import echo_loss, sequence_logprobs


@torch.no_grad()
def evaluate(model: Any, batches: list[GroupBatch], device: torch.device,
             temperature: float = 1.0) -> dict[str, Any]:
    """Forward-only: mean ECHO env CE over groups, mean action log-prob, per-row action log-prob sums."""
    env_values: list[float] = []
    lp_sum = 0.0
    lp_count = 0.0
    sums: list[list[float]] = []
    for batch in batches:
        b = batch.to(device)
        logprobs = sequence_logprobs(model, b.input_ids, b.attention_mask, b.labels, temperature=temperature)
        env_values.append(float(echo_loss(logprobs, b.env_mask, b.obs_lengths).item()))
        per_row = (logprobs * b.action_mask).sum(dim=-1)
        sums.append([float(x) for x in per_row.tolist()])
        lp_sum += float(per_row.sum().item())
        lp_count += float(b.action_mask.sum().item())
    return {
        "env_ce": math.fsum(env_values) / len(env_values) if env_values else None,
        "action_logprob_mean": lp_sum / lp_count if lp_count else None,
        "action_logprob_sums": sums,
    }
