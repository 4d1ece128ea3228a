"""Learning that holds over many iterations: 6 collect→train iterations of the tiny demo model on
the counter environment, at ``TrainingConfig``'s defaults, on two seed ranges, through
the workflow's per-iteration wiring in-process (``tests/support/online_loop.py``: continuation
state, first moment zeroed at each boundary, pre-update old log-probs, penalty completions).

On each range the held-out return (20 held-out seeds × 2 episodes) is never below the base
model's from iteration 2 on, and iteration 6's adapter beats the base on the paired sign test
(per held-out seed, p < 0.05). The runs are a ``background`` job (``tests/support/background.py``):
one child Python process with one torch thread plays the base, then each range in turn, started
when the session begins, so in a whole-suite run it works on the core the chaos package leaves
idle; this test asserts on its figures."""

from __future__ import annotations

import pytest

from kiln.core.evaluation.sign_test import exact_sign_test_p_value
from tests.support.background import LEARNING_EVALUATE_FROM, LEARNING_ITERATIONS, LEARNING_RANGES, BackgroundJobs
from tests.support.online_loop import IterationFigures, figures_from_json


def _check_range(start: int, iterations: list[IterationFigures], base: dict[int, float]) -> None:
    base_mean = sum(base.values()) / len(base)
    curve = [round(f.held_out_mean, 3) for f in iterations[LEARNING_EVALUATE_FROM - 1:] if f.held_out]
    assert [f.failed for f in iterations] == [None] * LEARNING_ITERATIONS, (start, curve)
    assert all(bool(f.held_out) == (f.iteration >= LEARNING_EVALUATE_FROM) for f in iterations)
    assert all(f.held_out_mean >= base_mean for f in iterations[LEARNING_EVALUATE_FROM - 1:]), (start, base_mean, curve)
    last = iterations[-1].held_out
    assert set(last) == set(base) and len(base) == 20
    improved = sum(1 for seed in base if last[seed] > base[seed])
    regressed = sum(1 for seed in base if last[seed] < base[seed])
    assert improved > regressed and exact_sign_test_p_value(improved, regressed) < 0.05, \
        (start, improved, regressed, curve)
    # The trainer saw the policy move every iteration, and drift from the base accumulate.
    assert all(f.kl_to_previous > 0 and f.kl_to_base > 0 for f in iterations)


@pytest.mark.slow
@pytest.mark.background("online_learning")
@pytest.mark.timeout(1800)
def test_six_iterations_keep_improving_on_two_seed_ranges(background_jobs: BackgroundJobs) -> None:
    result = background_jobs.result("online_learning", timeout_s=1750)
    base = {int(seed): value for seed, value in result["base"].items()}
    assert sorted(result["ranges"]) == sorted(str(start) for start in LEARNING_RANGES)
    for start in LEARNING_RANGES:
        _check_range(start, figures_from_json(result["ranges"][str(start)]), base)
