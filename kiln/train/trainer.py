"""GRPO + ECHO LoRA training over collected seed groups.

Schedule: each epoch visits the kept groups in a permutation seeded by ``(config.seed, epoch)``
and cuts it into optimizer steps of ``groups_per_step`` groups (advantages are normalised within
each group); a step accumulates gradients over micro-batches of at most
``max_tokens_per_microbatch`` padded tokens (:mod:`kiln.train.step`). The schedule is a pure
function of the inputs, so a resumed run skips straight to its data cursor.

Loss of a step (token means over all action tokens of the step; ECHO per sequence):
``policy_surrogate(actions; is_level) [+ kl_coeff·k3] + λ·echo_ce(observations)``; with the k1
estimator the KL is a per-token penalty ``kl_coeff·(logp_old − logp_ref)`` subtracted from the
advantages (stop-gradient). Log-probs are scored at the sampling temperature recorded in the
behaviour identity (``behavior_policy.inference``, :mod:`kiln.policy.identity`).

Importance ratio: the old log-probs are the behaviour policy's — recorded ones with
``behavior_policy = "recorded"``, otherwise the trainer's own log-probs of each row at its first
visit (before any update on it), cached and never refreshed: the first epoch is exactly on-policy
(ratio 1, the clip inactive), later epochs are off-policy and the clip acts.

Determinism: the LoRA init is seeded with ``config.seed``, there is no dropout, data order is
seeded, and checkpoints restore weights/optimizer/RNG/cached log-probs exactly, so runs with the
same inputs and the same torch thread count produce byte-identical adapter files.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.errors import RunCancelled, TrainingFailed
from kiln.train.advantages import ADVANTAGE_EPS
from kiln.train.batches import GroupBatch, Row, build_group_batch, group_rows
from kiln.train.checkpoints import read_checkpoint_state, restore_checkpoint, save_checkpoint
from kiln.train.losses import echo_loss, sequence_logprobs
from kiln.train.model import (
    adapter_content_sha256,
    attach_lora,
    lora_delta_norms,
    load_base_model,
    model_content_sha256,
    save_adapter,
    trainable_parameters,
)
from kiln.train.optim import build_optimizer, learning_rate_at, set_learning_rate
from kiln.train.plan import Plan, plan_training
from kiln.train.receipt import build_receipt, write_receipt
from kiln.train.step import LogprobCache, train_step


@dataclass
class TrainResult:
    adapter_dir: Path
    receipt: dict
    steps: int
    # Σ action-token log-prob per completion (kept groups/completions) under the final adapter,
    # from the same code path the trainer uses: lets callers/tests verify a reloaded adapter.
    final_action_logprob_sums: list[list[float]] = field(default_factory=list)


@torch.no_grad()
def evaluate(model: Any, batches: list[GroupBatch], device: torch.device,
             temperature: float = 1.0) -> dict[str, Any]:
    """Forward-only pass: mean ECHO env CE over groups, mean action log-prob, per-row sums."""
    env_values: list[float] = []
    lp_sum = 0.0
    lp_count = 0.0
    sums: list[list[float]] = []
    for batch in batches:
        b = batch.to(device)
        logprobs = sequence_logprobs(model, b.input_ids, b.attention_mask, b.labels, temperature=temperature)
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


def _load_model(model_path: Path, config: Any, base_adapter_dir: Path | None, dev: torch.device,
                dtype: str, shared_base: Any) -> Any:
    """The LoRA-wrapped model: on the policy runtime's own base model when ``shared_base`` lends
    it (one copy per worker), else on a freshly loaded one."""
    base = shared_base.model if shared_base is not None else load_base_model(Path(model_path), dev, dtype)
    model = attach_lora(base, rank=config.lora_rank, alpha=config.lora_alpha, seed=config.seed,
                        base_adapter_dir=base_adapter_dir)
    if shared_base is not None:
        shared_base.trained = model
    if config.gradient_checkpointing:
        base = model.get_base_model()
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x name
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.train()  # transformers checkpoints only in training mode; the model has no dropout
    return model


def _runtime(device: torch.device, dtype: str) -> dict[str, Any]:
    import peft
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "device": str(device), "dtype": dtype,
            "torch_threads": torch.get_num_threads()}


@dataclass
class Loop:
    """The live training state the step loop advances (and checkpoints)."""

    model: Any
    optimizer: torch.optim.Optimizer
    named: list[tuple[str, torch.nn.Parameter]]
    rows: list[list[Row]]
    cache: LogprobCache
    history: list[dict[str, Any]]
    initial_eval: dict[str, Any]
    optimizer_info: dict[str, Any]


def _checkpoint(loop: Loop, plan: Plan, step: int, output_dir: Path,
                sink: Callable[[int, Path], None] | None) -> None:
    folder = output_dir / "checkpoints" / f"step-{step:06d}"
    if folder.exists():
        shutil.rmtree(folder)
    save_checkpoint(folder, params=loop.named, optimizer=loop.optimizer,
                    state={**plan.identity, "step": step, "history": loop.history,
                           "initial_eval": loop.initial_eval},
                    logprobs=loop.cache.tensors())
    if sink is not None:
        sink(step, folder)


def run_steps(loop: Loop, plan: Plan, config: Any, dev: torch.device, *, start_step: int,
              output_dir: Path, progress: Callable[[dict], None] | None,
              checkpoint_sink: Callable[[int, Path], None] | None,
              should_cancel: Callable[[], bool] | None) -> None:
    """Run the optimizer steps ``start_step+1 … total``; checkpoints and progress included."""
    total = len(plan.schedule)
    params = [p for _, p in loop.named]
    base_lr = loop.optimizer_info["learning_rate"]
    for step in range(start_step + 1, total + 1):
        if should_cancel is not None and should_cancel():
            raise RunCancelled(f"training cancelled before step {step} of {total}")
        epoch, group_ids = plan.schedule[step - 1]
        rows = [row for g in group_ids for row in loop.rows[g]]
        lr = learning_rate_at(step, total, base_lr, warmup_steps=config.warmup_steps, schedule=config.lr_schedule)
        set_learning_rate(loop.optimizer, lr)
        t0 = time.perf_counter()
        values = train_step(loop.model, rows, loop.optimizer, params, plan.settings, loop.cache, dev)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        tokens = values.pop("tokens")
        action_tokens = int(sum(float(r.action.sum()) for r in rows))
        group = group_ids[0] if len(group_ids) == 1 else list(group_ids)
        loop.history.append({"step": step, "epoch": epoch, "group": group, "lr": lr, **values,
                             "action_tokens": action_tokens})
        if progress is not None:
            progress({"step": step, "total_steps": total, **values, "learning_rate": float(lr),
                      "action_tokens": action_tokens, "tokens_per_s": tokens / elapsed})
        if config.checkpoint_interval and step % config.checkpoint_interval == 0:
            _checkpoint(loop, plan, step, output_dir, checkpoint_sink)


def _grpo_block(plan: Plan, config: Any, optimizer_info: dict[str, Any]) -> dict[str, Any]:
    s = plan.settings
    return {
        "advantage": "group_normalised_population_std",
        "advantage_eps": ADVANTAGE_EPS,
        "loss_aggregation": "token_mean_per_step",
        "importance": "recorded" if s.recorded else "first_visit_logprobs",
        "is_level": s.is_level,
        "clip_epsilon": s.clip_epsilon,
        "clip_eps_high": s.clip_eps_high,
        "cispo_max_weight": s.cispo_max_weight,
        "kl_estimator": s.kl_estimator if s.kl_on else "none",
        "kl_coeff": s.kl_coeff,
        "kl_application": {"k1": "advantage_penalty_stop_gradient", "k3": "loss_term"}.get(s.kl_estimator)
        if s.kl_on else None,
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
    selected: tuple[list[dict], dict[str, Any]] | None = None,
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
    base_adapter_sha = adapter_content_sha256(base_adapter_dir) if base_adapter_dir else None
    plan = plan_training(groups, config, expected_behavior_policy, base_adapter_sha, selected)
    dev = torch.device(device or "cpu")
    model = _load_model(model_path, config, base_adapter_dir, dev, dtype, shared_base)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    warning_filter = plan.echo["warning_filter"]
    rows = [group_rows(g, group_index=i, warning_filter=warning_filter, vocab_size=vocab)
            for i, g in enumerate(plan.kept)]
    if plan.settings.recorded and any(r.behavior is None for group in rows for r in group):
        raise TrainingFailed("behavior_policy 'recorded' needs logprobs on every action piece",
                             code="invalid_training_data")
    named = trainable_parameters(model)
    optimizer, optimizer_info = build_optimizer(config, [p for _, p in named])
    eval_batches = [build_group_batch(g, warning_filter=warning_filter, vocab_size=vocab) for g in plan.kept]
    loop = Loop(model=model, optimizer=optimizer, named=named, rows=rows, cache=LogprobCache(),
                history=[], initial_eval={}, optimizer_info=optimizer_info)
    start_step, resumed_from = 0, None
    if resume_from is not None:
        state = read_checkpoint_state(Path(resume_from))
        for key, value in plan.identity.items():
            if state.get(key) != value:
                raise TrainingFailed(f"checkpoint {key} differs from this training job; cannot resume",
                                     code="resume_mismatch")
        loop.cache = LogprobCache.from_tensors(
            restore_checkpoint(Path(resume_from), params=named, optimizer=optimizer))
        start_step = resumed_from = int(state["step"])
        loop.history, loop.initial_eval = list(state["history"]), state["initial_eval"]
    else:
        loop.initial_eval = evaluate(model, eval_batches, dev, plan.settings.temperature)
        loop.initial_eval.pop("action_logprob_sums")
    t_loaded = time.perf_counter()
    run_steps(loop, plan, config, dev, start_step=start_step, output_dir=output_dir, progress=progress,
              checkpoint_sink=checkpoint_sink, should_cancel=should_cancel)
    t_trained = time.perf_counter()
    return _finish(loop, plan, config, model_path=model_path, output_dir=output_dir, dev=dev, dtype=dtype,
                   eval_batches=eval_batches, adapter_name=adapter_name, base_adapter_sha=base_adapter_sha,
                   behavior=expected_behavior_policy, resumed_from=resumed_from,
                   timings=(t_start, t_loaded, t_trained))


def _finish(loop: Loop, plan: Plan, config: Any, *, model_path: Path, output_dir: Path,
            dev: torch.device, dtype: str, eval_batches: list[GroupBatch], adapter_name: str | None,
            base_adapter_sha: str | None, behavior: dict | None, resumed_from: int | None,
            timings: tuple[float, float, float]) -> TrainResult:
    """Final evaluation, adapter, receipt."""
    final_eval = evaluate(loop.model, eval_batches, dev, plan.settings.temperature)
    sums = final_eval.pop("action_logprob_sums")
    adapter_dir = output_dir / "adapter"
    if adapter_dir.exists():
        shutil.rmtree(adapter_dir)
    adapter_sha = save_adapter(loop.model, adapter_dir)
    delta_total, delta_norms = lora_delta_norms(loop.model)
    t_start, t_loaded, t_trained = timings
    echo = {**plan.echo, "initial_env_ce": loop.initial_eval["env_ce"], "final_env_ce": final_eval["env_ce"]}
    receipt = build_receipt(
        adapter_name=adapter_name,
        base_model_sha256=model_content_sha256(Path(model_path)),
        base_adapter_sha256=base_adapter_sha,
        training_data_sha256=plan.identity["training_data_sha256"],
        effective_config=plan.effective_config,
        grpo=_grpo_block(plan, config, loop.optimizer_info),
        selection=plan.selection,
        history=loop.history,
        echo=echo,
        token_counts=plan.token_counts,
        evaluation={"initial": loop.initial_eval, "final": final_eval},
        adapter_sha256=adapter_sha,
        lora_delta_norm=delta_total,
        lora_delta_norms=delta_norms,
        behavior_policy=behavior,
        runtime=_runtime(dev, dtype),
        phase_timings={"setup_s": t_loaded - t_start, "train_s": t_trained - t_loaded,
                       "save_s": time.perf_counter() - t_trained},
        resumed_from_step=resumed_from,
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    write_receipt(output_dir, receipt)
    return TrainResult(adapter_dir=adapter_dir, receipt=receipt, steps=len(plan.schedule),
                       final_action_logprob_sums=sums)
