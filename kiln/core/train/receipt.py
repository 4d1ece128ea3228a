"""The train receipt ``kiln.train-receipt.v1`` (Kiln's own) and its file."""

from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path
from typing import Any

from kiln.core.canonical import pretty_json
from kiln.core.train.advantages import ADVANTAGE_EPS

RECEIPT_SCHEMA = "kiln.train-receipt.v1"
RECEIPT_FILE = "train_receipt.json"


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"initial": None, "final": None, "mean": None}
    return {"initial": values[0], "final": values[-1], "mean": math.fsum(values) / len(values)}


def build_receipt(
    *,
    adapter_name: str | None,
    base_model_sha256: str,
    base_adapter_sha256: str | None,
    training_data_sha256: str,
    effective_config: dict[str, Any],
    grpo: dict[str, Any],
    selection: dict[str, Any],
    history: list[dict[str, Any]],
    echo: dict[str, Any],
    token_counts: dict[str, int],
    evaluation: dict[str, Any],
    adapter_sha256: str,
    lora_delta_norm: float | None,
    lora_delta_norms: dict[str, float],
    behavior_policy: dict[str, Any] | None,
    runtime: dict[str, Any],
    phase_timings: dict[str, float],
    resumed_from_step: int | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble the receipt dict (JSON-able; NaN-free by construction of its inputs).

    ``extra``: blocks present only when they apply (an online run's ``continued_from``,
    ``staleness``, ``final_state_sha256``), so a single-pass receipt keeps its earlier keys."""
    return {
        "schema": RECEIPT_SCHEMA,
        "status": "success",
        "failure_reason": None,
        "adapter_name": adapter_name,
        "produced_at": _dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z"),
        "base_model_sha256": base_model_sha256,
        "base_adapter_sha256": base_adapter_sha256,
        "training_data_sha256": training_data_sha256,
        "behavior_policy": behavior_policy,
        "config": effective_config,
        "grpo": grpo,
        "selection": selection,
        "steps": history,
        "policy_loss": _summary([h["policy_loss"] for h in history]),
        "loss": _summary([h["loss"] for h in history]),
        "echo": echo,
        "token_counts": token_counts,
        "evaluation": evaluation,
        "adapter_sha256": adapter_sha256,
        "lora_delta_norm": lora_delta_norm,
        "lora_delta_norms": lora_delta_norms,
        "runtime": runtime,
        "phase_timings": phase_timings,
        "resumed_from_step": resumed_from_step,
        **(extra or {}),
    }


def last_epoch_mean(history: list[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the steps of the last epoch in ``history`` (None when empty)."""
    if not history:
        return None
    last = history[-1]["epoch"]
    values = [h[key] for h in history if h["epoch"] == last]
    return math.fsum(values) / len(values)


def runtime_block(
    device: Any,
    dtype: str,
    world_size: int = 1,
    base_weight_bytes: int | None = None,
    process_memory: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The receipt's ``runtime``: library versions, device, dtype, torch threads (per rank), the
    trainer's world size (ranks, one device each; :mod:`kiln.core.train.distributed`), the bytes of
    frozen base weights resident on the rank holding the most (its FSDP2 shards; the whole model
    on one rank) and the process memory the kernel counted (:mod:`kiln.core.train.memory`, the
    largest rank's)."""
    import peft
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "device": str(device),
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "world_size": world_size,
        "base_weight_bytes": base_weight_bytes,
        "process_memory": process_memory,
    }


def grpo_block(plan: Any, config: Any, optimizer_info: dict[str, Any]) -> dict[str, Any]:
    """The receipt's ``grpo`` block: what the objective and the schedule were."""
    s = plan.settings
    extra: dict[str, Any] = {}
    if plan.shaping.overlong != "keep":
        extra["overlong"] = {
            "mode": plan.shaping.overlong,
            "max_action_tokens": plan.shaping.max_action_tokens,
            "buffer_tokens": plan.shaping.buffer_tokens,
            "penalty": plan.shaping.penalty,
        }
    if s.entropy_coeff > 0:
        extra["entropy_coeff"] = s.entropy_coeff
    return {
        **extra,
        "advantage": {"group_std": "group_normalised_population_std", "none": "group_centred"}[
            plan.shaping.advantage_norm
        ],
        "advantage_eps": ADVANTAGE_EPS,
        "loss_aggregation": {
            "tokens": "token_mean_per_step",
            "sequences": "sequence_mean_per_step",
            "constant": "constant_per_step",
        }[s.loss_normaliser]
        if s.is_level != "sequence"
        else "sequence_mean_per_step",
        **({"loss_constant_tokens": s.loss_constant_tokens} if s.loss_normaliser == "constant" else {}),
        "importance": "recorded" if s.recorded else "pre_update_logprobs",
        "is_level": s.is_level,
        "clip_epsilon": s.clip_epsilon,
        "clip_eps_high": s.clip_eps_high,
        "cispo_max_weight": s.cispo_max_weight,
        "target_kl": s.target_kl,
        "kl_estimator": s.kl_estimator if s.kl_on else "none",
        "kl_coeff": s.kl_coeff,
        "kl_application": {"k1": "advantage_penalty_stop_gradient", "k3": "loss_term"}.get(s.kl_estimator)
        if s.kl_on
        else None,
        "kl_reference_policy": {"kind": "base_per_step"},
        "scoring_temperature": s.temperature,
        "sampling": plan.sampling,
        "optimizer": optimizer_info,
        "groups": len(plan.kept),
        "groups_per_step": config.groups_per_step,
        "max_tokens_per_microbatch": s.max_tokens_per_microbatch,
        "gradient_checkpointing": bool(config.gradient_checkpointing),
        "epochs": config.epochs,
        "total_steps": len(plan.schedule),
        "group_order": "seeded_permutation_per_epoch",
    }


def online_blocks(
    *, continued_from: dict[str, Any] | None, staleness: dict[str, Any] | None, final_state_sha256: str | None
) -> dict[str, Any]:
    """Receipt blocks of an online run's training, each only when it applies (``continued_from``:
    the continuation state used; ``staleness``: stale data's behaviour policy and IS cap;
    ``final_state_sha256``: the continuation state written), so a single-pass receipt keeps
    exactly its earlier keys."""
    blocks = {"continued_from": continued_from, "staleness": staleness, "final_state_sha256": final_state_sha256}
    return {key: value for key, value in blocks.items() if value is not None}


def write_receipt(output_dir: Path, receipt: dict[str, Any]) -> Path:
    """Write ``output_dir/train_receipt.json`` (canonical pretty JSON)."""
    path = Path(output_dir) / RECEIPT_FILE
    path.write_bytes(pretty_json(receipt))
    return path


def evaluation_of(rows: list[list[Any]], scored: dict[tuple[int, int], Any]) -> dict[str, Any]:
    """The receipt's evaluation figures from per-row log-probs already scored
    (:func:`kiln.core.train.step.score_rows`, tensors): mean ECHO env CE over groups (per group: Σ per row of its
    observation CE / its observation length, over the rows that have observations), mean action
    log-prob over all action tokens, and each row's action log-prob sum. The trainer scores every
    row once before step 1 (old log-probs and the initial figures) and once after the last step
    (the final figures and the policy's drift), so evaluation costs no pass of its own."""
    env_values: list[float] = []
    parts: list[float] = []
    count = 0.0
    sums: list[list[float]] = []
    for group in rows:
        per_row: list[float] = []
        group_ce: list[float] = []
        for row in group:
            logprobs = scored[row.key]
            if row.obs_length > 0:
                group_ce.append(-float((logprobs * row.env).sum()) / row.obs_length)
            per_row.append(float((logprobs * row.action).sum()))
            count += float(row.action.sum())
        env_values.append(math.fsum(group_ce) / max(1, len(group_ce)))
        sums.append(per_row)
        parts.extend(per_row)
    return {
        "env_ce": math.fsum(env_values) / len(env_values) if env_values else None,
        "action_logprob_mean": math.fsum(parts) / count if count else None,
        "action_logprob_sums": sums,
    }
