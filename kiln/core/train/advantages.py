"""Group-normalised GRPO advantages. Pure Python: no torch.

``A_i = (r_i - mean(r)) / (std(r) + 1e-6)`` within one seed group. ``std`` is the *population*
standard deviation (divide by n, not n-1): a group's advantages then have unit RMS whatever the
group size, so a two-completion group yields ±1 rather than ±0.707. Summation is in a fixed order
(``math.fsum``) so the values are bit-stable.

``advantage_norm: none`` (Dr. GRPO) keeps only the centring, ``A_i = r_i - mean(r)``: a group with
little reward spread is not blown up to unit scale.
"""

from __future__ import annotations

import math

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards: list[float], norm: str = "group_std") -> list[float]:
    """Advantages for one group (all zero when every reward is equal); ``norm`` ``group_std`` or ``none``."""
    if not rewards:
        return []
    n = len(rewards)
    mean = math.fsum(rewards) / n
    if norm == "none":
        return [r - mean for r in rewards]
    if norm != "group_std":
        raise ValueError(f"advantage_norm must be group_std or none, got {norm!r}")
    var = math.fsum((r - mean) ** 2 for r in rewards) / n
    std = math.sqrt(var)
    return [(r - mean) / (std + ADVANTAGE_EPS) for r in rewards]
