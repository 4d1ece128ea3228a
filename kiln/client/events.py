"""What ``Client.follow`` yields: typed events, computed from two successive views of a run.

Pure: :func:`events_between` compares the previous ``RunView`` with the current one and names
what changed (the phase, collection progress, a training step, new warnings, the end). Views that
are placeholders (no worker answered the status query in time, ``RunView.timed_out``) are never
compared: the follower keeps the last real view and waits for the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.core.run_status import Progress
from kiln.core.run_view import RunView


@dataclass(frozen=True)
class RunEvent:
    """Something that happened to a run; ``view`` is the run as it was seen then."""

    kind: ClassVar[str] = "event"
    view: RunView


@dataclass(frozen=True)
class PhaseChanged(RunEvent):
    """The run entered another stage (``previous`` None: the first view seen)."""

    kind: ClassVar[str] = "phase"
    phase: str
    previous: str | None


@dataclass(frozen=True)
class ProgressMade(RunEvent):
    """More groups or episodes were collected (training, evaluation or an iteration's)."""

    kind: ClassVar[str] = "progress"
    progress: Progress  # groups and rollouts completed of those planned


@dataclass(frozen=True)
class TrainingStep(RunEvent):
    """The trainer finished optimizer step ``step`` (of ``total_steps``), with its loss."""

    kind: ClassVar[str] = "training_step"
    step: int
    total_steps: int | None
    loss: float | None


@dataclass(frozen=True)
class WarningRaised(RunEvent):
    """A new entry in the run's warnings (a skipped group, a capacity refusal, …)."""

    kind: ClassVar[str] = "warning"
    message: str


@dataclass(frozen=True)
class RunEnded(RunEvent):
    """The last event of every follow: ``state`` is completed, failed, cancelled or terminated."""

    kind: ClassVar[str] = "ended"
    state: str


def events_between(previous: RunView | None, current: RunView) -> list[RunEvent]:
    """The events that take a follower from ``previous`` (None: nothing seen yet) to ``current``."""
    if current.timed_out:
        return []
    events: list[RunEvent] = []
    before_phase = previous.phase if previous is not None else None
    if current.phase != before_phase and current.state == "running":
        events.append(PhaseChanged(view=current, phase=current.phase, previous=before_phase))
    now = current.progress
    then = previous.progress if previous is not None else None
    if now.rollouts_completed and (
        then is None
        or (now.groups_completed, now.rollouts_completed) != (then.groups_completed, then.rollouts_completed)
    ):
        events.append(ProgressMade(view=current, progress=now))
    step = current.training_progress.step if current.training_progress is not None else None
    seen = previous.training_progress.step if previous is not None and previous.training_progress else None
    if step is not None and step != seen:
        progress = current.training_progress
        assert progress is not None
        events.append(TrainingStep(view=current, step=step, total_steps=progress.total_steps, loss=progress.loss))
    already = len(previous.warnings) if previous is not None else 0
    for message in current.warnings[already:]:
        events.append(WarningRaised(view=current, message=message))
    if current.terminal:
        events.append(RunEnded(view=current, state=current.state))
    return events


__all__ = [
    "PhaseChanged",
    "ProgressMade",
    "RunEnded",
    "RunEvent",
    "TrainingStep",
    "WarningRaised",
    "events_between",
]
