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

from kiln import boundedjson
from kiln.canonical import compact_json, digest_json
from kiln.errors import InvalidRequest

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

    lambda_: float = Field(default=0.05, alias="lambda", ge=0.0)
    env_mask_mode: Literal["env_only", "full_obs"] = "env_only"
    warning_filter: bool = True


DEFAULT_LEARNING_RATES = {"muon": 2e-3, "adamw": 1e-5}  # R5.2: learning_rate null ⇒ these


class TrainingConfig(StrictModel):
    """GRPO + ECHO hyper-parameters. Travels inside the run request (hence in history).

    Defaults follow R5.2 (docs: README "Training"). ``learning_rate`` null means the optimizer's
    default (:data:`DEFAULT_LEARNING_RATES`). ``kl_estimator`` k1 folds ``kl_coeff·(logp_old −
    logp_ref)`` into each action token's advantage (stop-gradient, a per-token reward penalty);
    k3 adds ``kl_coeff·mean(exp(ref−logp) − (ref−logp) − 1)`` to the loss. ``is_level`` token is
    the PPO clip per token, sequence clips one length-normalised ratio per sequence, cispo weights
    ``logp`` by the stop-gradient IS ratio truncated at ``cispo_max_weight``.
    ``stale_is_max_weight`` (c) caps the behaviour importance weight ``min(π_prox/π_behaviour, c)``
    of data sampled by an older policy than training starts from (online runs with
    ``max_staleness``); on-policy training ignores it.
    """

    learning_rate: float | None = Field(default=None, gt=0.0)
    optimizer: Literal["muon", "adamw"] = "muon"
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    lora_rank: int = Field(default=16, ge=1, le=256)
    lora_alpha: float = Field(default=32.0, gt=0.0)
    clip_epsilon: float = Field(default=0.2, ge=0.0, lt=1.0)
    clip_eps_high: float | None = Field(default=None, ge=0.0)
    # GSPO (is_level sequence) clips a length-normalised sequence ratio: its own, much smaller ε.
    sequence_clip_epsilon: float = Field(default=3e-4, gt=0.0, lt=1.0)
    is_level: Literal["token", "sequence", "cispo"] = "token"
    cispo_max_weight: float = Field(default=5.0, gt=0.0)
    stale_is_max_weight: float = Field(default=2.0, gt=0.0)
    kl_coeff: float = Field(default=0.1, ge=0.0)
    kl_estimator: Literal["k1", "k3", "none"] = "k1"
    epochs: int = Field(default=4, ge=1, le=64)
    groups_per_step: int = Field(default=1, ge=1, le=4096)
    max_tokens_per_microbatch: int = Field(default=16384, ge=1)
    gradient_checkpointing: bool = False
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    # End the training at the first step whose approximate KL(π_start ‖ π) exceeds this (None: never).
    target_kl: float | None = Field(default=None, gt=0.0)
    seed: int = Field(default=0, ge=0)
    checkpoint_interval: int | None = Field(default=None, ge=1)
    behavior_policy: Literal["no_importance_correction", "recorded"] = "no_importance_correction"
    # Completions with no final action (e.g. reasoning that exhausted its budget): keep them with
    # their recorded reward, which includes protocol_error_reward for the missing action (penalty,
    # the default: training pushes back on them), keep them with reward 0, or drop them.
    on_no_output: Literal["drop", "zero_reward", "penalty"] = "penalty"
    echo: EchoConfig | None = Field(default_factory=EchoConfig)

    def resolved_learning_rate(self) -> float:
        """``learning_rate``, or the optimizer's R5.2 default when it is null."""
        if self.learning_rate is not None:
            return float(self.learning_rate)
        return DEFAULT_LEARNING_RATES[self.optimizer]


TRAINING_CONTRACT_SCHEMA = "kiln.openenv-training-contract.v1"


