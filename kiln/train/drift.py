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
temperature, with no gradient; they leave the model and the RNG as they were.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.train.batches import Row
from kiln.train.step import LogprobCache, StepSettings, score_reference, score_rows

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


def policy_drift(model: Any, rows: list[list[Row]], cache: LogprobCache, settings: StepSettings,
                 device: torch.device) -> dict[str, Any]:
    """The receipt's ``policy_drift`` block (see the module docstring)."""
    flat = [row for group in rows for row in group if row.key in cache.old]
    with torch.random.fork_rng(devices=[]):
        new = score_rows(model, flat, settings, device)
        missing = [row for row in flat if row.key not in cache.ref]
        base = {**cache.ref, **(score_reference(model, missing, settings, device) if missing else {})}
    to_previous = to_base = tokens = 0.0
    parts_previous, parts_base = [], []
    for row in flat:
        a, b, n = drift_terms(new[row.key], cache.old[row.key], base[row.key], row.action)
        parts_previous.append(a)
        parts_base.append(b)
        tokens += n
    if tokens:
        to_previous = math.fsum(parts_previous) / tokens
        to_base = math.fsum(parts_base) / tokens
    return {"kl_to_previous": to_previous if tokens else None, "kl_to_base": to_base if tokens else None,
            "action_tokens": int(tokens), "estimator": DRIFT_ESTIMATOR}
