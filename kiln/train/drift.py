"""How far a training moved the policy: KL to the policy it started from and KL to the base model.

Measured once after the last step, on the training's own rows (every kept completion, sampled by
the starting policy π_start), over action tokens only, per token and averaged over all of them:

- ``kl_to_previous`` = KL(π_new ‖ π_start): with ``r = π_new / π_start`` on tokens sampled from
  π_start, ``E[r·log r − r + 1]`` (non-negative per token; its expectation is the KL). π_start's
  log-probs are the pre-update pass's (:func:`kiln.train.step.score_old_logprobs`); in an online
  run π_start is the previous iteration's adapter, so this is KL(π_k ‖ π_{k−1}).
- ``kl_to_base`` = KL(π_new ‖ π_base): ``E[r·(ρ − 1 − log ρ)]`` with ``ρ = π_base / π_new``,
  importance-weighted by the same ``r`` (the tokens were sampled from π_start, not π_new).

Both are token-level estimates (per-token ratios, not of whole sequences), at the sampling
temperature, with no gradient. π_new's log-probs come from the trainer's one no-grad pass after the
last step (which also gives the final evaluation). π_base's are the pre-update pass's when the
training started from the base model itself (a fresh LoRA's B is zero, so it adds exactly nothing),
else one more pass with every adapter disabled (:func:`base_logprobs`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.train.batches import Row
from kiln.train.step import LogprobCache, StepSettings, score_reference

DRIFT_ESTIMATOR = "token_mean_importance_weighted_k3"


def drift_terms(new: torch.Tensor, start: torch.Tensor, base: torch.Tensor,
                mask: torch.Tensor) -> tuple[float, float, float]:
    """Sums over ``mask``ed tokens of the two per-token estimates, and the token count."""
    log_r = new - start
    r = torch.exp(log_r)
    to_previous = r * log_r - r + 1.0
    log_rho = base - new
    to_base = r * (torch.exp(log_rho) - 1.0 - log_rho)
    return (float((to_previous * mask).sum().item()), float((to_base * mask).sum().item()),
            float(mask.sum().item()))


def base_logprobs(model: Any, rows: list[Row], cache: LogprobCache, settings: StepSettings,
                  device: torch.device, *, start_is_base: bool) -> dict[tuple[int, int], torch.Tensor]:
    """π_base's log-probs of ``rows``: the pre-update pass's (``cache.old``) when the training
    started from the base model (``start_is_base``: no base adapter, so the fresh LoRA adds exact
    zeros), else the KL reference's (``cache.ref``) and a pass with every adapter disabled for the
    rest. Leaves the RNG as it was."""
    if start_is_base:
        return cache.old
    missing = [row for row in rows if row.key not in cache.ref]
    if not missing:
        return cache.ref
    with torch.random.fork_rng(devices=[]):
        return {**cache.ref, **score_reference(model, missing, settings, device)}


def policy_drift(rows: list[list[Row]], start: dict[tuple[int, int], torch.Tensor],
                 new: dict[tuple[int, int], torch.Tensor],
                 base: dict[tuple[int, int], torch.Tensor]) -> dict[str, Any]:
    """The receipt's ``policy_drift`` block (see the module docstring) over the action tokens of
    every row that has all three log-probs: π_start's, π_new's and π_base's."""
    flat = [row for group in rows for row in group if row.key in start and row.key in new and row.key in base]
    to_previous = to_base = tokens = 0.0
    parts_previous, parts_base = [], []
    for row in flat:
        a, b, n = drift_terms(new[row.key], start[row.key], base[row.key], row.action)
        parts_previous.append(a)
        parts_base.append(b)
        tokens += n
    if tokens:
        to_previous = math.fsum(parts_previous) / tokens
        to_base = math.fsum(parts_base) / tokens
    return {"kl_to_previous": to_previous if tokens else None, "kl_to_base": to_base if tokens else None,
            "action_tokens": int(tokens), "estimator": DRIFT_ESTIMATOR}
