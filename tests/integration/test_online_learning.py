"""Learning that holds over many iterations: 6 collect→train iterations of the tiny demo model on
the counter environment, at ``TrainingConfig``'s defaults, on two seed ranges, through
the workflow's per-iteration wiring in-process (``tests/support/online_loop.py``: continuation
state, first moment zeroed at each boundary, pre-update old log-probs, penalty completions).

On each range the held-out return (20 held-out seeds × 2 episodes) is never below the base
model's from iteration 2 on, and iteration 6's adapter beats the base on the paired sign test
(per held-out seed, p < 0.05). The two ranges run at the same time, the second in a child Python
process (``tests/support/child_call.py``), each with one torch thread, so both cores work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.contracts import TrainingConfig
from kiln.evaluation.sign_test import exact_sign_test_p_value
from tests.support.child_call import child_result, start_child, stop_child
from tests.support.online_loop import IterationFigures, figures_from_json, held_out, run_online

torch = pytest.importorskip("torch")

ITERATIONS = 6
EVALUATE_FROM = 2
IN_PROCESS_RANGE, CHILD_RANGE = 0, 200


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path) -> Any:
    from kiln.policy.runtime import PolicyRuntime

    torch.set_num_threads(1)
    return PolicyRuntime.load(tiny_model_dir)


def _check_range(start: int, iterations: list[IterationFigures], base: dict[int, float]) -> None:
    base_mean = sum(base.values()) / len(base)
    curve = [round(f.held_out_mean, 3) for f in iterations[1:] if f.held_out]
    assert [f.failed for f in iterations] == [None] * ITERATIONS, (start, curve)
    assert all(f.held_out_mean >= base_mean for f in iterations[1:]), (start, base_mean, curve)
    last = iterations[-1].held_out
    assert set(last) == set(base) and len(base) == 20
    improved = sum(1 for seed in base if last[seed] > base[seed])
    regressed = sum(1 for seed in base if last[seed] < base[seed])
    assert improved > regressed and exact_sign_test_p_value(improved, regressed) < 0.05, \
        (start, improved, regressed, curve)
    # The trainer saw the policy move every iteration, and drift from the base accumulate.
    assert all(f.kl_to_previous > 0 and f.kl_to_base > 0 for f in iterations)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_six_iterations_keep_improving_on_two_seed_ranges(runtime, tiny_model_dir, counter_env_url, tmp_path):
    child = start_child("tests.support.online_loop:online_run_in_child", url=counter_env_url,
                        model_path=str(tiny_model_dir), work=str(tmp_path / f"range-{CHILD_RANGE}"),
                        seed_start=CHILD_RANGE, iterations=ITERATIONS, evaluate_from=EVALUATE_FROM)
    try:
        base = held_out(runtime, counter_env_url, None)
        run = run_online(runtime, counter_env_url, tiny_model_dir, tmp_path / f"range-{IN_PROCESS_RANGE}",
                         config=TrainingConfig(), seed_start=IN_PROCESS_RANGE,
                         iterations=ITERATIONS, base_held_out=base, evaluate_from=EVALUATE_FROM)
        child_iterations = figures_from_json(child_result(child))
    finally:
        stop_child(child)
    _check_range(IN_PROCESS_RANGE, run.iterations, base)
    _check_range(CHILD_RANGE, child_iterations, base)
