"""The gap between an engine's recorded log-probs and the trainer's own, and its truncated-IS weights.

Pure (no torch). For every action token, ``delta = trainer_logprob - engine_logprob``; the
truncated importance-sampling weight of the token is ``min(exp(delta), cap)``, the correction of
the gap between the distribution that sampled (the engine) and the one being trained (the
trainer's view of the same policy). :func:`mismatch_figures` summarises a batch for a receipt.
The correction is meant for engines whose kernels differ from the trainer's (vllm); on the hf
engine the gap is rounding (under 1e-4) and the weights are 1.
"""

from __future__ import annotations

import math
from typing import Sequence

DEFAULT_IS_CAP = 2.0


def truncated_is_weights(
    engine: Sequence[float], trainer: Sequence[float], *, cap: float = DEFAULT_IS_CAP
) -> list[float]:
    """``min(exp(trainer - engine), cap)`` per token (same length required)."""
    if len(engine) != len(trainer):
        raise ValueError(f"{len(engine)} engine log-probs for {len(trainer)} trainer log-probs")
    if cap <= 0:
        raise ValueError("the IS cap must be > 0")
    return [min(math.exp(t - e), cap) for e, t in zip(engine, trainer)]


def mismatch_figures(
    engine: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]], *, cap: float = DEFAULT_IS_CAP
) -> dict[str, float | int]:
    """Receipt figures over every token of every row: ``tokens``, ``mean_abs_delta``,
    ``max_abs_delta``, ``is_weight_mean``, ``is_weight_min``, ``is_weight_max`` and
    ``is_truncated_fraction`` (tokens whose weight hit ``cap``)."""
    if len(engine) != len(trainer):
        raise ValueError(f"{len(engine)} engine rows for {len(trainer)} trainer rows")
    deltas: list[float] = []
    weights: list[float] = []
    for e_row, t_row in zip(engine, trainer):
        weights.extend(truncated_is_weights(e_row, t_row, cap=cap))
        deltas.extend(abs(t - e) for e, t in zip(e_row, t_row))
    if not deltas:
        return {
            "tokens": 0,
            "mean_abs_delta": 0.0,
            "max_abs_delta": 0.0,
            "is_weight_mean": 1.0,
            "is_weight_min": 1.0,
            "is_weight_max": 1.0,
            "is_truncated_fraction": 0.0,
            "is_cap": cap,
        }
    return {
        "tokens": len(deltas),
        "mean_abs_delta": sum(deltas) / len(deltas),
        "max_abs_delta": max(deltas),
        "is_weight_mean": sum(weights) / len(weights),
        "is_weight_min": min(weights),
        "is_weight_max": max(weights),
        "is_truncated_fraction": sum(1 for w in weights if w >= cap) / len(weights),
        "is_cap": cap,
    }


__all__ = ["DEFAULT_IS_CAP", "mismatch_figures", "truncated_is_weights"]
