"""A run's status: the typed record the run workflows keep and their ``status`` query returns.

One stage vocabulary everywhere: a run's ``phase`` while it works is the name of the stage it is
in, and the same name is ``failure.stage`` / ``cancelled_stage`` when it ends there, and the stem
of the stage's activities (docs/architecture.md has the table). Pure pydantic: the workflows, the
API and the CLI all read it; JSON keys are those of ``kiln.run-status.v1``.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import ConfigDict, Field

from kiln.core.rollout.context import context_warning
from kiln.core.tolerant import Tolerant

STATUS_SCHEMA = "kiln.run-status.v1"

# Stages of a live run, in order, then those of a dataset-training run.
LiveStage = Literal[
    "admission",
    "queue",
    "discovery",
    "collection",
    "revalidation",
    "training",
    "evaluation",
    "post_evaluation",
    "publication",
]
Stage = Literal[LiveStage, "split"]
RUN_STAGES: tuple[str, ...] = get_args(LiveStage)
DATASET_STAGES = ("split", "training", "publication")
# ``terminated`` is set by the API only (the workflow cannot see its own termination).
TERMINAL_STATES = ("completed", "failed", "cancelled", "terminated")


def invalid_action_rate(stats: dict[str, Any]) -> float | None:
    """Episodes ended by an invalid model action per rollout, from a bundle's ``stats``."""
    rollouts = stats.get("rollouts") or 0
    return stats.get("invalid_model_action_count", 0) / rollouts if rollouts else None


class _Status(Tolerant):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=False)


# ``progress.groups`` keeps the records of the most recent groups only (a run may have 16,384).
MAX_GROUP_RECORDS = 512


class GroupRun(_Status):
    """Which worker collected a group, on which attempt (scale-out and chaos evidence)."""

    group_index: int
    worker: str | None = None
    attempt: int = 1


class Progress(_Status):
    """Groups and rollouts done; wall-clock model figures live here, never in artifacts."""

    groups_completed: int = 0
    groups_total: int = 0
    rollouts_completed: int = 0
    rollouts_total: int = 0
    mean_return: float | None = None
    model_latency_ms: float = 0.0
    model_tokens: int = 0
    groups: list[GroupRun] = Field(default_factory=list)
    returns_sum: float = Field(default=0.0, exclude=True)

    @classmethod
    def planned(cls, groups: int, group_size: int) -> "Progress":
        return cls(groups_total=groups, rollouts_total=groups * group_size)

    def plan_more(self, groups: int, group_size: int) -> None:
        """``groups`` more groups to collect (a dynamic-sampling refill round)."""
        self.groups_total += groups
        self.rollouts_total += groups * group_size

    def add_group(
        self,
        return_sum: float,
        rollouts: int,
        *,
        latency_ms: float,
        tokens: int,
        group_index: int | None = None,
        worker: str | None = None,
        attempt: int = 1,
    ) -> None:
        if group_index is not None:
            self.groups.append(GroupRun(group_index=group_index, worker=worker, attempt=attempt))
            del self.groups[:-MAX_GROUP_RECORDS]  # the most recent ones: status stays bounded
        self.groups_completed += 1
        self.rollouts_completed += rollouts
        self.returns_sum += return_sum
        if self.rollouts_completed:
            self.mean_return = self.returns_sum / self.rollouts_completed
        self.model_latency_ms = round(self.model_latency_ms + latency_ms, 3)
        self.model_tokens += tokens


class Admission(_Status):
    sequence: int
    queue_position: int | None = None
    submitted_at: str
    admitted_at: str | None = None
    queue_wait_ms: int | None = None


class EnvironmentStatus(_Status):
    base_url: str
    name: str
    discovery_sha256: str | None
    schema_sha256: str


class Interruption(_Status):
    """A retried activity: a seed group re-collected (``group_index``), or any other activity whose
    earlier attempts were lost to a dead worker or failed; ``attempts`` is the one that completed."""

    stage: str
    activity: str = "collect_group"
    group_index: int | None = None
    attempts: int
    code: str | None = None
    recovered: str = "re-collected from reset with the same seed"


class TrainingStatus(_Status):
    trained: bool
    steps: int
    final_loss: float | None
    adapter_sha256: str | None
    selection: dict[str, Any]
    skip_reason: str | None


# At most this many warnings are kept (the receipts hold every one).
MAX_WARNINGS = 200
# ``interruptions`` keeps the most recent records only (a long run may re-collect thousands of
# groups); ``interruptions_total`` counts them all.
MAX_INTERRUPTION_RECORDS = 256
# ``iterations`` keeps the most recent records only; the whole curve is the run's metrics.jsonl.
MAX_ITERATION_RECORDS = 100


# A training whose adapter is further than this from the base model (KL(π ‖ π_base), nats per
# action token, exact over the vocabulary: kiln.core.train.drift) gets a status warning.
KL_TO_BASE_WARN_NATS = 1.0


