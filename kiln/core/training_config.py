"""The training side of a run request: GRPO + ECHO hyper-parameters, the paired evaluation and
its gate, the static post-evaluation suite, and the sealed training contract (pydantic, strict).

``kiln.core.contracts.RunRequest`` carries these as fields; their defaults live here once."""

from __future__ import annotations

import math
from typing import Any, Final, Literal

from pydantic import Field, field_validator, model_validator

from kiln.core.request_fields import MAX_SEED, StrictModel, check_free_json


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


class DynamicSamplingConfig(StrictModel):
    """DAPO dynamic sampling: refill an iteration with fresh seed groups until ``groups`` of them
    carry reward variation, at most ``max_refill_rounds`` times (verl's ``filter_groups``)."""

    max_refill_rounds: int = Field(
        default=2,
        ge=1,
        le=16,
        description="Refill rounds per iteration: each collects as many fresh seeds as groups with reward "
        "variation are missing; the seed plan reserves groups x this many extra seeds per iteration.",
    )


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
        "(online runs with max_staleness >= 1).",
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
    dynamic_sampling: DynamicSamplingConfig | None = Field(
        default=None,
        description="DAPO dynamic sampling: collect fresh seed groups until groups of them have reward "
        "variation (bounded by max_refill_rounds); null keeps today's behaviour (groups without "
        "variation are skipped and the iteration trains on fewer).",
    )
    packing: bool = Field(
        default=False,
        description="Sequence packing: train several completions in one sequence (position ids restart per "
        "completion, attention stays within it): the same loss and gradient as padded rows, less padding. "
        "Refused for models with recurrent layers (Gated DeltaNet, Mamba, short convolutions).",
    )

    adapter: Literal["lora", "full"] = Field(
        default="lora",
        description="What training updates: lora (a LoRA adapter of lora_rank/lora_alpha on the frozen base) "
        "or full (every base parameter: the output is a full model folder, config.json + model.safetensors, "
        "about 4x the model's parameter count in bytes of optimizer state and weights more memory). "
        "full is refused with kl_coeff > 0, max_staleness >= 1 and the vllm engine.",
    )

    @model_validator(mode="after")
    def _full_fits(self) -> "TrainingConfig":
        if self.adapter == "full" and self.kl_coeff > 0 and self.kl_estimator != "none":
            raise ValueError(
                "adapter full does not support the KL penalty to the base model (it would need a second "
                "frozen copy of the model): set kl_coeff to 0 or train adapter lora"
            )
        return self

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


TRAINING_CONTRACT_SCHEMA: Final = "kiln.openenv-training-contract.v1"


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