class GateConfig(StrictModel):
    """Promotion gate of the paired held-out evaluation (R8.1)."""

    min_mean_return: float | None = None
    min_mean_improvement: float = Field(default=0.0, ge=0.0)

    @field_validator("min_mean_return", "min_mean_improvement")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("gate thresholds must be finite")
        return value


class EnvironmentEvalConfig(StrictModel):
    """Paired held-out evaluation after training: baseline vs candidate on identical seeds."""

    groups: int = Field(default=20, ge=1, le=16384)
    group_size: int = Field(default=1, ge=1, le=256)
    seed_start: int | None = Field(default=None, ge=0, le=MAX_SEED)
    gate: GateConfig | None = None

    @model_validator(mode="after")
    def _gate_needs_groups(self) -> "EnvironmentEvalConfig":
        if self.gate is not None and self.groups < 20:
            raise ValueError("environment_eval with a gate needs groups >= 20 (paired seed groups)")
        return self


class PostEvalConfig(StrictModel):
    """A static evaluation suite run on the trained adapter (prompts with exact answers, R8.9)."""

    suite: str = Field(min_length=1, max_length=128)
    data_scope: Literal["held-out", "train-set-eval"] = "held-out"
    min_accuracy: float | None = Field(default=None, ge=0.0, le=1.0)
    include_baseline: bool = True

    @model_validator(mode="after")
    def _scope(self) -> "PostEvalConfig":
        if self.min_accuracy is not None and self.data_scope == "train-set-eval":
            raise ValueError("post_eval.min_accuracy is not allowed with data_scope 'train-set-eval'")
        return self


