"""Engine/trainer log-prob gap figures and truncated importance-sampling weights."""

from __future__ import annotations

import math

import pytest

from kiln.core.train.mismatch import mismatch_figures, truncated_is_weights


def test_weights_are_the_probability_ratio_truncated_at_the_cap() -> None:
    engine = [math.log(0.5), math.log(0.1), math.log(0.4)]
    trainer = [math.log(0.5), math.log(0.3), math.log(0.1)]
    weights = truncated_is_weights(engine, trainer, cap=2.0)
    assert weights[0] == pytest.approx(1.0)
    assert weights[1] == 2.0  # 3.0 truncated
    assert weights[2] == pytest.approx(0.25)


def test_figures_over_rows() -> None:
    engine = [[-1.0, -2.0], [-0.5]]
    trainer = [[-1.0, -1.5], [-0.6]]
    figures = mismatch_figures(engine, trainer, cap=2.0)
    assert figures["tokens"] == 3
    assert figures["max_abs_delta"] == pytest.approx(0.5)
    assert figures["mean_abs_delta"] == pytest.approx((0.0 + 0.5 + 0.1) / 3)
    assert figures["is_weight_max"] == pytest.approx(math.exp(0.5))
    assert figures["is_weight_min"] == pytest.approx(math.exp(-0.1))
    assert figures["is_truncated_fraction"] == 0.0
    assert mismatch_figures([], [])["tokens"] == 0


def test_lengths_must_match() -> None:
    with pytest.raises(ValueError, match="2 engine log-probs for 1 trainer"):
        truncated_is_weights([-1.0, -1.0], [-1.0])
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights([-1.0], [-1.0], cap=0)