def kl_to_base_warning(kl_to_base: float | None) -> str | None:
    """The status warning of a training that moved the policy far from the base model (None when
    ``kl_to_base`` is unknown or at most :data:`KL_TO_BASE_WARN_NATS`)."""
    if kl_to_base is None or not kl_to_base > KL_TO_BASE_WARN_NATS:
        return None
    return (
        f"the trained adapter is {kl_to_base:.2f} nats per action token from the base model "
        f"(KL to base above {KL_TO_BASE_WARN_NATS:g}): the policy moved far in one training; lower "
        "training_config.learning_rate or epochs, set training_config.target_kl to end the training "
        "early, or add a kl_coeff penalty"
    )


def reset_warning(label: str, group_index: int, fields: list[str]) -> str:
    """The status warning of a group whose candidates saw different resets (``reset_determinism:
    warn``); ``label`` is the collection's ("group", "iteration 2 group", "eval baseline" …)."""
    # "iteration 3 group" → "iteration 3: group" (a next iteration may collect while one trains)
    where = (
        label.replace(" group", ": group")
        if label.startswith("iteration ")
        else ("group" if label == "group" else f"{label} group")
    )
    shown = ", ".join(fields[:8]) + (f" and {len(fields) - 8} more" if len(fields) > 8 else "")
    return f"{where} {group_index}: candidates saw different resets in {shown} (reset_determinism: warn)"


class IterationStatus(_Status):
    """One online-RL iteration: what it collected with, its returns, and what training made of it."""

    iteration: int  # 1-based
    seed_start: int
    behavior_adapter_sha256: str | None  # the adapter that sampled it (None = the base model)
    staleness: int = 0  # iterations between the sampling adapter and the one training started from
    mean_return: float | None = None
    invalid_action_rate: float | None = None
    trained: bool = False
    steps: int = 0
    loss: float | None = None
    kl: float | None = None
    kl_to_previous: float | None = None  # KL(π_k ‖ π_{k−1}) on the iteration's action tokens
    kl_to_base: float | None = None  # KL(π_k ‖ base model)
    early_stop_step: int | None = None  # where training_config.target_kl ended the training
    adapter_sha256: str | None = None  # the adapter this iteration produced
    eval_mean_return: float | None = None  # held-out mean return of that adapter, when evaluated
    eval_baseline_mean_return: float | None = None
    wall_ms: int | None = None


# An iteration's training figures: their status (and metrics.jsonl) name → the TrainResult field.
_TRAINING_FIGURES = {
    "trained": "trained",
    "steps": "steps",
    "loss": "final_loss",
    "kl": "kl",
    "kl_to_previous": "kl_to_previous",
    "kl_to_base": "kl_to_base",
    "early_stop_step": "early_stop_step",
    "adapter_sha256": "adapter_sha256",
}


def training_figures(training: Any) -> dict[str, Any]:
    """An iteration's training figures under their :class:`IterationStatus` names, from its
    ``TrainResult``; with no training (None), those fields' defaults (not trained, 0 steps)."""
    if training is None:
        return {name: IterationStatus.model_fields[name].default for name in _TRAINING_FIGURES}
    return {name: getattr(training, attr) for name, attr in _TRAINING_FIGURES.items()}


class EvaluationStatus(_Status):
    state: str = "collecting_baseline"
    seed_start: int
    groups: int
    group_size: int
    progress: Progress
    baseline_stats: dict[str, Any] | None = None
    candidate_stats: dict[str, Any] | None = None
    decision: str | None = None
    outcome: str | None = None
    verdict: str | None = None
    evidence: dict[str, Any] | None = None
    world_model: dict[str, Any] | None = None


class PostEvaluationStatus(_Status):
    suite: str
    candidate_accuracy: float
    baseline_accuracy: float | None
    gate_outcome: str
    reason: str


class Failure(_Status):
    code: str
    message: str
    stage: str
    retryable: bool = False
    hint: str | None = None
    details: Any = None


class ManifestStatus(_Status):
    uri: str
    sha256: str


class ArtifactStatus(_Status):
    name: str
    uri: str
    sha256: str
    bytes: int


