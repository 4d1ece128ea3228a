"""Run request and episode settings (pydantic, versioned); the training side is ``kiln.core.training_config``.

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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.core.canonical import compact_json, digest_json
from kiln.core.errors import InvalidRequest
from kiln.core.request_fields import (
    ENVIRONMENT_URLS,
    CREDENTIAL_ID_RE,
    IDEMPOTENCY_RE,
    MAX_ITERATIONS,
    MAX_STALENESS,
    MAX_RESET_OPTIONS_BYTES,
    MAX_SEED,
    StrictModel,
    check_adapter_name,
    check_free_json,
    check_staleness,
    check_model_name,
    format_validation_error,
    normalize_adapter,
)
from kiln.core.rollout import replay_ignore
from kiln.core.training_config import EnvironmentEvalConfig, PostEvalConfig, TrainingConfig, TrainingContract


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
    # uses and bundles record (``episode_settings`` resolves it: a request is never read as settings).
    thinking: bool | Literal["auto"] = Field(  # type: ignore[assignment]  # the request widens the settings' bool by "auto"
        default="auto",
        description="Reason in <think> first: auto (when the model's chat template supports it), true or false.",
    )
    idempotency_key: str | None = Field(
        default=None,
        description="Retry-safe submission key: the same key and body answer the existing run (200).",
    )
    environment_urls: list[str] = Field(
        validation_alias=ENVIRONMENT_URLS,
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
    max_staleness: int = Field(
        default=0,
        ge=0,
        le=MAX_STALENESS,
        description="Online RL: how many adapter versions collection may run ahead of training "
        f"(0..{MAX_STALENESS}). N >= 1: iteration k's groups are sampled by adapter max(0, k-1-N) while "
        "earlier iterations train (truncated importance sampling corrects); 0 = strictly on-policy.",
    )

    @field_validator("idempotency_key")
    @classmethod
    def _idempotency(cls, value: str | None) -> str | None:
        if value is not None and not IDEMPOTENCY_RE.match(value):
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
            if item is not None and not CREDENTIAL_ID_RE.match(item):
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
        if self.seed_start + self.seeds_per_iteration() * self.iterations - 1 > MAX_SEED:
            raise ValueError("seed_start + groups × iterations - 1 must be <= 9223372036854775807")
        if self.seeds_per_iteration() * self.group_size > 16384:
            raise ValueError("groups × (1 + dynamic_sampling.max_refill_rounds) × group_size must be <= 16384 rollouts")
        if self.kind != "train" and (self.iterations != 1 or self.eval_every is not None or self.max_staleness):
            raise ValueError("iterations, eval_every and max_staleness need kind 'train'")
        if self.eval_every is not None and self.environment_eval is None:
            raise ValueError("eval_every needs environment_eval (the held-out seeds it evaluates on)")
        check_staleness(self.max_staleness, self.iterations, self.effective_training_config().adapter)
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
                train_end = self.seed_start + self.seeds_per_iteration() * self.iterations
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
        return self.seed_start + self.seeds_per_iteration() * self.iterations

    def seeds_per_iteration(self) -> int:
        """The training seeds one iteration reserves: ``groups``, and with dynamic sampling
        ``groups × max_refill_rounds`` more for its refill rounds (``kiln.core.run_plan``)."""
        dynamic = self.effective_training_config().dynamic_sampling
        return self.groups * (1 + (dynamic.max_refill_rounds if dynamic is not None else 0))

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
