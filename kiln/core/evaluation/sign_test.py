"""Exact two-sided binomial sign test (``paired_return_sign_test_v1``).

``n = improved + regressed`` (ties are dropped by the caller), ``k = min(improved, regressed)``,
``p = min(1, 2 · Σ_{i≤k} C(n, i) / 2ⁿ)``; ``n = 0`` gives ``p = 1`` (nothing to confirm).

The tail is summed with Python integers and the ratio is an exact ``Fraction``; only the final
value is rounded (once) to a float, so e.g. ``(20, 0)`` is exactly ``2⁻¹⁹ = 1.9073486328125e-06``.
"""

from __future__ import annotations

from fractions import Fraction
from math import comb


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def exact_sign_test_fraction(improved: int, regressed: int) -> Fraction:
    """The exact two-sided p-value as a ``Fraction`` (``1`` when there are no non-tied pairs)."""
    n = _count("improved", improved) + _count("regressed", regressed)
    if n == 0:
        return Fraction(1)
    k = min(improved, regressed)
    tail = sum(comb(n, i) for i in range(k + 1))
    return min(Fraction(1), Fraction(2 * tail, 2**n))


def exact_sign_test_p_value(improved: int, regressed: int) -> float:
    """The exact two-sided sign-test p-value, correctly rounded to a float."""
    return float(exact_sign_test_fraction(improved, regressed))


__all__ = ["exact_sign_test_fraction", "exact_sign_test_p_value"]