class RunStatus(_Status):
    """Everything the API, CLI and Web UI show about a run while it runs and after it ends."""

    schema_: str = Field(default=STATUS_SCHEMA, alias="schema")
    run_id: str = ""
    kind: str | None = None
    phase: str = "admission"
    state: Literal["running", "completed", "failed", "cancelled", "terminated"] = "running"
    progress: Progress = Field(default_factory=Progress)
    mean_return: float | None = None
    environments: list[EnvironmentStatus] = Field(default_factory=list)
    training: TrainingStatus | None = None
    environment_evaluation: EvaluationStatus | None = None
    post_evaluation: PostEvaluationStatus | None = None
    manifest: ManifestStatus | None = None
    artifacts: list[ArtifactStatus] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    interruptions: list[Interruption] = Field(default_factory=list)
    interruptions_total: int = 0
    failure: Failure | None = None
    admission: Admission | None = None
    request_sha256: str | None = None
    reset_plan_sha256: str | None = None
    behavior_policy: dict[str, Any] | None = None
    rollout_stats: dict[str, Any] | None = None
    promoted: bool | None = None
    cancelled_stage: str | None = None
    # What each environment granted (sessions, refusals, waves): wall-clock facts, never artifacts.
    environment_capacity: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Online RL: the iteration in progress (1-based) of ``iterations_total``, and the curve so far.
    iteration: int | None = None
    iterations_total: int | None = None
    iterations: list[IterationStatus] = Field(default_factory=list)

    # ------------------------------------------------------------------ phase helpers
    def enter(self, stage: str) -> None:
        self.phase = stage

    def stage(self) -> str:
        """The stage the run is in (or ended in): its phase unless the phase is terminal."""
        return self.phase if self.phase not in TERMINAL_STATES else (self.cancelled_stage or "orchestration")

    def finish(self, state: Literal["completed", "failed", "cancelled"]) -> None:
        self.state = state
        self.phase = state

    def fail(self, failure: Failure) -> None:
        self.failure = failure
        self.finish("failed")

    def cancel(self) -> None:
        stage = self.stage()
        self.warnings.append(
            "cancelled while queued (no environment was contacted)"
            if stage in ("admission", "queue")
            else f"cancelled during {stage}; nothing was published"
        )
        self.cancelled_stage = stage
        self.finish("cancelled")

    def record_training(self, training: Any) -> None:
        self.training = TrainingStatus.model_validate(training, from_attributes=True)
        self.warn(*training.selection.get("warnings", []))
        drifted = kl_to_base_warning(getattr(training, "kl_to_base", None))
        if drifted is not None:
            self.warn(drifted)

    def warn(self, *messages: str) -> None:
        """Add warnings (bounded: an online-RL run trains many times); in a run of several
        iterations each one starts with ``iteration k:``, the iteration it came from (the one in
        progress, unless the message already names its own)."""
        multi = (self.iterations_total or 1) > 1 and self.iteration is not None
        if multi:
            messages = tuple(m if m.startswith("iteration ") else f"iteration {self.iteration}: {m}" for m in messages)
        self.warnings.extend(messages)
        del self.warnings[MAX_WARNINGS:]

    def warn_context(self, stats: dict[str, Any] | None) -> None:
        """Warn when most of the run's episodes ended at the model's context (once per figure)."""
        message = context_warning(stats or {})
        if message is not None and message not in self.warnings:
            self.warn(message)

    def record_interruption(self, interruption: Interruption) -> None:
        """A retried activity (bounded: the most recent ``MAX_INTERRUPTION_RECORDS``)."""
        self.interruptions.append(interruption)
        del self.interruptions[:-MAX_INTERRUPTION_RECORDS]
        self.interruptions_total += 1

    def record_retry(self, activity: str, attempt: int) -> None:
        """An activity (other than a group's collection) that completed on attempt ``attempt`` > 1."""
        self.record_interruption(
            Interruption(
                stage=self.stage(),
                activity=activity,
                attempts=attempt,
                recovered=f"retried; attempt {attempt} completed"
                + (" (resumed from the last checkpoint, if one was written)" if activity == "train_adapter" else ""),
            )
        )

    def record_iteration(self, record: IterationStatus) -> None:
        """Append an iteration's record (bounded: the most recent ``MAX_ITERATION_RECORDS``)."""
        self.iterations = [r for r in self.iterations if r.iteration != record.iteration] + [record]
        del self.iterations[:-MAX_ITERATION_RECORDS]

    def record_evidence(self, published: Any, code: str) -> None:
        """A run failing (``code``) after collection published its collected episodes: the manifest
        and artifacts are the evidence (``kiln openenv download``/``verify``); nothing is promoted."""
        self.manifest = ManifestStatus(uri=published.manifest_uri, sha256=published.manifest_sha256)
        self.artifacts = [ArtifactStatus.model_validate(a.model_dump()) for a in published.artifacts]
        self.rollout_stats = published.stats
        self.warn_context(published.stats)
        self.promoted = False
        self.warn(
            f"the run failed ({code}) after collection: its collected episodes are published as evidence "
            "(manifest and bundle; no adapter, nothing promoted)"
        )

    def record_publication(self, published: Any, *, promoted: bool) -> None:
        self.warn_context(published.stats)
        self.manifest = ManifestStatus(uri=published.manifest_uri, sha256=published.manifest_sha256)
        self.artifacts = [ArtifactStatus.model_validate(a.model_dump()) for a in published.artifacts]
        self.promoted = promoted
        self.finish("completed")
