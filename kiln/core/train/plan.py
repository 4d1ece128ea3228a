"""Training admission and plan: the on-policy check, the sampling settings, selection, step
settings and the step schedule — everything decided from the inputs before the model is loaded."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kiln.core.canonical import digest_json
from kiln.core.request_digest import LATER_SETTINGS
from kiln.core.errors import PolicyIdentityChanged, TrainingFailed
from kiln.core.policy.identity import sampling_of
from kiln.core.train.batches import RowShaping
from kiln.core.train.resume import ONLINE_IDENTITY_KEYS, settings_digest  # noqa: F401 (re-exported)
from kiln.core.train.selection import select_groups
from kiln.core.train.step import StepSettings
from kiln.core.train.tokens import count_tokens


@dataclass
class Plan:
    """Everything derived from the inputs before the model is touched."""

    kept: list[dict]
    selection: dict[str, Any]
    settings: StepSettings
    sampling: dict[str, Any] | None
    engine: str
    engine_uncorrected: str | None  # why the engine gap is not corrected (None: it is)
    echo: dict[str, Any]
    token_counts: dict[str, int]
    effective_config: dict[str, Any]
    identity: dict[str, Any]
    schedule: list[tuple[int, list[int]]] = field(default_factory=list)
    shaping: RowShaping = field(default_factory=RowShaping)


def _cap(config: Any, sampling: dict[str, Any] | None) -> int | None:
    """The sampler's ``max_action_tokens`` when a setting needs it (overlong handling, the constant
    normaliser); refused when the data's behaviour identity does not record it."""
    if config.overlong == "keep" and config.loss_normaliser != "constant":
        return None
    cap = (sampling or {}).get("max_action_tokens")
    if not cap:
        needs = f"overlong {config.overlong!r}" if config.overlong != "keep" else "loss_normaliser 'constant'"
        raise TrainingFailed(
            f"training_config {needs} needs the sampler's max_action_tokens, which this data's behaviour "
            "identity does not record",
            code="invalid_training_data",
            hint="collect the data again with this Kiln version, or leave overlong at 'keep' and "
            "loss_normaliser at 'tokens'",
        )
    return int(cap)


def epoch_order(n_groups: int, seed: int, epoch: int, iteration: int | None = None) -> list[int]:
    """The seeded permutation of group indices visited in ``epoch``; an online run's iterations
    after the first also seed it with their (1-based) ``iteration``, so iterations do not share
    one visiting order."""
    order = list(range(n_groups))
    key = f"{seed}:{epoch}" if iteration is None or iteration <= 1 else f"{seed}:{iteration}:{epoch}"
    random.Random(f"kiln.train.order:{key}").shuffle(order)
    return order


def step_schedule(
    n_groups: int, seed: int, epochs: int, groups_per_step: int, iteration: int | None = None
) -> list[tuple[int, list[int]]]:
    """``(epoch, group indices)`` of every optimizer step, in order."""
    schedule = []
    for epoch in range(epochs):
        order = epoch_order(n_groups, seed, epoch, iteration)
        for start in range(0, n_groups, groups_per_step):
            schedule.append((epoch, order[start : start + groups_per_step]))
    return schedule


