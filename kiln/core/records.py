"""The small records each run stage takes and returns (they cross Temporal, so stay small).

Anything large — inspections, group documents, adapters, bundles — lives in S3 and crosses as a
``StoredObject`` reference ``{uri, sha256, bytes}``. No record here may approach 256 KiB.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from kiln.core.contracts import EpisodeSettings, RunRequest
from kiln.core.training_config import EnvironmentEvalConfig, TrainingConfig
from kiln.core.run_plan import PARALLEL_GROUPS, BundleSpec, DynamicSamplingRecord, GroupSlot
from kiln.core.run_status import Progress, RunStatus
from kiln.core.tolerant import Tolerant


class Record(Tolerant):
    model_config = ConfigDict(extra="forbid")


class ActivityResult(Record):
    """What an activity returns. ``attempt`` is the attempt that produced it, set by the wrapper
    every activity has (``activities.common.kiln_errors``): above 1, earlier attempts were lost
    (a dead worker, a timeout) or failed, and the workflow records the retry in the run's status.
    A fact about this execution only: never part of an artifact."""

    attempt: int = 1


class StoredObject(Record):
    """A content-addressed S3 object."""

    uri: str
    sha256: str
    bytes: int

    @classmethod
    def of(cls, ref: Any) -> "StoredObject":
        """From a store ``ObjectRef`` (the one conversion, used everywhere)."""
        return cls(uri=ref.uri, sha256=ref.sha256, bytes=ref.bytes)

    def ref(self) -> Any:
        """The store's ``ObjectRef`` for reading this object back (verified)."""
        from kiln.core.artifacts.store import ObjectRef

        return ObjectRef(uri=self.uri, sha256=self.sha256, bytes=self.bytes)


class GroupSet(ActivityResult):
    """A collection's stored groups, by reference: S3 index objects (``kiln.core.artifacts.group_sets``),
    each a JSON list of one chunk's group objects in group order. Crosses Temporal at a constant
    size whatever the number of groups, so no training or publication input grows with a run."""

    indexes: list[StoredObject]
    count: int

    @classmethod
    def join(cls, sets: list["GroupSet"]) -> "GroupSet":
        """Several sets as one, in order (only the index references are concatenated)."""
        return cls(indexes=[i for s in sets for i in s.indexes], count=sum(s.count for s in sets))


class GroupIndexInput(Record):
    """One chunk's group references, in group order, to store as a group index."""

    groups: list[StoredObject]


class AdmissionInput(Record):
    """The one untyped value: the submission as given, parsed by admission into a ``RunRequest``."""

    run_id: str
    submission: dict[str, Any]


class AdmissionResult(ActivityResult):
    request: RunRequest
    request_sha256: str
    reset_templates: list[dict[str, Any]]
    reset_plan_sha256: str
    gpu_task_queue: str
    queue_workflow_id: str
    heartbeat_timeout_s: float = 30.0
    warnings: list[str] = []  # e.g. a seed dropped from reset options
    parallel_groups: int = PARALLEL_GROUPS  # groups the run keeps in flight (the control worker's setting)


class DiscoveryInput(Record):
    run_id: str
    environment_urls: list[str]
    credential_ids: list[str | None] = Field(default_factory=list)


class EnvironmentRef(Record):
    """One discovered environment: its identity digests and the stored inspection."""

    base_url: str
    name: str
    discovery_sha256: str | None
    schema_sha256: str
    inspection: StoredObject


class DiscoveryResult(ActivityResult):
    environments: list[EnvironmentRef]


class RevalidationInput(Record):
    run_id: str
    environments: list[EnvironmentRef]
    credential_ids: list[str | None] = Field(default_factory=list)


class AdapterFile(Record):
    name: str
    object: StoredObject


class AdapterRef(Record):
    """A LoRA adapter pinned by content: its name, content digest and stored files."""

    name: str
    adapter_sha256: str
    files: list[AdapterFile]


