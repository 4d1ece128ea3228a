"""The Temporal Web UI's final details name what decided a run's ending (``workflows.ui``)."""

from __future__ import annotations

import pytest

from kiln.core.run_status import EvaluationStatus, Failure, PostEvaluationStatus, Progress, RunStatus
from workflows.ui import outcome_details

VERDICT = "Promoted: the trained adapter passed the gate and is now served; 5 wins of 5; mean return 0.2 -> 0.8."


@pytest.mark.timeout(30)
def test_the_gate_verdict_post_eval_reason_promotion_and_failure_are_said() -> None:
    evaluation = EvaluationStatus(
        seed_start=0, groups=20, group_size=2, progress=Progress.planned(20, 2), decision="passed",
        outcome="promoted", verdict=VERDICT,
    )
    gated = RunStatus(state="completed", environment_evaluation=evaluation, promoted=True)
    assert outcome_details(gated) == f"**verdict** {VERDICT}"
    post = PostEvaluationStatus(suite="arith", candidate_accuracy=0.5, baseline_accuracy=None,
                                gate_outcome="kept", reason="accuracy 0.5 < 0.6")
    assert outcome_details(RunStatus(state="completed", post_evaluation=post, promoted=False)) == (
        "**post-eval** kept: accuracy 0.5 < 0.6"
    )
    assert outcome_details(RunStatus(state="completed", promoted=True)) == "**promoted** yes"
    failed = RunStatus(state="failed", failure=Failure(code="training_failed", message="loss is NaN", stage="training"))
    assert outcome_details(failed) == "**failure** training_failed: loss is NaN"
    assert outcome_details(RunStatus(state="completed")) == ""
