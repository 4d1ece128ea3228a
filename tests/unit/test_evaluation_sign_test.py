"""Exact two-sided sign test."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kiln.core.evaluation.sign_test import exact_sign_test_fraction, exact_sign_test_p_value


@pytest.mark.parametrize(
    ("improved", "regressed", "expected"),
    [
        (20, 0, 1.9073486328125e-06),
        (15, 5, 0.04138946533203125),
        (14, 6, 0.11531829833984375),
        (6, 0, 0.03125),
        (5, 0, 0.0625),
    ],
)
def test_reference_vectors_exact(improved: int, regressed: int, expected: float) -> None:
    assert exact_sign_test_p_value(improved, regressed) == expected
    # two-sided: symmetric in the direction
    assert exact_sign_test_p_value(regressed, improved) == expected


def test_twenty_zero_is_exactly_two_to_minus_nineteen() -> None:
    assert exact_sign_test_fraction(20, 0) == Fraction(1, 2**19)
    assert exact_sign_test_p_value(20, 0) == 2.0**-19


def test_no_untied_pairs_is_one() -> None:
    assert exact_sign_test_p_value(0, 0) == 1.0


def test_capped_at_one_when_balanced() -> None:
    # n=10, k=5: 2·Σ_{i≤5} C(10,i)/1024 = 2·638/1024 > 1 → capped
    assert exact_sign_test_fraction(5, 5) == 1
    assert exact_sign_test_p_value(1, 0) == 1.0  # 2·1/2 = 1


def test_small_sample_values() -> None:
    assert exact_sign_test_fraction(3, 1) == Fraction(2 * (1 + 4), 16)  # 0.625
    assert exact_sign_test_p_value(4, 0) == 0.125
    assert exact_sign_test_p_value(9, 1) == 2 * (1 + 10) / 1024


@pytest.mark.parametrize("bad", [-1, 1.0, True, "3"])
def test_rejects_non_counts(bad) -> None:
    with pytest.raises(ValueError):
        exact_sign_test_p_value(bad, 0)
    with pytest.raises(ValueError):
        exact_sign_test_p_value(0, bad)