def require_groups_on_policy(groups: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    """Every completion's ``openenv.behavior_policy`` must equal ``expected``."""
    for g, group in enumerate(groups, start=1):
        for c, completion in enumerate(group.get("completions") or [], start=1):
            actual = (completion.get("openenv") or {}).get("behavior_policy")
            if actual != expected:
                raise PolicyIdentityChanged(
                    f"group {g} completion {c} was sampled by a different policy than the one admitted for training",
                    stage="training",
                    details={"expected": digest_json(expected), "actual": digest_json(actual)},
                )


def _identity_of(groups: list[dict], expected: dict | None) -> dict | None:
    """The behaviour identity the corpus was drawn with: ``expected``, else its first completion's."""
    if expected is None and groups and groups[0].get("completions"):
        return (groups[0]["completions"][0].get("openenv") or {}).get("behavior_policy")
    return expected


def engine_of(identity: dict | None) -> str:
    """The sampling engine's name: an identity's ``runtime`` block records ``engine`` only for
    engines other than hf."""
    runtime = (identity or {}).get("runtime") or {}
    engine = runtime.get("engine") if isinstance(runtime, dict) else None
    return str((engine or {}).get("name") or "hf")


def engine_correction(engine: str, recorded: bool, staleness: int, sampling: dict[str, Any] | None) -> str | None:
    """Why the engine gap is not corrected (None: it is, with truncated IS weights). hf samples
    with the trainer's own kernels; ``recorded`` already takes the engine's log-probs as the old
    ones; stale data is re-scored by the trainer under the adapter that sampled it; and under
    constrained decoding the engine's log-probs are of the grammar-masked distribution, which the
    trainer does not reproduce."""
    if engine == "hf":
        return "hf_engine"
    if recorded:
        return "behavior_policy_recorded"
    if staleness > 0:
        return "stale_data_rescored"
    if sampling is not None and sampling.get("constrained_actions"):
        return "constrained_actions"
    return None


def sampling_settings(groups: list[dict], expected: dict | None, recorded: bool) -> dict[str, Any] | None:
    """The verified sampling settings the corpus was drawn with (None: an identity from before
    ``inference_config_sha256``; scored at temperature 1, unmasked)."""
    identity = _identity_of(groups, expected)
    try:
        sampling = sampling_of(identity)
    except ValueError as exc:
        raise PolicyIdentityChanged(str(exc), stage="training") from None
    if recorded and sampling is not None and sampling["constrained_actions"]:
        raise TrainingFailed(
            "behavior_policy 'recorded' cannot be used on actions sampled with constrained decoding: "
            "the recorded log-probs are of the grammar-masked distribution, which the trainer does "
            "not reproduce",
            code="training_recorded_constrained",
            hint="train with training_config.behavior_policy 'no_importance_correction', or collect "
            "without constrained_actions",
        )
    return sampling


def _echo_block(config: Any, token_counts: dict[str, int]) -> dict[str, Any]:
    echo = config.echo
    on, lam = (False, 0.0) if echo is None else (echo.lambda_ > 0, float(echo.lambda_))
    block = {
        "enabled": on,
        "lambda": lam,
        "env_mask_mode": "env_only" if echo is None else echo.env_mask_mode,
        "warning_filter": True if echo is None else bool(echo.warning_filter),
    }
    if on and token_counts["env_tokens_after_warning_filter"] == 0:
        block.update(enabled=False, dropped_reason="no_environment_tokens")
    return block


def plan_training(
    groups: list[dict],
    config: Any,
    expected: dict | None,
    base_adapter_sha: str | None,
    selected: tuple[list[dict], dict[str, Any]] | None = None,
    *,
    staleness: int = 0,
    extra_identity: dict[str, Any] | None = None,
    iteration: int | None = None,
) -> Plan:
    """Admission checks, selection, settings and the step schedule (no model needed).

    ``selected``: the ``select_groups`` result when the caller already selected (it is not
    computed twice). ``staleness`` > 0 turns on the truncated behaviour importance weights;
    ``extra_identity`` (continuation state, behaviour adapter digests) joins the identity a
    checkpoint must match to be resumed. A knob that only acts on stale data
    (``stale_is_max_weight``) is left out of an on-policy training's effective config, and one that
    only acts on another engine's data (``engine_is_max_weight``) out of an hf training's, so such a
    receipt reads as before the knob existed."""
    if expected is not None:
        require_groups_on_policy(groups, expected)
    recorded = config.behavior_policy == "recorded"
    sampling = sampling_settings(groups, expected, recorded)
    kept, selection = selected if selected is not None else select_groups(groups, config.on_no_output)
    if not kept:
        raise TrainingFailed("no trainable group remains after selection", code="zero_groups")
    engine = engine_of(_identity_of(groups, expected))
    uncorrected = engine_correction(engine, recorded, staleness, sampling)
    warning_filter = True if config.echo is None else bool(config.echo.warning_filter)
    token_counts = count_tokens(
        kept,
        warning_filter=warning_filter,
        env_mask_mode="env_only" if config.echo is None else config.echo.env_mask_mode,
    )
    echo = _echo_block(config, token_counts)
    cap = _cap(config, sampling)
    shaping = RowShaping(
        advantage_norm=config.advantage_norm,
        overlong=config.overlong,
        max_action_tokens=cap,
        buffer_tokens=int(config.overlong_buffer_tokens),
        penalty=float(config.overlong_penalty),
    )
    gspo = config.is_level == "sequence"
    settings = StepSettings(
        clip_epsilon=float(config.sequence_clip_epsilon if gspo else config.clip_epsilon),
        clip_eps_high=float(config.sequence_clip_epsilon) if gspo else config.clip_eps_high,
        is_level=config.is_level,
        cispo_max_weight=float(config.cispo_max_weight),
        kl_coeff=float(config.kl_coeff),
        kl_estimator=config.kl_estimator,
        echo_lambda=echo["lambda"] if echo["enabled"] else 0.0,
        max_grad_norm=float(config.max_grad_norm),
        recorded=recorded,
        temperature=float(sampling["temperature"]) if sampling else 1.0,
        max_tokens_per_microbatch=int(config.max_tokens_per_microbatch),
        stale_is_max_weight=float(config.stale_is_max_weight) if staleness > 0 else None,
        target_kl=float(config.target_kl) if config.target_kl is not None else None,
        engine_is_max_weight=float(config.engine_is_max_weight) if uncorrected is None else None,
        loss_normaliser=config.loss_normaliser,
        loss_constant_tokens=float(cap) if config.loss_normaliser == "constant" and cap is not None else None,
        entropy_coeff=float(config.entropy_coeff),
    )
    effective_config = config.model_dump(mode="json", by_alias=True)
    for key, default in LATER_SETTINGS.items():
        if effective_config.get(key) == default:
            effective_config.pop(key)
    idle = [*(["stale_is_max_weight"] if staleness == 0 else []), *(["engine_is_max_weight"] if engine == "hf" else [])]
    for key in idle:
        effective_config.pop(key, None)
    schedule = step_schedule(len(kept), config.seed, config.epochs, config.groups_per_step, iteration)
    identity = {
        "training_data_sha256": digest_json(groups),
        "settings_sha256": settings_digest(config, idle),  # kiln.core.train.resume: defaults left out
        "base_adapter_sha256": base_adapter_sha,
        "total_steps": len(schedule),
        **({"iteration": iteration} if iteration is not None and iteration > 1 else {}),
        **(extra_identity or {}),
    }
    return Plan(
        kept=kept,
        selection=selection,
        settings=settings,
        sampling=sampling,
        engine=engine,
        engine_uncorrected=uncorrected,
        echo=echo,
        token_counts=token_counts,
        effective_config=effective_config,
        identity=identity,
        schedule=schedule,
        shaping=shaping,
    )
