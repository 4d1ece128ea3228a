"""Run request, episode settings and training configuration (pydantic, versioned).

``RunRequest`` is what the CLI, the REST API and ``temporal workflow start`` all submit. Every
default and bound lives here once: the CLI's options are generated from these fields, and the
collection settings (``EpisodeSettings``) are the same field definitions, shared by inheritance.

The workflow's entry takes the submission as a JSON object (so a bad one submitted with
``temporal workflow start`` still fails with ``openenv_invalid_request`` instead of a workflow
task failure); the admission activity parses it here — the one validation — and from then on
only the typed ``RunRequest`` travels.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.core import boundedjson
from kiln.core.canonical import compact_json, digest_json
from kiln.core.errors import InvalidRequest
from kiln.core.rollout import replay_ignore

MAX_SEED = 2**63 - 1
MAX_ITERATIONS = 1000
MAX_RESET_OPTIONS_BYTES = 16 * 1024 * 1024 - 1024
_ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_IDEMPOTENCY_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_CREDENTIAL_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
BASE_ADAPTER_ALIASES = {"base", "none", "null"}


def normalize_adapter(name: str | None) -> str | None:
    """``base``/``none``/``null`` (any case, trimmed) and None mean the base model → None."""
    if name is None:
        return None
    text = name.strip()
    if text.lower() in BASE_ADAPTER_ALIASES:
        return None
    return text


def check_adapter_name(name: str, field: str) -> str:
    if not _ADAPTER_NAME_RE.match(name):
        raise ValueError(
            f"{field} {name!r} is not a valid adapter name: use 1-128 characters from "
            "A-Z a-z 0-9 . _ - starting with a letter or digit"
        )
    return name


def check_model_name(name: str | None) -> str | None:
    """A served model's name is its folder name under KILN_MODELS_DIR (None = the default model)."""
    if name is not None and not _MODEL_NAME_RE.match(name):
        raise ValueError(
            f"model {name!r} is not a model name: use the folder name of a served model "
            "(1-128 characters from A-Z a-z 0-9 . _ - starting with a letter or digit)"
        )
    return name