class TrainingContract(StrictModel):
    """The sealed training contract (preflight): a run executes from it, never re-deriving defaults."""

    schema_: Literal["kiln.openenv-training-contract.v1"] = Field(
        default=TRAINING_CONTRACT_SCHEMA, alias="schema"
    )
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

    group_size: int = Field(default=4, ge=1, le=256)
    max_steps: int = Field(default=8, ge=1, le=256)
    concurrency: int = Field(default=4, ge=1, le=256)
    # Room for a reasoning model's thinking and answer (the tiny demo model stops after ~20).
    max_action_tokens: int = Field(default=1024, ge=1, le=16384)
    thinking: bool = True
    constrained_actions: bool = False
    thinking_budget_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    protocol_error_reward: float = -1.0
    max_recoverable_errors: int = Field(default=3, ge=0, le=64)
    capacity_wait_seconds: int = Field(default=300, ge=1, le=3600)
    # "warn": a group whose candidates saw different resets is collected anyway (recorded).
    reset_determinism: Literal["strict", "warn"] = "strict"

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

    kind: Literal["rollout", "train"] = "rollout"
    # A model served under KILN_MODELS_DIR (its folder name); None = the workers' default model.
    model: str | None = None
    # "auto" = thinking exactly when the model's chat template supports it (resolved by the gpu
    # worker with the policy; the resolved bool is what collection uses and bundles record).
    thinking: bool | Literal["auto"] = "auto"
    idempotency_key: str | None = None
    environment_urls: list[str] = Field(alias="environments", min_length=1, max_length=64)
    credential_ids: list[str | None] = Field(default_factory=list)
    adapter: str | None = "base"
    output_adapter: str | None = None
    groups: int = Field(default=8, ge=1, le=16384)
    seed_start: int = Field(default=0, ge=0, le=MAX_SEED)
    reset_options: dict[str, Any] = Field(default_factory=dict)
    environment_reset_options: list[dict[str, Any]] = Field(default_factory=list)
    # A train run whose every group is skipped ends failed (training_failed, zero_groups) unless true.
    allow_empty_training: bool = False
    training_config: TrainingConfig | None = None
    training_contract: TrainingContract | None = None
    auto_load: bool = True
    environment_eval: EnvironmentEvalConfig | None = None
    post_eval: PostEvalConfig | None = None
    on_interrupt: Literal["resume", "fail"] = "resume"
    # Experiment tracker the gpu worker logs training to (as TRL's report_to); offline only.
    report_to: Literal["none", "tensorboard", "trackio", "wandb"] = "none"
    # Online RL (train runs): collect→train ``iterations`` times, each iteration sampling fresh
    # seeds with the previous iteration's adapter (kiln.run_plan.iteration_slots; docs/online-rl.md).
    iterations: int = Field(default=1, ge=1, le=MAX_ITERATIONS)
    # Paired held-out evaluation after every ``eval_every``-th iteration (the last one always).
    eval_every: int | None = Field(default=None, ge=1, le=MAX_ITERATIONS)
    # 1: iteration k+1 collects with adapter k−1 while iteration k trains (truncated IS corrects).
    max_staleness: Literal[0, 1] = 0

    @field_validator("idempotency_key")
    @classmethod
    def _idempotency(cls, value: str | None) -> str | None:
        if value is not None and not _IDEMPOTENCY_RE.match(value):
            raise ValueError(
                "idempotency_key must be 1-128 characters from A-Z a-z 0-9 . _ : -"
            )
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
                raise ValueError(
                    f"credential_ids[{index}] must match [A-Za-z0-9_-]{{1,64}} or be null"
                )
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
            raise ValueError(
                "reset_options and environment_reset_options are mutually exclusive: give one"
            )
        if self.environment_reset_options and len(self.environment_reset_options) != urls:
            raise ValueError(
                "environment_reset_options must have one object per environment URL"
            )
        if self.thinking_budget_tokens is not None:
            if self.thinking is False:
                raise ValueError("thinking_budget_tokens requires thinking=true (or auto)")
            if self.thinking_budget_tokens >= self.max_action_tokens:
                raise ValueError("thinking_budget_tokens must be < max_action_tokens")
        if self.kind == "train":
            if not self.output_adapter:
                raise ValueError("kind 'train' requires output_adapter (the adapter to produce)")
            if self.group_size < 2:
                raise ValueError(
                    "group_size must be >= 2 for training: GRPO needs several candidates per seed"
                )
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
                    raise ValueError(
                        "training_contract.effective_config differs from training_config"
                    )
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
        """Held-out seeds start right after every iteration's training seeds unless given (R8.1)."""
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

    def behavior_adapter(self) -> str | None:
        return normalize_adapter(self.adapter)

    def reset_option_warnings(self) -> list[str]:
        """A ``seed`` in reset options is replaced by each group's seed: say so, never silently."""
        if self.environment_reset_options:
            sources = [(f"environment_reset_options[{i}]", item) for i, item in enumerate(self.environment_reset_options)]
        else:
            sources = [("reset_options", self.reset_options)]
        return [
            f"{field}.seed was dropped: every group resets with its own seed (seed_start + group index)"
            for field, options in sources
            if "seed" in options
        ]

    def reset_templates(self) -> list[dict[str, Any]]:
        """One seed-free reset template per environment URL (R3.1)."""
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
    """SHA-256 of the canonical JSON array of reset templates, in environment order (R3.1).

    Object keys are sorted (Kiln's canonical choice), so the digest is independent of the order
    in which a caller wrote the options."""
    return digest_json(templates)


def reset_payload(template: dict[str, Any], seed: int) -> dict[str, Any]:
    """The effective reset payload: the template with the group seed inserted (R3.2)."""
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


def request_digest(request: RunRequest) -> str:
    """Digest of the typed, default-filled request (idempotency comparisons use it). Fields added
    later are left out while they hold their "off" value (``model`` unset, one iteration, no
    ``eval_every``, staleness 0), so a request that does not use them digests as before."""
    data = request.model_dump(mode="json", by_alias=False)
    for name, off in (("model", None), ("iterations", 1), ("eval_every", None), ("max_staleness", 0)):
        if data.get(name) == off:
            data.pop(name, None)
    return digest_json(data)