class PolicyInput(Record):
    adapter: str | None = None
    adapter_ref: AdapterRef | None = None
    expected: dict[str, Any] | None = None
    # the run's sampling settings (kiln.core.policy.identity.inference_config); None = model identity only
    inference: dict[str, Any] | None = None
    # The run's thinking mode, resolved against the model's chat template (None = not asked).
    thinking: bool | Literal["auto"] | None = None


class PolicyResult(ActivityResult):
    behavior_policy: dict[str, Any]
    adapter_ref: AdapterRef | None = None
    thinking: bool | None = None  # the resolved thinking mode, when the input asked for one


class CollectGroupInput(Record):
    run_id: str
    group_index: int
    environment_index: int
    seed: int
    reset_payload: dict[str, Any]
    inspection: StoredObject
    settings: EpisodeSettings
    behavior_policy: dict[str, Any]
    adapter_ref: AdapterRef | None = None
    credential_id: str | None = None
    on_interrupt: Literal["resume", "fail"]
    label: str = "group"  # "group" (collection) or "eval baseline" / "eval candidate" (live metrics)
    # Dynamic sampling: report whether training keeps the group under this on_no_output (None: not asked).
    signal_on_no_output: Literal["drop", "zero_reward", "penalty"] | None = None


class CollectGroupResult(ActivityResult):
    group_index: int
    group: StoredObject
    returns: list[float]
    steps: int
    terminations: dict[str, int]
    model_tokens: int
    model_latency_ms: float
    interruption_code: str | None = None
    worker: str | None = None  # identity of the worker process that collected it (wall-clock fact)
    # What the environment granted this run (sessions_granted_max, max_sessions_advertised, this
    # attempt's refusals and waves): run status only, never the reproducible artifacts.
    capacity: dict[str, Any] | None = None
    # Under reset_determinism: warn, the reset fields this group's candidates saw differently.
    reset_differences: list[str] = Field(default_factory=list)
    # Every completion ended inside <think> (kiln.core.unfinished_thinking): a warning in run status.
    unfinished_thinking: bool = False
    signal: bool | None = None  # asked by signal_on_no_output: the group has reward variation training keeps


class CollectionPlan(Record):
    """Everything one collection (a run's groups, one iteration's, or one evaluation side's) needs,
    so a chunk of it can run in its own child workflow (``workflows/chunk.py``)."""

    run_id: str
    label: str  # "group" or "eval baseline" / "eval candidate" (status, summaries, live metrics)
    slots: list[GroupSlot]
    environments: list[EnvironmentRef]
    reset_templates: list[dict[str, Any]]
    credential_ids: list[str | None] = Field(default_factory=list)
    settings: EpisodeSettings
    behavior_policy: dict[str, Any]
    adapter_ref: AdapterRef | None = None
    on_interrupt: Literal["resume", "fail"]
    capacity_wait_seconds: int
    control_queue: str
    gpu_queue: str
    heartbeat_s: float
    parallel_groups: int = PARALLEL_GROUPS  # collect_group activities in flight at once
    signal_on_no_output: Literal["drop", "zero_reward", "penalty"] | None = None  # dynamic sampling asks

    def chunk(self, slots: list[GroupSlot]) -> "CollectionPlan":
        return self.model_copy(update={"slots": slots})


class GroupOutcome(Record):
    """What the run's status keeps of one collected group (never part of the artifacts)."""

    group_index: int
    environment_index: int  # into the run's environments (a URL may be long; a chunk has 256 of these)
    return_sum: float  # Σ of the group's episode returns (the list stays in the artifacts)
    rollouts: int
    latency_ms: float
    tokens: int
    worker: str | None = None
    attempt: int = 1
    interruption_code: str | None = None
    capacity: dict[str, Any] | None = None
    reset_differences: list[str] = Field(default_factory=list)  # reset_determinism: warn
    unfinished_thinking: bool = False  # every completion ended inside <think>
    signal: bool | None = None  # dynamic sampling: the group has reward variation (None: not asked)