class StrictModel(BaseModel):
    """No coercion (``true``/``"1"`` are not integers), no unknown fields, every float finite."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False)


MAX_FREE_JSON_DEPTH = 32


def check_free_json(value: Any, field: str) -> Any:
    """Bound a free-form JSON value (reset options, policy identity): depth, finite numbers, size."""
    try:
        boundedjson.check(value, max_depth=MAX_FREE_JSON_DEPTH, path=field)
    except boundedjson.JsonBoundsError as exc:
        raise ValueError(str(exc)) from None
    if len(compact_json(value)) > MAX_RESET_OPTIONS_BYTES:
        raise ValueError(f"{field} is larger than 16 MiB - 1024 bytes of canonical JSON")
    return value


class EchoConfig(StrictModel):
    """ECHO: λ·(cross-entropy on observation tokens), added to the GRPO loss. λ=0 disables."""

    lambda_: float = Field(
        default=0.05,
        alias="lambda",
        ge=0.0,
        description="ECHO weight on the observation cross-entropy (0 = off).",
    )
    env_mask_mode: Literal["env_only", "full_obs"] = Field(
        default="env_only",
        description="Which observation tokens ECHO scores: env_only (what the environment wrote) "
        "or full_obs (the whole observation turn, template included).",
    )
    warning_filter: bool = Field(default=True, description="Leave environment warning text out of the ECHO loss.")


DEFAULT_LEARNING_RATES = {"muon": 2e-3, "adamw": 3e-4}  # learning_rate null ⇒ these


class TrainingConfig(StrictModel):
    """GRPO + ECHO hyper-parameters. Travels inside the run request (hence in history).

    Defaults: README "Training". ``learning_rate`` null means the optimizer's
    default (:data:`DEFAULT_LEARNING_RATES`). ``kl_estimator`` k1 folds ``kl_coeff·(logp_old −
    logp_ref)`` into each action token's advantage (stop-gradient, a per-token reward penalty);
    k3 adds ``kl_coeff·mean(exp(ref−logp) − (ref−logp) − 1)`` to the loss. ``is_level`` token is
    the PPO clip per token, sequence clips one length-normalised ratio per sequence, cispo weights
    ``logp`` by the stop-gradient IS ratio truncated at ``cispo_max_weight``.
    ``stale_is_max_weight`` (c) caps the behaviour importance weight ``min(π_prox/π_behaviour, c)``
    of data sampled by an older policy than training starts from (online runs with
    ``max_staleness``); on-policy training ignores it.
    """

    learning_rate: float | None = Field(
        default=None, gt=0.0, description="Learning rate (default: AdamW 3e-4, Muon 2e-3)."
    )
    optimizer: Literal["muon", "adamw"] = Field(
        default="adamw", description="Optimizer of the LoRA weights: adamw or muon."
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        default="constant", description="Learning-rate schedule after warm-up: constant or cosine."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Linear warm-up, in optimizer steps.")
    lora_rank: int = Field(default=16, ge=1, le=256, description="LoRA rank (attention and MLP projections).")
    lora_alpha: float = Field(default=32.0, gt=0.0, description="LoRA alpha (the update is scaled by alpha/rank).")
    clip_epsilon: float = Field(
        default=0.2, ge=0.0, lt=1.0, description="PPO clip range of the importance ratio (1 ± epsilon)."
    )
    clip_eps_high: float | None = Field(
        default=None, ge=0.0, description="Upper clip range when it differs from clip_epsilon (clip-higher)."
    )
    sequence_clip_epsilon: float = Field(
        default=3e-4,
        gt=0.0,
        lt=1.0,
        description="GSPO (is_level sequence): the clip range of the length-normalised sequence ratio "
        "(its own, much smaller epsilon).",
    )
    is_level: Literal["token", "sequence", "cispo"] = Field(
        default="cispo",
        description="Importance sampling: token (PPO clip per token), sequence (GSPO: one "
        "length-normalised ratio and one clipped term per sequence) or cispo (log-probabilities "
        "weighted by the truncated ratio).",
    )
    cispo_max_weight: float = Field(default=5.0, gt=0.0, description="cispo: where the ratio is truncated.")
    stale_is_max_weight: float = Field(
        default=2.0,
        gt=0.0,
        description="Cap of the behaviour importance weight of data sampled by an older adapter "
        "(online runs with max_staleness 1).",
    )
    kl_coeff: float = Field(default=0.0, ge=0.0, description="KL penalty to the base policy (0 = off).")
    kl_estimator: Literal["k1", "k3", "none"] = Field(
        default="k1",
        description="k1: a per-token reward penalty; k3: a loss term; none: no KL.",
    )
    epochs: int = Field(default=4, ge=1, le=64, description="Passes over the kept groups.")
    groups_per_step: int = Field(default=1, ge=1, le=4096, description="Seed groups per optimizer step.")
    max_tokens_per_microbatch: int = Field(
        default=16384, ge=1, description="Token budget of one forward/backward micro-batch."
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass (less memory, slower)."
    )
    max_grad_norm: float = Field(default=1.0, gt=0.0, description="Gradient norm clip.")
    target_kl: float | None = Field(
        default=None,
        gt=0.0,
        description="End the training at the first step whose approximate KL(start policy || policy) "
        "exceeds this (that step's update not taken; recorded in the receipt); null: never.",
    )
    seed: int = Field(default=0, ge=0, description="Training seed (LoRA initialisation, shuffling).")
    checkpoint_interval: int | None = Field(
        default=10,
        ge=1,  # measured: docs/durability.md
        description="Checkpoint every N optimizer steps (a retried step resumes there; null = never).",
    )
    engine_is_max_weight: float = Field(
        default=2.0,
        gt=0.0,
        description="Cap of the truncated importance weight min(pi_trainer / pi_engine, cap) that corrects "
        "the gap between the sampling engine's recorded log-probabilities and the trainer's (data "
        "sampled by the vllm engine; the hf engine needs none).",
    )
    behavior_policy: Literal["no_importance_correction", "recorded"] = Field(
        default="no_importance_correction",
        description="recorded: correct for the sampling policy with the log-probabilities recorded at "
        "collection; no_importance_correction: treat the data as on-policy.",
    )
    on_no_output: Literal["drop", "zero_reward", "penalty"] = Field(
        default="penalty",
        description="Completions with no final action (e.g. reasoning that used its whole budget): "
        "penalty trains them with their recorded reward (the return plus protocol_error_reward), "
        "so training pushes back on them; zero_reward keeps them at reward 0; drop leaves them out.",
    )
    echo: EchoConfig | None = Field(default_factory=EchoConfig, description="ECHO world-model loss; null turns it off.")
    advantage_norm: Literal["group_std", "none"] = Field(
        default="group_std",
        description="group_std: (reward - group mean) / group std; none: reward - group mean only "
        "(Dr. GRPO: no division by the std).",
    )
    loss_normaliser: Literal["tokens", "sequences", "constant"] = Field(
        default="tokens",
        description="What the policy term of a step is divided by: tokens (its action tokens), sequences "
        "(each completion's token mean, averaged over completions: the original GRPO) or constant "
        "(completions x max_action_tokens, whatever the lengths: Dr. GRPO). Not with is_level sequence.",
    )
    overlong: Literal["keep", "mask", "soft_penalty"] = Field(
        default="keep",
        description="Completions with an action that reached max_action_tokens: keep trains them as "
        "they are; mask leaves their action tokens out of the policy loss; soft_penalty lowers their "
        "reward by up to overlong_penalty (DAPO), linearly over the last overlong_buffer_tokens.",
    )
    overlong_buffer_tokens: int = Field(
        default=0,
        ge=0,
        description="soft_penalty: the ramp's length before max_action_tokens (0: only actions that reached it).",
    )
    overlong_penalty: float = Field(default=1.0, gt=0.0, description="soft_penalty: the largest reward penalty.")
    entropy_coeff: float = Field(
        default=0.0,
        ge=0.0,
        description="Entropy bonus: subtract this times the mean policy entropy over action tokens from the loss (0 = off).",
    )

    @model_validator(mode="after")
    def _normaliser_fits_the_objective(self) -> "TrainingConfig":
        if self.is_level == "sequence" and self.loss_normaliser != "tokens":
            raise ValueError(
                "loss_normaliser applies to is_level token and cispo; GSPO (is_level sequence) "
                "averages over sequences already: leave loss_normaliser at tokens"
            )
        return self

    def resolved_learning_rate(self) -> float:
        """``learning_rate``, or the optimizer's default when it is null."""
        if self.learning_rate is not None:
            return float(self.learning_rate)
        return DEFAULT_LEARNING_RATES[self.optimizer]


