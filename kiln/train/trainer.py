"""GRPO + ECHO LoRA training over collected seed groups.

Schedule: one optimizer step per kept seed group per epoch (the group is the mini-batch: its
advantages are normalised within it), ``epochs × groups`` steps in all. Group order in each epoch is
a permutation seeded by ``(config.seed, epoch)``, so the schedule is a pure function of the inputs
and a resumed run can skip straight to its data cursor.

Loss per step (one forward pass, adapter enabled):
``policy_surrogate(actions) + kl_coeff·k1(actions, base) + λ·echo_ce(observations)``.

Importance ratio: with ``behavior_policy = "no_importance_correction"`` the old log-probs are the
detached current ones (each group is visited once per epoch, so "current at the start of the
epoch's pass over that group" is the same forward): the ratio is exactly 1, the clip is inactive
and the gradient is the on-policy ``A·∇logp`` — the collector proves the data is on-policy instead
(R5.5). With ``"recorded"`` the old log-probs are the behaviour log-probs the sampler recorded; the
PPO clip applies and the unclipped ratio is truncated at ``cispo_max_weight`` (5.0).

Determinism: the LoRA init is seeded with ``config.seed``, there is no dropout, data order is
seeded, and checkpoints restore weights/optimizer/RNG exactly, so runs with the same inputs and the
same torch thread count produce byte-identical adapter files.
"""

from __future__ import annotations

import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.canonical import digest_json
from kiln.errors import PolicyIdentityChanged, RunCancelled, TrainingFailed
from kiln.train.advantages import ADVANTAGE_EPS
from kiln.train.batches import GroupBatch, build_group_batch
from kiln.train.checkpoints import read_checkpoint_state, restore_checkpoint, save_checkpoint
from kiln.train.losses import CISPO_MAX_WEIGHT, echo_loss, kl_k1, policy_loss, token_logprobs
from kiln.train.model import (
    adapter_content_sha256,
    attach_lora,
    lora_delta_norms,
    load_base_model,
    model_content_sha256,
    save_adapter,
    trainable_parameters,
)
from kiln.train.receipt import build_receipt, write_receipt
from kiln.train.selection import select_groups
from kiln.train.tokens import count_tokens

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


@dataclass
class TrainResult:
    adapter_dir: Path
    receipt: dict
    steps: int
    # Σ action-token log-prob per completion (kept groups/completions) under the final adapter,
    # from the same code path the trainer uses: lets callers/tests verify a reloaded adapter.
    final_action_logprob_sums: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class StepSettings:
    """What one optimizer step needs from the config."""

    clip_epsilon: float
    kl_coeff: float
    echo_lambda: float  # 0 disables the ECHO term
    max_grad_norm: float
    recorded: bool


def _echo_settings(config: Any) -> tuple[bool, float, str, bool]:
    echo = config.echo
    if echo is None:
        return False, 0.0, "env_only", True
    return echo.lambda_ > 0, float(echo.lambda_), echo.env_mask_mode, bool(echo.warning_filter)


def _forward_logprobs(model: Any, batch: GroupBatch) -> torch.Tensor:
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return token_logprobs(out.logits, batch.labels)


def train_step(
    model: Any,
    batch: GroupBatch,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    settings: StepSettings,
) -> dict[str, float]:
    """One optimizer step on one group batch; returns the step's scalar diagnostics."""
    optimizer.zero_grad(set_to_none=True)
    logprobs = _forward_logprobs(model, batch)
    if settings.recorded:
        old = batch.behavior_logprobs
    else:
        old = logprobs.detach()
    p_loss, stats = policy_loss(
        logprobs, old, batch.advantages, batch.action_mask, clip_epsilon=settings.clip_epsilon
    )
    total = p_loss
    kl_value = 0.0
    if settings.kl_coeff > 0:
        with torch.no_grad(), model.disable_adapter():
            ref = _forward_logprobs(model, batch)
        kl = kl_k1(logprobs, ref, batch.action_mask)
        total = total + settings.kl_coeff * kl
        kl_value = float(kl.detach().item())
    if settings.echo_lambda > 0:
        env = echo_loss(logprobs, batch.env_mask, batch.obs_lengths)
        total = total + settings.echo_lambda * env
    else:
        with torch.no_grad():
            env = echo_loss(logprobs, batch.env_mask, batch.obs_lengths)
    total.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
    optimizer.step()
    values = {
        "loss": float(total.detach().item()),
        "policy_loss": float(p_loss.detach().item()),
        "env_ce": float(env.detach().item()),
        "kl": kl_value,
        "grad_norm": float(grad_norm.item()),
        "clip_fraction": stats["clip_fraction"],
    }
    for key, value in values.items():
        if not math.isfinite(value):
            raise TrainingFailed(f"non-finite {key} ({value})", code="non_finite_loss")
    return values


