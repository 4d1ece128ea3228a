"""What the Temporal Web UI shows of a run: static summary, live current details, outcome memo.

``show_progress`` and ``record_outcome`` are called from workflow code; the static summary and
details a run is started with come from ``kiln.core.run_labels``.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from kiln.core.run_status import RunStatus

OUTCOME_MEMO_PATCH = "kiln-outcome-memo-v1"
FAILURE_MEMO_PATCH = "kiln-failure-code-memo-v1"
EVALUATED_MEMO_PATCH = "kiln-evaluated-memo-v1"


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def show_progress(status: RunStatus) -> None:
    """``current_details``: the live phase and progress (Markdown)."""
    progress = status.progress
    parts = [f"**phase** {status.phase}"]
    if status.iterations_total and status.iterations_total > 1 and status.iteration:
        parts.append(f"**iteration** {status.iteration}/{status.iterations_total}")
    if progress.groups_total:
        parts.append(f"**groups** {progress.groups_completed}/{progress.groups_total}")
        parts.append(f"**rollouts** {progress.rollouts_completed}/{progress.rollouts_total}")
    if status.mean_return is not None:
        parts.append(f"**mean return** {_number(status.mean_return)}")
    workflow.set_current_details(" · ".join(parts))


def outcome_details(status: RunStatus) -> str:
    """What decided the ending, for the final ``current_details`` (under the phase line, which
    already says the state): the gate's verdict, the post-evaluation's reason, whether an
    unevaluated run was promoted, a failure's code and message; empty when there is nothing."""
    parts = []
    evaluation = status.environment_evaluation
    if evaluation is not None and evaluation.verdict:
        parts.append(f"**verdict** {evaluation.verdict}")
    post = status.post_evaluation
    if post is not None:
        parts.append(f"**post-eval** {post.gate_outcome}: {post.reason}")
    if status.state == "completed" and status.promoted is not None and evaluation is None and post is None:
        parts.append("**promoted** " + ("yes" if status.promoted else "no"))
    if status.failure is not None:
        parts.append(f"**failure** {status.failure.code}: {status.failure.message}")
    return " · ".join(parts)


def record_outcome(status: RunStatus) -> None:
    """Memo the outcome (state, mean return, promoted; a failed run's code; whether a completed
    run was evaluated) so list views show results without a worker; the final details add the
    verdict (:func:`outcome_details`)."""
    show_progress(status)
    outcome = outcome_details(status)
    if outcome:
        workflow.set_current_details(workflow.get_current_details() + "\n\n" + outcome)
    if workflow.patched(OUTCOME_MEMO_PATCH):
        workflow.upsert_memo({"state": status.state, "mean_return": status.mean_return, "promoted": status.promoted})
    if status.failure is not None and workflow.patched(FAILURE_MEMO_PATCH):
        workflow.upsert_memo({"failure_code": status.failure.code})
    if status.state == "completed" and workflow.patched(EVALUATED_MEMO_PATCH):
        # Whether a promotion decision rested on an evaluation (the run list says "not evaluated").
        evaluated = status.environment_evaluation is not None or status.post_evaluation is not None
        workflow.upsert_memo({"evaluated": evaluated})