TRAINING_CONTRACT_SCHEMA = "kiln.openenv-training-contract.v1"


class GateConfig(StrictModel):
    """Promotion gate of the paired held-out evaluation."""

    min_mean_return: float | None = Field(
        default=None, description="Gate: minimum candidate mean return (none = no floor)."
    )
    min_mean_improvement: float = Field(
        default=0.0, ge=0.0, description="Gate: minimum candidate - baseline mean return."
    )

    @field_validator("min_mean_return", "min_mean_improvement")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("gate thresholds must be finite")
        return value


class EnvironmentEvalConfig(StrictModel):
    """Paired held-out evaluation after training: baseline vs candidate on identical seeds."""

    groups: int = Field(default=20, ge=1, le=16384, description="Held-out seed groups (at least 20 with a gate).")
    group_size: int = Field(default=1, ge=1, le=256, description="Episodes per held-out seed group.")
    seed_start: int | None = Field(
        default=None, ge=0, le=MAX_SEED, description="First held-out seed (default: after the training seeds)."
    )
    gate: GateConfig | None = Field(
        default=None, description="Promote only when the paired sign test passes (none = always promote)."
    )

    @model_validator(mode="after")
    def _gate_needs_groups(self) -> "EnvironmentEvalConfig":
        if self.gate is not None and self.groups < 20:
            raise ValueError("environment_eval with a gate needs groups >= 20 (paired seed groups)")
        return self