@torch.no_grad()
def evaluate(model: Any, batches: list[GroupBatch], device: torch.device) -> dict[str, Any]:
    """Forward-only pass: mean ECHO env CE over groups, mean action log-prob, per-row sums."""
    env_values: list[float] = []
    lp_sum = 0.0
    lp_count = 0.0
    sums: list[list[float]] = []
    for batch in batches:
        b = batch.to(device)
        logprobs = _forward_logprobs(model, b)
        env_values.append(float(echo_loss(logprobs, b.env_mask, b.obs_lengths).item()))
        per_row = (logprobs * b.action_mask).sum(dim=-1)
        sums.append([float(x) for x in per_row.tolist()])
        lp_sum += float(per_row.sum().item())
        lp_count += float(b.action_mask.sum().item())
    return {
        "env_ce": math.fsum(env_values) / len(env_values) if env_values else None,
        "action_logprob_mean": lp_sum / lp_count if lp_count else None,
        "action_logprob_sums": sums,
    }


def epoch_order(n_groups: int, seed: int, epoch: int) -> list[int]:
    """The seeded permutation of group indices visited in ``epoch``."""
    order = list(range(n_groups))
    random.Random(f"kiln.train.order:{seed}:{epoch}").shuffle(order)
    return order


def require_groups_on_policy(groups: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    """Every completion's ``openenv.behavior_policy`` must equal ``expected`` (R5.5)."""
    for g, group in enumerate(groups, start=1):
        for c, completion in enumerate(group.get("completions") or [], start=1):
            actual = (completion.get("openenv") or {}).get("behavior_policy")
            if actual != expected:
                raise PolicyIdentityChanged(
                    f"group {g} completion {c} was sampled by a different policy than the one "
                    "admitted for training",
                    stage="training",
                    details={"expected": digest_json(expected), "actual": digest_json(actual)},
                )


def _runtime(device: torch.device, dtype: str) -> dict[str, Any]:
    import peft
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "device": str(device),
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
    }