class ChunkResult(Record):
    """A chunk child workflow's result: its groups (one index object) and their outcomes."""

    groups: GroupSet
    outcomes: list[GroupOutcome]


class TrainInput(Record):
    run_id: str
    iteration: int | None = None  # online RL: which iteration trains (live metrics key steps by it)
    iterations_total: int | None = None  # online RL: the run's iterations (the LR schedule's horizon)
    # The LR schedule's horizon in optimizer steps, fixed from the run's plan (RunRequest.lr_horizon_steps);
    # None (runs admitted before it existed): estimated from each iteration's own step count.
    lr_horizon_steps: int | None = None
    groups: GroupSet
    training_config: TrainingConfig
    output_adapter: str
    behavior_policy: dict[str, Any]
    base_adapter: AdapterRef | None = None
    report_to: str = "none"  # experiment tracker on the gpu worker (kiln.core.telemetry.trackers)
    # True: a run whose every group is skipped completes without an adapter (else training_failed).
    allow_empty_training: bool = False
    # Online runs (kiln.core.train.continuation). init_state: the previous iteration's
    # TrainResult.final_state (the optimizer state at the end of the training that produced
    # base_adapter); keep_state: store this training's final state in TrainResult.final_state.
    init_state: StoredObject | None = None
    keep_state: bool = False
    # Stale data (kiln.core.train.staleness): staleness >= 1 when the groups were sampled by an older
    # policy than base_adapter; behavior_adapter is that policy (None with staleness >= 1: the
    # bare base model) and behavior_policy stays the identity recorded in the groups.
    behavior_adapter: AdapterRef | None = None
    staleness: int = Field(default=0, ge=0)
    # max_staleness > 1 (kiln.core.stale_pipeline): the run's bound and the adapter version that
    # sampled the groups; the trainer drops groups whose lag behind version iteration−1 exceeds it.
    max_staleness: int | None = None
    behavior_version: int | None = None


class TrainResult(ActivityResult):
    trained: bool
    skip_reason: str | None = None
    selection: dict[str, Any]  # counts and the first warnings (kiln.core.artifacts.selections)
    selection_ref: StoredObject | None = None  # the whole selection: one warning per skipped group
    adapter_files: list[AdapterFile] = Field(default_factory=list)
    adapter_sha256: str | None = None
    receipt: StoredObject | None = None
    steps: int = 0
    final_loss: float | None = None
    # Online runs: the packed optimizer state after the last step (TrainInput.keep_state only):
    # the next iteration's TrainInput.init_state.
    final_state: StoredObject | None = None
    # Curve figures: mean per-step KL to the base model over the last epoch (None when no KL was
    # computed: kl_coeff 0 or kl_estimator none); every token of the kept completions (context,
    # action, observation) and their action tokens, counted once (not per epoch).
    kl: float | None = None
    tokens: int = 0
    action_tokens: int = 0
    # How far the training moved the policy (kiln.core.train.drift): KL(π_new ‖ π_start) — in an
    # online run KL(π_k ‖ π_{k−1}) — and KL(π_new ‖ base), on its action tokens; and the step at
    # which training_config.target_kl ended it (None: all planned steps ran).
    kl_to_previous: float | None = None
    kl_to_base: float | None = None
    early_stop_step: int | None = None


class BundleSource(Record):
    """What a rollout bundle is built from (``kiln.core.stages.evaluation.make_bundle``): the run's
    stored groups, the environments they came from, the policy that sampled them and the reset plan."""

    run_id: str
    bundle: BundleSpec
    environments: list[EnvironmentRef]
    groups: GroupSet
    behavior_policy: dict[str, Any]
    reset_plan_sha256: str


class IterationInput(BundleSource):
    """Store one online-RL iteration (of a run with ``iterations`` > 1): its bundle, training and
    evaluation, as the record ``runs/<run id>/iterations/<k>.json`` publication lists."""

    iteration: int
    training: TrainResult | None = None
    evaluation: "EvaluationResult | None" = None
    staleness: int = 0