class PostEvalConfig(StrictModel):
    """A static evaluation suite run on the trained adapter (prompts with exact answers)."""

    suite: str = Field(min_length=1, max_length=128, description="Installed static suite to score the adapter on.")
    data_scope: Literal["held-out", "train-set-eval"] = Field(
        default="held-out", description="held-out, or train-set-eval (reported only, never gates)."
    )
    min_accuracy: float | None = Field(
        default=None, ge=0.0, le=1.0, description="Promote only at or above this suite accuracy."
    )
    include_baseline: bool = Field(default=True, description="Score the base model on the suite too.")

    @model_validator(mode="after")
    def _scope(self) -> "PostEvalConfig":
        if self.min_accuracy is not None and self.data_scope == "train-set-eval":
            raise ValueError("post_eval.min_accuracy is not allowed with data_scope 'train-set-eval'")
        return self


class TrainingContract(StrictModel):
    """The sealed training contract (preflight): a run executes from it, never re-deriving defaults."""

    schema_: Literal["kiln.openenv-training-contract.v1"] = Field(default=TRAINING_CONTRACT_SCHEMA, alias="schema")
    effective_config: TrainingConfig
    behavior_policy: dict[str, Any]
    output_adapter: str
    base_adapter: str | None = None

    @field_validator("behavior_policy")
    @classmethod
    def _bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_free_json(value, "training_contract.behavior_policy")


