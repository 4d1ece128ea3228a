"""Group-normalised GRPO advantages. Pure Python: no torch.

``A_i = (r_i - mean(r)) / (std(r) + 1e-6)`` within one seed group. ``std`` is the *population*
standard deviation (divide by n, not n-1): a group's advantages then have unit RMS whatever the
group size, so a two-completion group yields ±1 rather than ±0.707. Summation is in a fixed order
(``math.fsum``) so the values are bit-stable.
"""

from __future__ import annotations

import math

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards: list[float]) -> list[float]:
    """Advantages for one group (all zero when every reward is equal)."""
    if not rewards:
        return []
    n = len(rewards)
    mean = math.fsum(rewards) / n
    var = math.fsum((r - mean) ** 2 for r in rewards) / n
    std = math.sqrt(var)
    return [(r - mean) / (std + ADVANTAGE_EPS) for r in rewards]
