"""What the API answers about runs: ``RunView`` (one run) and ``RunList`` (many), typed.

``RunView`` is the workflow's own ``RunStatus`` (``kiln.core.run_status``) plus what only the API knows:
Temporal's view of the execution (its state, start and close times, the Web UI link), the
activities in flight with their latest heartbeat, and the freshest training step the gpu worker
wrote to S3. ``RunList`` is the listing: one ``RunSummary`` per run, from Temporal's visibility
store (search attributes and the outcome memo), newest first.

Pure pydantic: the API builds them, the CLI, the run page and ``kiln.client`` parse them, and the
OpenAPI document describes them. JSON keys are those of ``kiln.run-status.v1`` and
``kiln.openenv-run-list.v1``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.run_status import Failure, RunStatus
from kiln.core.tolerant import Tolerant

RUN_LIST_SCHEMA = "kiln.openenv-run-list.v1"
# ``terminated``: ended through Temporal (``temporal workflow terminate``), not by Kiln.
RunState = Literal["running", "completed", "failed", "cancelled", "terminated"]
# Where the workflow-owned fields of a view came from.
StatusSource = Literal["query", "result", "history"]


class InFlightActivity(Tolerant):
    """One pending activity of a running run, as Temporal describes it."""

    model_config = ConfigDict(extra="forbid")

    activity: str = Field(description="Activity type, e.g. `collect_group` or `train_adapter`.")
    attempt: int = Field(description="1 on the first try; higher after retries.")
    state: str = Field(description="scheduled | started | cancel_requested | paused | pause_requested | unknown")
    details: dict[str, Any] | None = Field(
        default=None, description="The activity's latest heartbeat details (a JSON object), if any."
    )
    last_failure: str | None = Field(default=None, description="Why the previous attempt failed.")


class TrainingProgress(BaseModel):
    """The latest training step of a running run: the trainer's heartbeat, refreshed by the live
    progress the gpu worker writes to S3. Figures the trainer adds later are kept as extra keys."""

    model_config = ConfigDict(extra="allow")

    phase: str | None = Field(default=None, description="starting | training")
    step: int | None = Field(default=None, description="Optimizer steps done.")
    total_steps: int | None = Field(default=None, description="Optimizer steps planned.")
    loss: float | None = None
    policy_loss: float | None = None
    env_ce: float | None = None
    kl: float | None = None
    clip_fraction: float | None = None
    grad_norm: float | None = None
    learning_rate: float | None = None
    tokens_per_s: float | None = None


class Termination(Tolerant):
    """Who terminated a run through Temporal, and why, as Temporal's history recorded it."""

    model_config = ConfigDict(extra="forbid")

    identity: str = Field(description="The identity of the client that terminated the workflow.")
    reason: str = Field(description="The reason it gave (`temporal workflow terminate --reason`).")
    stage: str = Field(description="The stage the run was in when it was terminated.")


class RunView(RunStatus):
    """One run as the API answers it: the workflow's ``RunStatus`` plus the API's own fields."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    status_source: StatusSource = Field(
        default="query",
        description="Where the run's own fields come from: `query` (the live workflow answered), "
        "`result` (the completed run's result) or `history` (no worker answered the status query "
        "in time, so only what Temporal's history says is filled in; phase is `unknown` while "
        "the run is still running).",
    )
    started_at: str | None = Field(default=None, description="When the workflow started (ISO 8601).")
    closed_at: str | None = Field(default=None, description="When the workflow closed (ISO 8601).")
    temporal_ui: str | None = Field(default=None, description="The run in the Temporal Web UI.")
    in_flight: list[InFlightActivity] = Field(default_factory=list, description="Pending activities of a running run.")
    training_progress: TrainingProgress | None = Field(
        default=None, description="The latest training step while the run trains."
    )
    live_training: dict[str, Any] | None = Field(
        default=None, description="The raw live progress record the gpu worker last wrote to S3."
    )
    termination: Termination | None = Field(
        default=None, description="Set when `state` is `terminated`: who ended the run through Temporal, and why."
    )
    cancel_requested: bool = Field(default=False, description="True in the answer to a cancel request.")
    unclaimed: str | None = Field(
        default=None,
        description="Set while no worker has picked the run up and none polls its task queue: the "
        "message naming that queue (`no worker polls task queue Q for this run`). A follow ends on it.",
    )

    @property
    def terminal(self) -> bool:
        return self.state != "running"

    @property
    def timed_out(self) -> bool:
        """True when no worker answered the status query and the run is still running: the
        workflow-owned fields are placeholders, not the run's."""
        return self.status_source == "history" and self.state == "running"


class RunSummary(Tolerant):
    """One row of the run list (from Temporal's visibility store, no worker needed)."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    state: RunState
    phase: str | None = Field(default=None, description="The stage it is in, or its terminal state.")
    kind: str | None = None
    environment: str | None = None
    output_adapter: str | None = None
    mean_return: float | None = Field(default=None, description="From the outcome memo, set at the end.")
    promoted: bool | None = Field(default=None, description="From the outcome memo, set at the end.")
    evaluated: bool | None = Field(
        default=None,
        description="Whether a completed run's adapter was evaluated (from the outcome memo; "
        "null for runs from before this field).",
    )
    failure_code: str | None = Field(
        default=None, description="The Kiln error code of a failed run (from the outcome memo)."
    )
    started_at: str | None = None
    closed_at: str | None = None


class RunList(Tolerant):
    """``GET /v1/openenv/runs``: runs newest first."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: str = Field(default=RUN_LIST_SCHEMA, alias="schema")
    runs: list[RunSummary] = Field(default_factory=list)


def placeholder_failure(code: str, message: str) -> Failure:
    """A failure record when the workflow's own one can not be read (stage unknown)."""
    return Failure(code=code, message=message, stage="orchestration")


__all__ = [
    "InFlightActivity",
    "RUN_LIST_SCHEMA",
    "RunList",
    "RunState",
    "RunSummary",
    "RunView",
    "Termination",
    "TrainingProgress",
    "placeholder_failure",
]