class EpisodeFields(StrictModel):
    """The collection bounds every candidate of a run shares (defined once, inherited twice)."""

    group_size: int = Field(default=4, ge=1, le=256, description="Candidates per seed group (at least 2 for training).")
    max_steps: int = Field(default=8, ge=1, le=256, description="Environment steps per episode.")
    concurrency: int = Field(default=4, ge=1, le=256, description="Concurrent sessions per group.")
    # Room for a reasoning model's thinking and answer (the tiny demo model stops after ~20).
    max_action_tokens: int = Field(
        default=1024, ge=1, le=16384, description="Token limit of one action, reasoning included."
    )
    thinking: bool = Field(default=True, description="Reason in <think> before each action.")
    constrained_actions: bool = Field(
        default=False,
        description="Decode the final answer under a grammar compiled from the action schema (reasoning stays free).",
    )
    thinking_budget_tokens: int | None = Field(
        default=None, ge=1, description="Bound on reasoning tokens (below max_action_tokens)."
    )
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature.")
    protocol_error_reward: float = Field(
        default=-1.0, description="Reward of an episode the policy ended with an invalid action."
    )
    max_recoverable_errors: int = Field(
        default=3,
        ge=0,
        le=64,
        description="Invalid actions an episode may recover from (the environment's error is shown "
        "to the policy) before it ends.",
    )
    capacity_wait_seconds: int = Field(
        default=300,
        ge=1,
        le=3600,
        description="How long a group waits for an environment's session capacity before it fails.",
    )
    reset_determinism: Literal["strict", "warn"] = Field(
        default="strict",
        description="strict: a group whose candidates saw different resets fails; warn: it is "
        "collected anyway and the difference recorded.",
    )
    context_policy: Literal["end", "end_penalised", "window"] = Field(
        default="end",
        description="At the model's context (a prompt with no room for max_action_tokens): end the "
        "episode with CONTEXT_EXHAUSTED and leave it out of training (end), end it and train on it "
        "with protocol_error_reward added (end_penalised), or drop its oldest turns from the "
        "policy's view and go on, training only on what the policy saw after the last drop (window).",
    )
    replay_ignore: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Step and state fields live replay must not compare: dotted paths as a replay "
        "drift names them (result.observation.X.Y or final_state.X); recorded in the rollout summary.",
    )

    @field_validator("replay_ignore")
    @classmethod
    def _replay_paths(cls, value: list[str]) -> list[str]:
        return replay_ignore.check_paths(value)

    @field_validator("temperature", "protocol_error_reward")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class EpisodeSettings(EpisodeFields):
    """What one seed group's collection needs: the episode fields of a request, nothing else."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def from_request(cls, request: "RunRequest", *, thinking: bool) -> "EpisodeSettings":
        values = {name: getattr(request, name) for name in EpisodeFields.model_fields}
        return cls.model_validate({**values, "thinking": thinking})

    def for_group_size(self, group_size: int) -> "EpisodeSettings":
        """The same settings for groups of ``group_size`` (never more concurrent than a group)."""
        return self.model_copy(update={"group_size": group_size, "concurrency": min(self.concurrency, group_size)})


class RunRequest(EpisodeFields):
    """One OpenEnv run: collection (``rollout``) or collection + training (``train``)."""

    kind: Literal["rollout", "train"] = Field(
        default="rollout", description="rollout: collect episodes; train: collect, then train an adapter."
    )
    model: str | None = Field(
        default=None,
        description="A model the workers serve (a KILN_MODELS_DIR folder name); default: the workers' default model.",
    )
    # "auto" is resolved by the gpu worker with the policy; the resolved bool is what collection
    # uses and bundles record.
    thinking: bool | Literal["auto"] = Field(
        default="auto",
        description="Reason in <think> first: auto (when the model's chat template supports it), true or false.",
    )
    idempotency_key: str | None = Field(
        default=None,
        description="Retry-safe submission key: the same key and body answer the existing run (200).",
    )
    environment_urls: list[str] = Field(
        alias="environments",
        min_length=1,
        max_length=64,
        description="Environment base URLs (more than one: a portfolio, groups spread over them).",
    )
    credential_ids: list[str | None] = Field(
        default_factory=list,
        description="Credential id per environment (null = public); ids are configured on the "
        "workers in KILN_CREDENTIALS.",
    )
    adapter: str | None = Field(default="base", description="Behaviour policy adapter (base = the base model).")
    output_adapter: str | None = Field(default=None, description="Name of the adapter a train run produces.")
    groups: int = Field(default=8, ge=1, le=16384, description="Seed groups to collect.")
    seed_start: int = Field(
        default=0, ge=0, le=MAX_SEED, description="Seed of the first group; group g uses seed_start+g."
    )
    reset_options: dict[str, Any] = Field(default_factory=dict, description="Reset options sent to every environment.")
    environment_reset_options: list[dict[str, Any]] = Field(
        default_factory=list, description="Reset options per environment, in the order of environment_urls."
    )
    allow_empty_training: bool = Field(
        default=False,
        description="A train run whose every group is skipped completes untrained instead of failing "
        "(training_failed, zero_groups).",
    )
    training_config: TrainingConfig | None = Field(
        default=None, description="GRPO + ECHO hyper-parameters (train runs); defaults are filled in."
    )
    training_contract: TrainingContract | None = Field(
        default=None, description="A sealed contract from POST /v1/openenv/training/preflight."
    )
    auto_load: bool = Field(default=True, description="Promote the adapter name when the gates allow it.")
    environment_eval: EnvironmentEvalConfig | None = Field(
        default=None, description="Paired held-out evaluation after training, optionally gating promotion."
    )
    post_eval: PostEvalConfig | None = Field(default=None, description="A static suite scored on the trained adapter.")
    on_interrupt: Literal["resume", "fail"] = Field(
        default="resume",
        description="A group interrupted by a worker or environment failure: re-collect it from reset "
        "with the same seed, or fail the run.",
    )
    report_to: Literal["none", "tensorboard", "trackio", "wandb"] = Field(
        default="none", description="Tracker the gpu worker logs training to (offline), as TRL's report_to."
    )
    iterations: int = Field(
        default=1,
        ge=1,
        le=MAX_ITERATIONS,
        description="Online RL: collect→train iterations, each sampling fresh seeds with the previous "
        "iteration's adapter (docs/online-rl.md).",
    )
    eval_every: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ITERATIONS,
        description="Online RL: held-out evaluation after every N-th iteration (the last one always).",
    )
    max_staleness: Literal[0, 1] = Field(
        default=0,
        description="Online RL: 1 = collect iteration k+1 with adapter k-1 while k trains (truncated "
        "importance sampling corrects); 0 = strictly on-policy.",
    )

    @field_validator("idempotency_key")
    @classmethod
    def _idempotency(cls, value: str | None) -> str | None:
        if value is not None and not _IDEMPOTENCY_RE.match(value):
            raise ValueError("idempotency_key must be 1-128 characters from A-Z a-z 0-9 . _ : -")
        return value

    @field_validator("environment_urls")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for index, url in enumerate(value):
            if not isinstance(url, str) or not url.strip():
                raise ValueError(f"environment_urls[{index}] is empty")
        return value

    @field_validator("credential_ids")
    @classmethod
    def _credentials(cls, value: list[str | None]) -> list[str | None]:
        for index, item in enumerate(value):
            if item is not None and not _CREDENTIAL_ID_RE.match(item):
                raise ValueError(f"credential_ids[{index}] must match [A-Za-z0-9_-]{{1,64}} or be null")
        return value

    @field_validator("reset_options", "environment_reset_options")
    @classmethod
    def _free_json(cls, value: Any, info: Any) -> Any:
        return check_free_json(value, info.field_name)

    @field_validator("model")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        return check_model_name(value)

    @field_validator("adapter")
    @classmethod
    def _adapter(cls, value: str | None) -> str | None:
        normalized = normalize_adapter(value)
        if normalized is None:
            return "base"
        return check_adapter_name(normalized, "adapter")

    @field_validator("output_adapter")
    @classmethod
    def _output_adapter(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return check_adapter_name(value.strip(), "output_adapter")

    @model_validator(mode="after")
    def _cross_field(self) -> "RunRequest":
        urls = len(self.environment_urls)
        if self.groups < urls:
            raise ValueError(
                f"groups ({self.groups}) must be >= the number of environment_urls ({urls}) "
                "so every environment is exercised"
            )
        if self.groups * self.group_size > 16384:
            raise ValueError("groups × group_size must be <= 16384 rollouts")
        if self.seed_start + self.groups * self.iterations - 1 > MAX_SEED:
            raise ValueError("seed_start + groups × iterations - 1 must be <= 9223372036854775807")
        if self.kind != "train" and (self.iterations != 1 or self.eval_every is not None or self.max_staleness):
            raise ValueError("iterations, eval_every and max_staleness need kind 'train'")
        if self.eval_every is not None and self.environment_eval is None:
            raise ValueError("eval_every needs environment_eval (the held-out seeds it evaluates on)")
        if self.max_staleness and self.iterations < 2:
            raise ValueError("max_staleness 1 needs iterations >= 2 (it overlaps consecutive iterations)")
        if self.credential_ids and len(self.credential_ids) != urls:
            raise ValueError("credential_ids must be empty or have one entry per environment URL")
        if self.reset_options and self.environment_reset_options:
            raise ValueError("reset_options and environment_reset_options are mutually exclusive: give one")
        if self.environment_reset_options and len(self.environment_reset_options) != urls:
            raise ValueError("environment_reset_options must have one object per environment URL")
        if self.thinking_budget_tokens is not None:
            if self.thinking is False:
                raise ValueError("thinking_budget_tokens requires thinking=true (or auto)")
            if self.thinking_budget_tokens >= self.max_action_tokens:
                raise ValueError("thinking_budget_tokens must be < max_action_tokens")
        if self.kind == "train":
            if not self.output_adapter:
                raise ValueError("kind 'train' requires output_adapter (the adapter to produce)")
            if self.group_size < 2:
                raise ValueError("group_size must be >= 2 for training: GRPO needs several candidates per seed")
            if self.output_adapter == self.adapter:
                raise ValueError("output_adapter must differ from the behavior adapter")
            contract = self.training_contract
            if contract is not None:
                if contract.output_adapter != self.output_adapter:
                    raise ValueError("training_contract.output_adapter differs from output_adapter")
                if contract.base_adapter != self.behavior_adapter():
                    raise ValueError("training_contract.base_adapter differs from adapter")
                if self.training_config is not None and canonical_differs(
                    contract.effective_config, self.training_config
                ):
                    raise ValueError("training_contract.effective_config differs from training_config")
            evaluation = self.environment_eval
            if (
                self.post_eval is not None
                and self.post_eval.min_accuracy is not None
                and evaluation is not None
                and evaluation.gate is not None
            ):
                raise ValueError(
                    "post_eval.min_accuracy and environment_eval.gate both gate promotion: "
                    "only one may own it (drop one of them)"
                )
            if evaluation is not None:
                eval_start = self.eval_seed_start()
                train_end = self.seed_start + self.groups * self.iterations
                if eval_start < train_end and self.seed_start < eval_start + evaluation.groups:
                    raise ValueError(
                        f"environment_eval seeds [{eval_start}, {eval_start + evaluation.groups}) "
                        f"overlap the training seeds [{self.seed_start}, {train_end})"
                    )
                if eval_start + evaluation.groups - 1 > MAX_SEED:
                    raise ValueError("environment_eval seed range exceeds 2^63-1")
        else:
            if (
                self.output_adapter is not None
                or self.training_config is not None
                or self.training_contract is not None
                or self.environment_eval is not None
                or self.post_eval is not None
            ):
                raise ValueError(
                    "kind 'rollout' does not take output_adapter, training_config, "
                    "training_contract, environment_eval or post_eval (use kind 'train')"
                )
        return self

    def eval_seed_start(self) -> int:
        """Held-out seeds start right after every iteration's training seeds unless given."""
        evaluation = self.environment_eval
        if evaluation is not None and evaluation.seed_start is not None:
            return evaluation.seed_start
        return self.seed_start + self.groups * self.iterations

    def episode_settings(self, thinking: bool | None = None) -> EpisodeSettings:
        """The collection settings, with ``thinking`` as resolved for the model (``None`` = the
        request's own bool; ``"auto"`` needs the resolved value). Without thinking the reasoning
        budget does not apply and is dropped."""
        resolved = self.thinking if thinking is None else thinking
        if not isinstance(resolved, bool):
            raise ValueError("thinking 'auto' must be resolved against the model first")
        settings = EpisodeSettings.from_request(self, thinking=resolved)
        if not resolved and settings.thinking_budget_tokens is not None:
            settings = settings.model_copy(update={"thinking_budget_tokens": None})
        return settings

    def effective_training_config(self) -> TrainingConfig:
        """The sealed contract's config when preflight sealed one, else the given or default one."""
        if self.training_contract is not None:
            return self.training_contract.effective_config
        return self.training_config or TrainingConfig()

    def lr_horizon_steps(self) -> int:
        """The learning-rate schedule's horizon over the whole run, fixed by its plan: iterations ×
        the optimizer steps one iteration plans (``epochs × ⌈groups / groups_per_step⌉``). An
        iteration whose groups were dropped (no reward variation) takes fewer steps; the schedule's
        curve stays the same."""
        config = self.effective_training_config()
        per_epoch = -(-self.groups // config.groups_per_step)
        return self.iterations * config.epochs * per_epoch

    def behavior_adapter(self) -> str | None:
        return normalize_adapter(self.adapter)

    def reset_option_warnings(self) -> list[str]:
        """A ``seed`` in reset options is replaced by each group's seed: say so, never silently."""
        if self.environment_reset_options:
            sources = [
                (f"environment_reset_options[{i}]", item) for i, item in enumerate(self.environment_reset_options)
            ]
        else:
            sources = [("reset_options", self.reset_options)]
        return [
            f"{field}.seed was dropped: every group resets with its own seed (seed_start + group index)"
            for field, options in sources
            if "seed" in options
        ]

    def reset_templates(self) -> list[dict[str, Any]]:
        """One seed-free reset template per environment URL."""
        urls = len(self.environment_urls)
        if self.environment_reset_options:
            templates = [dict(item) for item in self.environment_reset_options]
        else:
            templates = [dict(self.reset_options) for _ in range(urls)]
        for template in templates:
            template.pop("seed", None)
            if len(compact_json(template)) > MAX_RESET_OPTIONS_BYTES:
                raise InvalidRequest("a reset options object is larger than 16 MiB - 1024 bytes")
        return templates


def canonical_differs(first: BaseModel, second: BaseModel) -> bool:
    return digest_json(first.model_dump(mode="json", by_alias=True)) != digest_json(
        second.model_dump(mode="json", by_alias=True)
    )


def reset_plan_sha256(templates: list[dict[str, Any]]) -> str:
    """SHA-256 of the canonical JSON array of reset templates, in environment order.

    Object keys are sorted (Kiln's canonical choice), so the digest is independent of the order
    in which a caller wrote the options."""
    return digest_json(templates)


def reset_payload(template: dict[str, Any], seed: int) -> dict[str, Any]:
    """The effective reset payload: the template with the group seed inserted."""
    payload = dict(template)
    payload["seed"] = seed
    return payload


def format_validation_error(error: ValidationError) -> str:
    """Field-level, content-free message: ``field.path: reason`` per problem."""
    parts: list[str] = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item.get("loc", ())) or "request"
        msg = str(item.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def parse_run_request(data: Any) -> RunRequest:
    """Parse and validate a run request; raise ``InvalidRequest`` naming every bad field."""
    if not isinstance(data, dict):
        raise InvalidRequest("the run request must be a JSON object")
    try:
        return RunRequest.model_validate(data)
    except ValidationError as exc:
        message = format_validation_error(exc)
        about_eval = all(
            (item.get("loc") or ("",))[0] == "environment_eval"
            or str(item.get("msg", "")).removeprefix("Value error, ").startswith("environment_eval")
            for item in exc.errors()
        )
        raise InvalidRequest(
            f"invalid run request: {message}",
            hint="fix the named fields; see `kiln openenv train --help` for bounds and defaults",
            code="openenv_invalid_environment_eval" if about_eval else None,
        ) from None


# Training settings added after receipts, checkpoints and request digests existed: left out of the
# effective config (so of the config digest a checkpoint must match) and of the request digest
# while at their defaults.
LATER_SETTINGS: dict[str, Any] = {
    "advantage_norm": "group_std",
    "loss_normaliser": "tokens",
    "overlong": "keep",
    "overlong_buffer_tokens": 0,
    "overlong_penalty": 1.0,
    "entropy_coeff": 0.0,
}


def request_digest(request: RunRequest) -> str:
    """Digest of the typed, default-filled request (idempotency comparisons use it). Fields added
    later are left out while they hold their "off" value (``model`` unset, one iteration, no
    ``eval_every``, staleness 0, no ``replay_ignore``, context policy ``end``, the training settings
    of :data:`LATER_SETTINGS` at their defaults), so a request that does not use them digests as before."""
    data = request.model_dump(mode="json", by_alias=False)
    for name, off in (
        ("model", None),
        ("iterations", 1),
        ("eval_every", None),
        ("max_staleness", 0),
        ("replay_ignore", []),
        ("context_policy", "end"),
    ):
        if data.get(name) == off:
            data.pop(name, None)
    if isinstance(data.get("training_config"), dict):
        for name, off in LATER_SETTINGS.items():
            if data["training_config"].get(name) == off:
                data["training_config"].pop(name)
    return digest_json(data)
