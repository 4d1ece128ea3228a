"""``kiln.client`` follow events: what changed between two views of a run, never a placeholder."""

from __future__ import annotations

import pytest

from kiln.client import PhaseChanged, ProgressMade, RunEnded, TrainingStep, WarningRaised, raise_for_outcome
from kiln.client.events import events_between
from kiln.core.errors import EnvironmentUnavailable, RunCancelled
from kiln.core.run_status import Failure, Progress
from kiln.core.run_view import RunView, TrainingProgress


def _view(**fields: object) -> RunView:
    return RunView(run_id="r", **fields)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_events_name_what_changed() -> None:
    queued = _view(phase="queue")
    assert [type(e) for e in events_between(None, queued)] == [PhaseChanged]
    collecting = _view(phase="collection", progress=Progress(groups_completed=1, groups_total=2,
                                                              rollouts_completed=2, rollouts_total=4))
    (phase, progress) = events_between(queued, collecting)
    assert isinstance(phase, PhaseChanged) and (phase.previous, phase.phase) == ("queue", "collection")
    assert isinstance(progress, ProgressMade) and (progress.progress.rollouts_completed, progress.progress.rollouts_total) == (2, 4)
    assert events_between(collecting, collecting) == []
    training = collecting.model_copy(update={
        "phase": "training", "warnings": ["group 1 skipped: equal rewards"],
        "training_progress": TrainingProgress(step=3, total_steps=8, loss=0.25),
    })
    kinds = [e.kind for e in events_between(collecting, training)]
    assert kinds == ["phase", "training_step", "warning"]
    step = next(e for e in events_between(collecting, training) if isinstance(e, TrainingStep))
    assert (step.step, step.total_steps, step.loss) == (3, 8, 0.25)
    assert [e.message for e in events_between(collecting, training) if isinstance(e, WarningRaised)] == [
        "group 1 skipped: equal rewards"
    ]
    done = training.model_copy(update={"state": "completed", "phase": "completed"})
    assert [e.kind for e in events_between(training, done)] == ["ended"]


@pytest.mark.timeout(30)
def test_a_timed_out_status_query_yields_nothing() -> None:
    real = _view(phase="training", progress=Progress(groups_completed=2, groups_total=2,
                                                     rollouts_completed=4, rollouts_total=4))
    stub = _view(phase="unknown", status_source="history")
    assert stub.timed_out
    assert events_between(real, stub) == []
    assert events_between(None, stub) == []


@pytest.mark.timeout(30)
def test_outcomes_raise_the_run_failure_code() -> None:
    done = _view(state="completed", phase="completed")
    assert raise_for_outcome(done) is done
    failed = _view(state="failed", phase="failed", failure=Failure(
        code="environment_unavailable", message="nothing listens", stage="discovery", details=["x"]))
    with pytest.raises(EnvironmentUnavailable) as caught:
        raise_for_outcome(failed)
    assert caught.value.code == "environment_unavailable" and caught.value.stage == "discovery"
    assert caught.value.details == {"value": ["x"]}
    with pytest.raises(RunCancelled) as cancelled:
        raise_for_outcome(_view(state="cancelled", phase="cancelled", cancelled_stage="queue"))
    assert cancelled.value.code == "cancelled" and cancelled.value.stage == "queue"
    assert isinstance(RunEnded(view=done, state="completed"), RunEnded)


@pytest.mark.timeout(30)
def test_every_declared_code_comes_back_as_its_own_class() -> None:
    from kiln.core.errors import ModelNotServed, TrackerUnavailable, error_from_dict

    served = error_from_dict({"code": "model_not_served", "message": "m", "details": {"served": []}})
    assert type(served) is ModelNotServed and served.details == {"served": []}
    assert type(error_from_dict({"code": "tracker_unavailable", "message": "m"})) is TrackerUnavailable
    unknown = error_from_dict({"code": "from_the_future", "message": "m"})
    assert type(unknown).__name__ == "KilnError" and unknown.code == "from_the_future"