class IterationFiles(ActivityResult):
    """What was stored of an iteration: its record's digest and its rollout figures."""

    iteration: int
    record_sha256: str
    stats: dict[str, Any]


class PublishInput(BundleSource):
    kind: Literal["rollout", "train"]
    output_adapter: str | None
    training: TrainResult | None = None
    evaluation: "EvaluationResult | None" = None
    post_eval: "PostEvalResult | None" = None
    promote: bool = False
    # Online RL (iterations > 1): how many iteration records publication lists, and the digest
    # chain over them (kiln.core.artifacts.iterations) that proves it lists exactly the stored ones.
    iterations: int = 0
    iteration_chain: str | None = None


class PublishedArtifact(Record):
    name: str
    uri: str
    sha256: str
    bytes: int


class PublishResult(ActivityResult):
    manifest_uri: str
    manifest_sha256: str
    artifacts: list[PublishedArtifact]
    stats: dict[str, Any]


class SideBundleInput(BundleSource):
    """Build one evaluation side's bundle (rollouts, replay, summary) from its groups."""

    side: Literal["baseline", "candidate"]


class SideBundle(ActivityResult):
    side: str
    files: dict[str, StoredObject]
    stats: dict[str, Any]


class WorldModelInput(Record):
    groups: GroupSet
    adapter_ref: AdapterRef


class WorldModelResult(ActivityResult):
    block: dict[str, Any] | None = None


class EvaluateInput(Record):
    run_id: str
    config: EnvironmentEvalConfig
    seed_start: int
    auto_load: bool
    baseline: SideBundle
    candidate: SideBundle
    baseline_adapter: str | None
    candidate_adapter: str
    candidate_adapter_sha256: str | None
    world_model: dict[str, Any] | None = None


class EvaluationResult(ActivityResult):
    decision: str
    outcome: str
    verdict: str
    evidence: dict[str, Any]
    receipt: StoredObject
    baseline: SideBundle
    candidate: SideBundle


class PostEvalInput(Record):
    suite: str
    min_accuracy: float | None = None
    include_baseline: bool = True
    owns_promotion: bool = False
    thinking: bool = True
    candidate: AdapterRef
    baseline: AdapterRef | None = None


class PostEvalResult(ActivityResult):
    gate_outcome: str
    reason: str
    candidate_accuracy: float
    baseline_accuracy: float | None = None
    suite_sha256: str
    report: StoredObject


PublishInput.model_rebuild()
IterationInput.model_rebuild()


class TrainedPolicy(Record):
    """Where an online-RL run stands: the policy that samples next and how training continues."""

    policy: PolicyResult  # its identity (and adapter, None = the run's starting policy)
    state: StoredObject | None = None  # the optimizer state its training ended with


class PendingIteration(Record):
    """With max_staleness > 1: a later iteration's collected groups, carried across continue-as-new."""

    iteration: int
    sampler: TrainedPolicy  # the policy that sampled them
    groups: GroupSet
    progress: Progress | None = None
    refill: DynamicSamplingRecord | None = None


class RunCarry(Record):
    """What an online-RL run carries across continue-as-new (``workflows/openenv_run.py``)."""

    admission: AdmissionResult
    discovery: DiscoveryResult
    status: RunStatus  # the status so far
    start: PolicyResult
    current: TrainedPolicy
    previous: TrainedPolicy | None = None  # with max_staleness 1: the policy one update older
    next_iteration: int
    chain: str | None = None
    last_training: TrainResult | None = None
    last_groups: GroupSet | None = None
    last_sampler: PolicyResult | None = None  # the policy that sampled ``last_groups``
    pending: GroupSet | None = None  # with max_staleness 1: the next iteration's groups, collected
    pending_progress: Progress | None = None  # … and their collection's progress
    pending_refill: DynamicSamplingRecord | None = None  # … and how dynamic sampling refilled them
    baseline: SideBundle | None = None  # the evaluation baseline side, once collected
    pipeline: list[PendingIteration] = []  # max_staleness > 1: the later iterations collected so far
