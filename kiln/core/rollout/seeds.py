"""Generation seeds per (group seed, candidate index, step)."""

from __future__ import annotations

_MASK = (1 << 64) - 1
_CANDIDATE_MIX = 0x9E3779B97F4A7C15
_STEP_MIX = 0xBF58476D1CE4E5B9


def generation_seed(seed: int, candidate_index: int, step: int) -> int:
    """``seed XOR wrap(candidate × 0x9E37…) XOR wrap(step × 0xBF58…)`` as an unsigned 64-bit int."""
    return (seed & _MASK) ^ ((candidate_index * _CANDIDATE_MIX) & _MASK) ^ ((step * _STEP_MIX) & _MASK)