def train_grpo(
    *,
    model_path: Path,
    groups: list[dict],
    config: Any,
    output_dir: Path,
    base_adapter_dir: Path | None = None,
    expected_behavior_policy: dict | None = None,
    progress: Callable[[dict], None] | None = None,
    resume_from: Path | None = None,
    checkpoint_sink: Callable[[int, Path], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    adapter_name: str | None = None,
    device: str | None = None,
    dtype: str = "float32",
    shared_base: Any = None,
) -> TrainResult:
    """Train a LoRA adapter with GRPO (+ ECHO) on ``groups``; see the module docstring.

    Writes ``output_dir/adapter/`` (standard PEFT adapter), ``output_dir/train_receipt.json`` and,
    with ``config.checkpoint_interval``, ``output_dir/checkpoints/step-NNNNNN/`` folders.
    ``shared_base`` (a :meth:`kiln.policy.runtime.PolicyRuntime.training_lease`) trains on the
    policy runtime's base model instead of loading a second copy; ``device``/``dtype`` must then
    be the runtime's.
    """
    t_start = time.perf_counter()
    output_dir = Path(output_dir)
    if expected_behavior_policy is not None:
        require_groups_on_policy(groups, expected_behavior_policy)
    kept, selection = select_groups(groups, config.on_no_output)
    if not kept:
        raise TrainingFailed("no trainable group remains after selection", code="zero_groups")
    echo_on, echo_lambda, env_mask_mode, warning_filter = _echo_settings(config)
    token_counts = count_tokens(kept, warning_filter=warning_filter)
    dropped_reason = None
    if echo_on and token_counts["env_tokens_after_warning_filter"] == 0:
        echo_on, dropped_reason = False, "no_environment_tokens"
    settings = StepSettings(
        clip_epsilon=float(config.clip_epsilon),
        kl_coeff=float(config.kl_coeff),
        echo_lambda=echo_lambda if echo_on else 0.0,
        max_grad_norm=float(config.max_grad_norm),
        recorded=config.behavior_policy == "recorded",
    )
    effective_config = config.model_dump(mode="json", by_alias=True)
    data_sha = digest_json(groups)
    config_sha = digest_json(effective_config)
    base_adapter_sha = adapter_content_sha256(base_adapter_dir) if base_adapter_dir else None

    dev = torch.device(device or "cpu")
    base = shared_base.model if shared_base is not None else load_base_model(Path(model_path), dev, dtype)
    model = attach_lora(
        base,
        rank=config.lora_rank,
        alpha=config.lora_alpha,
        seed=config.seed,
        base_adapter_dir=base_adapter_dir,
    )
    if shared_base is not None:
        shared_base.trained = model
    vocab = int(model.get_input_embeddings().weight.shape[0])
    batches = [build_group_batch(g, warning_filter=warning_filter, vocab_size=vocab) for g in kept]
    if settings.recorded and any(b.behavior_logprobs is None for b in batches):
        raise TrainingFailed(
            "behavior_policy 'recorded' needs logprobs on every action piece",
            code="invalid_training_data",
        )
    named = trainable_parameters(model)
    params = [p for _, p in named]
    optimizer = torch.optim.AdamW(
        params, lr=config.learning_rate, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0
    )
    schedule = [
        (epoch, index)
        for epoch in range(config.epochs)
        for index in epoch_order(len(batches), config.seed, epoch)
    ]
    total_steps = len(schedule)
    identity = {
        "training_data_sha256": data_sha,
        "config_sha256": config_sha,
        "base_adapter_sha256": base_adapter_sha,
        "total_steps": total_steps,
    }

    history: list[dict[str, Any]] = []
    start_step = 0
    resumed_from = None
    if resume_from is not None:
        state = read_checkpoint_state(Path(resume_from))
        for key, value in identity.items():
            if state.get(key) != value:
                raise TrainingFailed(
                    f"checkpoint {key} differs from this training job; cannot resume",
                    code="resume_mismatch",
                )
        restore_checkpoint(Path(resume_from), params=named, optimizer=optimizer)
        start_step = int(state["step"])
        history = list(state["history"])
        initial_eval = state["initial_eval"]
        resumed_from = start_step
    else:
        initial_eval = evaluate(model, batches, dev)
        initial_eval.pop("action_logprob_sums")
    t_loaded = time.perf_counter()

    for step in range(start_step + 1, total_steps + 1):
        if should_cancel is not None and should_cancel():
            raise RunCancelled(f"training cancelled before step {step} of {total_steps}")
        epoch, index = schedule[step - 1]
        batch = batches[index].to(dev)
        t0 = time.perf_counter()
        values = train_step(model, batch, optimizer, params, settings)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        record = {"step": step, "epoch": epoch, "group": index, **values,
                  "action_tokens": batch.action_tokens}
        history.append(record)
        if progress is not None:
            progress({
                "step": step,
                "total_steps": total_steps,
                **values,
                "learning_rate": float(optimizer.param_groups[0]["lr"]),
                "action_tokens": batch.action_tokens,
                "tokens_per_s": batch.tokens / elapsed,
            })
        interval = config.checkpoint_interval
        if interval and step % interval == 0:
            folder = output_dir / "checkpoints" / f"step-{step:06d}"
            if folder.exists():
                shutil.rmtree(folder)
            save_checkpoint(
                folder,
                params=named,
                optimizer=optimizer,
                state={**identity, "step": step, "history": history, "initial_eval": initial_eval},
            )
            if checkpoint_sink is not None:
                checkpoint_sink(step, folder)
    t_trained = time.perf_counter()

    final_eval = evaluate(model, batches, dev)
    sums = final_eval.pop("action_logprob_sums")
    adapter_dir = output_dir / "adapter"
    if adapter_dir.exists():
        shutil.rmtree(adapter_dir)
    adapter_sha = save_adapter(model, adapter_dir)
    delta_total, delta_norms = lora_delta_norms(model)
    t_saved = time.perf_counter()

    receipt = build_receipt(
        adapter_name=adapter_name,
        base_model_sha256=model_content_sha256(Path(model_path)),
        base_adapter_sha256=base_adapter_sha,
        training_data_sha256=data_sha,
        effective_config=effective_config,
        grpo={
            "advantage": "group_normalised_population_std",
            "advantage_eps": ADVANTAGE_EPS,
            "loss_aggregation": "token_mean",
            "importance": "recorded_truncated" if settings.recorded else "none_ratio_one",
            "cispo_max_weight": CISPO_MAX_WEIGHT,
            "kl_estimator": "k1",
            "kl_reference_policy": {"kind": "base_per_step"},
            "optimizer": {"name": "adamw", "betas": list(ADAM_BETAS), "eps": ADAM_EPS,
                          "weight_decay": 0.0},
            "groups": len(batches),
            "epochs": config.epochs,
            "total_steps": total_steps,
            "group_order": "seeded_permutation_per_epoch",
        },
        selection=selection,
        history=history,
        echo={
            "enabled": echo_on,
            "lambda": echo_lambda,
            "env_mask_mode": env_mask_mode,
            "warning_filter": warning_filter,
            "initial_env_ce": initial_eval["env_ce"],
            "final_env_ce": final_eval["env_ce"],
            **({"dropped_reason": dropped_reason} if dropped_reason else {}),
        },
        token_counts=token_counts,
        evaluation={"initial": initial_eval, "final": final_eval},
        adapter_sha256=adapter_sha,
        lora_delta_norm=delta_total,
        lora_delta_norms=delta_norms,
        behavior_policy=expected_behavior_policy,
        runtime=_runtime(dev, dtype),
        phase_timings={
            "setup_s": t_loaded - t_start,
            "train_s": t_trained - t_loaded,
            "save_s": t_saved - t_trained,
        },
        resumed_from_step=resumed_from,
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    write_receipt(output_dir, receipt)
    return TrainResult(adapter_dir=adapter_dir, receipt=receipt, steps=total_steps,
                       final_action_logprob_sums=sums)
