"""GRPO + ECHO LoRA training over collected seed groups.

Schedule: each epoch visits the kept groups in a permutation seeded by ``(config.seed, epoch)``
and cuts it into optimizer steps of ``groups_per_step`` groups (advantages are normalised within
each group); a step accumulates gradients over micro-batches of at most
``max_tokens_per_microbatch`` padded tokens (:mod:`kiln.core.train.step`). The schedule is a pure
function of the inputs, so a resumed run skips straight to its data cursor.

Loss of a step (token means over all action tokens of the step; ECHO per sequence):
``policy_surrogate(actions; is_level) [+ kl_coeff·k3] + λ·echo_ce(observations)``; with the k1
estimator the KL is a per-token penalty ``kl_coeff·(logp_old − logp_ref)`` subtracted from the
advantages (stop-gradient). Log-probs are scored at the sampling temperature recorded in the
behaviour identity (``behavior_policy.inference``, :mod:`kiln.core.policy.identity`).

Importance ratio: the old log-probs are the behaviour policy's — recorded ones with
``behavior_policy = "recorded"``, otherwise the trainer's own log-probs of every row under the
policy training starts from, scored in one no-grad pass before step 1 and never refreshed (kept in
checkpoints, so a resumed training reuses them). Only step 1 is exactly on-policy (ratio 1); from
step 2 on, the ratio measures how far the updates so far moved the policy on that row, and the clip
(or CISPO's truncation) acts on it — also in epoch 1.

Online runs (many collect→train iterations): a training can hand its optimizer state to the next
(``keep_state`` → ``final_state.tar``; the next one's ``init_state``), whose LoRA weights come from
this training's adapter (``base_adapter_dir``). At that boundary Adam's first moment (Muon's
momentum buffer) is zeroed — it points along the previous iteration's last steps, on data the new
iteration does not train on — while the second moment and the step counters continue, and the
learning-rate schedule continues over the run's global step (warm-up once)
(:mod:`kiln.core.train.continuation`). A retried attempt resumes from its own checkpoint, never from
``init_state``. Stale data (``staleness`` ≥ 1: sampled by ``behavior_adapter_dir``, an older
policy than the one training starts from) keeps the pre-update log-probs as the proximal policy
and weights each action token by ``min(π_prox / π_behaviour, stale_is_max_weight)``, the behaviour
log-probs scored by the behaviour policy itself (:mod:`kiln.core.train.staleness`).

Another engine's data (the identity names an engine other than hf, e.g. vllm): each action token
is weighted by ``min(π_trainer / π_engine, engine_is_max_weight)`` on the engine's recorded
log-probs, and the receipt's ``engine_mismatch`` block records the gap (:mod:`kiln.core.train.mismatch`;
not corrected, with the reason, for ``recorded``, stale or constrained data).

Policy movement (:mod:`kiln.core.train.drift`): after the last step the receipt records the exact
(full-vocabulary) KL(π_new ‖ π_start) and KL(π_new ‖ π_base) at the training's action tokens; ``target_kl`` ends the training
at the first step whose approximate KL(π_start ‖ π) exceeds it (``early_stop`` in the receipt).

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

from kiln.core.errors import RunCancelled, TrainingFailed
from kiln.core.train.batches import Row, group_rows
from kiln.core.train.checkpoints import (
    restore_checkpoint,
    restore_optimizer_state,
    save_checkpoint,
)
from kiln.core.train.continuation import read_init_state, reset_first_moments, write_final_state
from kiln.core.train.distributed import resident_base_bytes
from kiln.core.train.drift import final_pass
from kiln.core.train.model import (
    TRAIN_ADAPTER,
    adapted_targets,
    adapter_content_sha256,
    attach_lora,
    lora_delta_norms,
    load_base_model,
    model_content_sha256,
    save_adapter,
    trainable_parameters,
)
from kiln.core.train.mismatch import DEFAULT_IS_CAP, mismatch_figures
from kiln.core.train.optim import build_optimizer, learning_rate_at, set_learning_rate
from kiln.core.train.plan import Plan, plan_training
from kiln.core.train.receipt import (
    build_receipt,
    grpo_block,
    last_epoch_mean,
    online_blocks,
    runtime_block,
    write_receipt,
)
from kiln.core.train.resume import checkpoint_extras, trainer_version, try_resume
from kiln.core.train.staleness import score_behavior, stale_origin
from kiln.core.train.step import LogprobCache, score_old_logprobs, train_step


@dataclass
class TrainedAdapter:
    """What ``train_grpo`` leaves on local disk (the activity's stored result is
    ``kiln.core.records.TrainResult``)."""

    adapter_dir: Path
    receipt: dict
    steps: int
    # Σ action-token log-prob per completion (kept groups/completions) under the final adapter,
    # from the same code path the trainer uses: lets callers/tests verify a reloaded adapter.
    final_action_logprob_sums: list[list[float]] = field(default_factory=list)
    # keep_state: the packed continuation state (final_state.tar) and its sha256 digest
    final_state: Path | None = None
    final_state_sha256: str | None = None
    # mean per-step KL to the base model over the last epoch (None: KL not computed)
    kl: float | None = None
    # how far this training moved the policy (kiln.core.train.drift): KL(π_new ‖ π_start), KL(π_new ‖ base)
    kl_to_previous: float | None = None
    kl_to_base: float | None = None
    # target_kl: the step at which the training ended early (its update not taken); None: ran out
    early_stop_step: int | None = None


def evaluation_of(rows: list[list[Row]], scored: dict[tuple[int, int], torch.Tensor]) -> dict[str, Any]:
    """The receipt's evaluation figures from per-row log-probs already scored
    (:func:`kiln.core.train.step.score_rows`): mean ECHO env CE over groups (per group: Σ per row of its
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


def _load_model(
    model_path: Path,
    config: Any,
    base_adapter_dir: Path | None,
    dev: torch.device,
    dtype: str,
    shared_base: Any,
    ranks: Any = None,
) -> Any:
    """The LoRA-wrapped model: on the policy runtime's own base model when ``shared_base`` lends
    it (one copy per worker), else on a freshly loaded one; with ``ranks`` loaded on the CPU and
    sharded across the ranks' devices (:mod:`kiln.core.train.distributed`)."""
    load_on = torch.device("cpu") if ranks is not None else dev
    base = shared_base.model if shared_base is not None else load_base_model(Path(model_path), load_on, dtype)
    model = attach_lora(
        base, rank=config.lora_rank, alpha=config.lora_alpha, seed=config.seed, base_adapter_dir=base_adapter_dir
    )
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
    if ranks is not None:
        from kiln.core.train.distributed import shard_base_model

        shard_base_model(model, ranks, dev)
    return model


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
    base_adapter_sha: str | None = None
    start_adapter_dir: Path | None = None  # the adapter training starts from (None: the base model)
    start_step: int = 0
    resumed_from: int | None = None
    continued_from: dict[str, Any] | None = None  # receipt block: the continuation state used
    staleness: dict[str, Any] | None = None  # receipt block: stale data's behaviour policy
    early_stop: dict[str, Any] | None = None  # receipt block: where target_kl ended the training
    # another engine's recorded log-probs per row (kept before stale data is re-scored); None: hf
    engine_logprobs: dict[tuple[int, int], torch.Tensor | None] | None = None
    # the learning-rate schedule's position: optimizer steps of earlier iterations, run horizon
    steps_before: int = 0
    horizon_steps: int | None = None
    checkpoint: dict[str, Any] | None = None  # receipt block: the checkpoint a retry resumed from, or why not
    ranks: Any = None  # kiln.core.train.distributed.RankGroup of a trainer across devices; None: one process


def _checkpoint(loop: Loop, plan: Plan, step: int, output_dir: Path, sink: Callable[[int, Path], None] | None) -> None:
    folder = output_dir / "checkpoints" / f"step-{step:06d}"
    if folder.exists():
        shutil.rmtree(folder)
    save_checkpoint(
        folder,
        params=loop.named,
        optimizer=loop.optimizer,
        state={
            **plan.identity,
            "step": step,
            "history": loop.history,
            "initial_eval": loop.initial_eval,
            **checkpoint_extras(plan.effective_config),
        },
        logprobs=loop.cache.tensors(),
    )
    if sink is not None:
        sink(step, folder)


def run_steps(
    loop: Loop,
    plan: Plan,
    config: Any,
    dev: torch.device,
    *,
    start_step: int,
    output_dir: Path,
    progress: Callable[[dict], None] | None,
    checkpoint_sink: Callable[[int, Path], None] | None,
    should_cancel: Callable[[], bool] | None,
) -> None:
    """Run the optimizer steps ``start_step+1 … total``; checkpoints and progress included.

    The learning rate follows one schedule over the run's global step (``steps_before`` + step,
    horizon ``horizon_steps``): an online run warms up once."""
    total = len(plan.schedule)
    params = [p for _, p in loop.named]
    base_lr = loop.optimizer_info["learning_rate"]
    horizon = loop.horizon_steps or loop.steps_before + total
    main = loop.ranks is None or loop.ranks.is_main  # rank 0 alone reports and checkpoints
    for step in range(start_step + 1, total + 1):
        if should_cancel is not None and should_cancel():
            raise RunCancelled(f"training cancelled before step {step} of {total}")
        epoch, group_ids = plan.schedule[step - 1]
        rows = [row for g in group_ids for row in loop.rows[g]]
        lr = learning_rate_at(
            loop.steps_before + step, horizon, base_lr, warmup_steps=config.warmup_steps, schedule=config.lr_schedule
        )
        set_learning_rate(loop.optimizer, lr)
        t0 = time.perf_counter()
        values = train_step(loop.model, rows, loop.optimizer, params, plan.settings, loop.cache, dev, ranks=loop.ranks)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        if values.pop("stopped", False):
            loop.early_stop = {
                "target_kl": plan.settings.target_kl,
                "step": step,
                "approx_kl": values["approx_kl"],
                "steps_taken": step - 1,
            }
            break
        tokens = values.pop("tokens")
        action_tokens = int(sum(float(r.action.sum()) for r in rows))
        group = group_ids[0] if len(group_ids) == 1 else list(group_ids)
        stale = {"staleness": loop.staleness["staleness"]} if loop.staleness is not None else {}
        loop.history.append(
            {"step": step, "epoch": epoch, "group": group, "lr": lr, **values, "action_tokens": action_tokens, **stale}
        )
        if progress is not None and main:
            shown = {**values, "kl": values["kl"] if plan.settings.kl_on else None}  # None: KL is off
            progress(
                {
                    "step": step,
                    "total_steps": total,
                    **shown,
                    "learning_rate": float(lr),
                    "action_tokens": action_tokens,
                    "tokens_per_s": tokens / elapsed,
                }
            )
        if main and config.checkpoint_interval and step % config.checkpoint_interval == 0:
            _checkpoint(loop, plan, step, output_dir, checkpoint_sink)


def prepare_training(
    *,
    model_path: Path,
    groups: list[dict],
    config: Any,
    work_dir: Path,
    base_adapter_dir: Path | None = None,
    expected_behavior_policy: dict | None = None,
    resume_from: Path | None = None,
    init_state: Path | None = None,
    behavior_adapter_dir: Path | None = None,
    staleness: int = 0,
    device: str | None = None,
    dtype: str = "float32",
    shared_base: Any = None,
    selected: tuple[list[dict], dict[str, Any]] | None = None,
    iteration: int | None = None,
    iterations_total: int | None = None,
    lr_horizon_steps: int | None = None,
    resume_refused: str | None = None,
    ranks: Any = None,
) -> tuple[Loop, Plan]:
    """Admission, model, rows, optimizer and starting state — everything before the first step.

    The optimizer starts fresh, from ``init_state`` (a continuation state, see
    :mod:`kiln.core.train.continuation`) or — a retried attempt — from its own checkpoint
    ``resume_from``, which already holds what ``init_state`` started it with; a checkpoint that
    cannot be used (or ``resume_refused``: why the caller could not fetch it) restarts the
    training from its start (:mod:`kiln.core.train.resume`). ``iteration`` (1-based,
    online runs) seeds the epoch order; ``lr_horizon_steps`` (the run's planned optimizer steps) is the
    learning-rate schedule's horizon, else (older runs) ``iterations_total`` estimates it from this
    training's own step count.
    Refuses float16 (:func:`refuse_float16`)."""
    refuse_float16(dtype)
    base_adapter_sha = adapter_content_sha256(base_adapter_dir) if base_adapter_dir else None
    stale = stale_origin(staleness, behavior_adapter_dir, expected_behavior_policy)
    # each rank unpacks the continuation state into a folder of its own (they run at once)
    unpack_in = Path(work_dir) if ranks is None else Path(work_dir) / f"rank-{ranks.rank}"
    init = read_init_state(init_state, unpack_in) if init_state is not None else None
    extra: dict[str, Any] = {"init_state_sha256": init.sha256} if init is not None else {}
    if stale is not None:
        extra.update(staleness=staleness, behavior_adapter_sha256=stale["behavior_adapter_sha256"])
    plan = plan_training(
        groups,
        config,
        expected_behavior_policy,
        base_adapter_sha,
        selected,
        staleness=staleness,
        extra_identity=extra,
        iteration=iteration,
    )
    dev = torch.device(device or "cpu")
    model = _load_model(model_path, config, base_adapter_dir, dev, dtype, shared_base, ranks)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    warning_filter = plan.echo["warning_filter"]
    rows = [
        group_rows(
            g,
            group_index=i,
            warning_filter=warning_filter,
            vocab_size=vocab,
            env_mask_mode=plan.echo["env_mask_mode"],
            shaping=plan.shaping,
        )
        for i, g in enumerate(plan.kept)
    ]
    if plan.settings.recorded and any(r.behavior is None for group in rows for r in group):
        raise TrainingFailed(
            "behavior_policy 'recorded' needs logprobs on every action piece", code="invalid_training_data"
        )
    if plan.settings.engine_is_max_weight is not None and any(r.behavior is None for group in rows for r in group):
        raise TrainingFailed(
            f"data sampled by the {plan.engine} engine needs its recorded logprobs on every "
            "action piece (the trainer corrects the engine's gap with them)",
            code="invalid_training_data",
        )
    engine_logprobs = None if plan.engine == "hf" else {r.key: r.behavior for group in rows for r in group}
    if plan.settings.stale_is_max_weight is not None and not plan.settings.recorded:
        rows = score_behavior(model, rows, behavior_adapter_dir, plan.settings, dev)
        stale = {**stale, "is_max_weight": plan.settings.stale_is_max_weight}
    elif stale is not None:  # recorded: the old log-probs are the sampler's own already
        stale = {**stale, "behavior_logprobs": "recorded", "is_max_weight": None}
    named = trainable_parameters(model)
    optimizer, optimizer_info = build_optimizer(config, [p for _, p in named])
    loop = Loop(
        model=model,
        optimizer=optimizer,
        named=named,
        rows=rows,
        cache=LogprobCache(),
        history=[],
        initial_eval={},
        optimizer_info=optimizer_info,
        base_adapter_sha=base_adapter_sha,
        start_adapter_dir=base_adapter_dir,
        staleness=stale,
        engine_logprobs=engine_logprobs,
        ranks=ranks,
        continued_from=init.continued_from(base_adapter_sha) if init is not None else None,
    )
    loop.steps_before = loop.continued_from["optimizer_steps_before"] if loop.continued_from else 0
    if lr_horizon_steps is not None:
        loop.horizon_steps = lr_horizon_steps
    elif iterations_total is not None and iteration is not None:
        loop.horizon_steps = loop.steps_before + len(plan.schedule) * max(1, iterations_total - iteration + 1)
    loop.optimizer_info["schedule_horizon_steps"] = loop.horizon_steps or loop.steps_before + len(plan.schedule)
    if resume_from is not None or resume_refused is not None:
        restored: dict[str, torch.Tensor] = {}

        def restore(folder: Path) -> None:
            restored.update(restore_checkpoint(folder, params=named, optimizer=optimizer))

        state, loop.checkpoint = try_resume(
            resume_from,
            identity=plan.identity,
            effective_config=plan.effective_config,
            restore=restore,
            params=named,
            optimizer=optimizer,
        )
        if resume_refused is not None:
            loop.checkpoint["reason"] = resume_refused
        if state is not None:
            loop.cache = LogprobCache.from_tensors(restored)
            loop.start_step = loop.resumed_from = int(state["step"])
            loop.history, loop.initial_eval = list(state["history"]), state["initial_eval"]
            return loop, plan
    if init is not None:
        restore_optimizer_state(
            init.folder,
            params=named,
            optimizer=optimizer,
            optimizer_name=config.optimizer,
            adapter_sha256=base_adapter_sha,
        )
        reset_first_moments(optimizer)
    score_old_logprobs(model, [row for group in rows for row in group], loop.cache, plan.settings, dev)
    loop.initial_eval = evaluation_of(rows, loop.cache.old)
    loop.initial_eval.pop("action_logprob_sums")
    return loop, plan


def refuse_float16(dtype: str) -> None:
    """Training in float16 is refused: its gradients underflow without loss scaling, which the
    trainer does not do (sampling in float16 is fine)."""
    if str(dtype).removeprefix("torch.") == "float16":
        raise TrainingFailed(
            "training in float16 is not supported: its gradients underflow without loss scaling",
            code="training_dtype_unsupported",
            retryable=False,
            hint="train in bfloat16 (KILN_DTYPE=bfloat16, on a device that supports it) or float32 "
            "(KILN_DTYPE=float32); float16 is fine for rollouts and evaluation",
        )


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
    init_state: Path | None = None,
    keep_state: bool = False,
    behavior_adapter_dir: Path | None = None,
    staleness: int = 0,
    iteration: int | None = None,
    iterations_total: int | None = None,
    lr_horizon_steps: int | None = None,
    resume_refused: str | None = None,
    ranks: Any = None,
) -> TrainedAdapter | None:
    """Train a LoRA adapter with GRPO (+ ECHO) on ``groups``; see the module docstring.

    Writes ``output_dir/adapter/`` (standard PEFT adapter), ``output_dir/train_receipt.json`` and,
    with ``config.checkpoint_interval``, ``output_dir/checkpoints/step-NNNNNN/`` folders.
    ``shared_base`` (a :meth:`kiln.core.policy.runtime.PolicyRuntime.training_lease`) trains on the
    policy runtime's base model instead of loading a second copy; ``device``/``dtype`` must then
    be the runtime's.

    Online runs: ``init_state`` (a ``final_state.tar`` of the training that produced
    ``base_adapter_dir``) continues its optimizer state; ``keep_state`` writes this training's
    own ``output_dir/final_state.tar``. ``staleness`` ≥ 1 marks data sampled by an older policy
    than ``base_adapter_dir`` — ``behavior_adapter_dir`` (None: the bare base model) — trained
    with truncated behaviour importance weights. Defaults leave the training exactly as a
    single-pass run's.

    ``ranks`` (a :class:`kiln.core.train.distributed.RankGroup`; launched by :mod:`kiln.core.train.launch`):
    this process is one rank of a trainer across devices; rank 0 alone reports progress and writes
    the checkpoints, the adapter and the receipt, and only rank 0 returns a result (the others None).
    """
    t_start = time.perf_counter()
    output_dir = Path(output_dir)
    loop, plan = prepare_training(
        model_path=model_path,
        groups=groups,
        config=config,
        work_dir=output_dir,
        base_adapter_dir=base_adapter_dir,
        expected_behavior_policy=expected_behavior_policy,
        resume_from=resume_from,
        init_state=init_state,
        behavior_adapter_dir=behavior_adapter_dir,
        staleness=staleness,
        device=device,
        dtype=dtype,
        shared_base=shared_base,
        selected=selected,
        iteration=iteration,
        iterations_total=iterations_total,
        lr_horizon_steps=lr_horizon_steps,
        resume_refused=resume_refused,
        ranks=ranks,
    )
    dev = torch.device(device or "cpu")
    t_loaded = time.perf_counter()
    run_steps(
        loop,
        plan,
        config,
        dev,
        start_step=loop.start_step,
        output_dir=output_dir,
        progress=progress,
        checkpoint_sink=checkpoint_sink,
        should_cancel=should_cancel,
    )
    t_trained = time.perf_counter()
    return _finish(
        loop,
        plan,
        config,
        model_path=model_path,
        output_dir=output_dir,
        dev=dev,
        dtype=dtype,
        adapter_name=adapter_name,
        behavior=expected_behavior_policy,
        keep_state=keep_state,
        timings=(t_start, t_loaded, t_trained),
    )


def engine_mismatch(loop: Loop, plan: Plan) -> dict[str, Any] | None:
    """The receipt's ``engine_mismatch`` block for data sampled by another engine than hf: the gap
    between the engine's recorded log-probs and the trainer's pre-update ones on every action
    token (:func:`kiln.core.train.mismatch.mismatch_figures`), and whether the truncated IS weights
    corrected it (``correction``; ``reason`` when not). None for hf data."""
    if loop.engine_logprobs is None:
        return None
    engine_rows, trainer_rows = [], []
    for row in (r for group in loop.rows for r in group):
        recorded = loop.engine_logprobs.get(row.key)
        if recorded is None or row.key not in loop.cache.old:
            continue
        mask = row.action.bool()
        engine_rows.append(recorded[mask].tolist())
        trainer_rows.append(loop.cache.old[row.key][mask].tolist())
    cap = plan.settings.engine_is_max_weight
    figures = mismatch_figures(engine_rows, trainer_rows, cap=cap if cap is not None else DEFAULT_IS_CAP)
    if cap is None:
        figures.pop("is_cap")
        return {"engine": plan.engine, "correction": "none", "reason": plan.engine_uncorrected, **figures}
    return {"engine": plan.engine, "correction": "truncated_is", **figures}


def _finish(
    loop: Loop,
    plan: Plan,
    config: Any,
    *,
    model_path: Path,
    output_dir: Path,
    dev: torch.device,
    dtype: str,
    adapter_name: str | None,
    behavior: dict | None,
    keep_state: bool,
    timings: tuple[float, float, float],
) -> TrainedAdapter | None:
    """Final evaluation, adapter, continuation state, receipt (every rank scores; rank 0 writes)."""
    flat = [row for group in loop.rows for row in group]
    final, drift = final_pass(loop.model, flat, plan.settings, dev, start_adapter_dir=loop.start_adapter_dir)
    final_eval = evaluation_of(loop.rows, final)
    sums = final_eval.pop("action_logprob_sums")
    mismatch = engine_mismatch(loop, plan)
    base_bytes = resident_base_bytes(loop.model, loop.ranks)
    if loop.ranks is not None and not loop.ranks.is_main:
        return None
    adapter_dir = output_dir / "adapter"
    if adapter_dir.exists():
        shutil.rmtree(adapter_dir)
    adapter_sha = save_adapter(loop.model, adapter_dir)
    final_state, final_state_sha = None, None
    steps_taken = len(loop.history)
    if keep_state:
        final_state, final_state_sha = write_final_state(
            output_dir,
            params=loop.named,
            optimizer=loop.optimizer,
            identity=plan.identity,
            steps=steps_taken,
            adapter_sha256=adapter_sha,
            optimizer_name=config.optimizer,
            steps_before=loop.steps_before,
        )
    delta_total, delta_norms = lora_delta_norms(loop.model)
    t_start, t_loaded, t_trained = timings
    echo = {**plan.echo, "initial_env_ce": loop.initial_eval["env_ce"], "final_env_ce": final_eval["env_ce"]}
    receipt = build_receipt(
        adapter_name=adapter_name,
        base_model_sha256=model_content_sha256(Path(model_path)),
        base_adapter_sha256=loop.base_adapter_sha,
        training_data_sha256=plan.identity["training_data_sha256"],
        effective_config=plan.effective_config,
        grpo=grpo_block(plan, config, loop.optimizer_info),
        selection=plan.selection,
        history=loop.history,
        echo=echo,
        token_counts=plan.token_counts,
        evaluation={"initial": loop.initial_eval, "final": final_eval},
        adapter_sha256=adapter_sha,
        lora_delta_norm=delta_total,
        lora_delta_norms=delta_norms,
        behavior_policy=behavior,
        runtime=runtime_block(
            dev, dtype, world_size=loop.ranks.world_size if loop.ranks else 1, base_weight_bytes=base_bytes
        ),
        phase_timings={
            "setup_s": t_loaded - t_start,
            "train_s": t_trained - t_loaded,
            "save_s": time.perf_counter() - t_trained,
        },
        resumed_from_step=loop.resumed_from,
        extra={
            **online_blocks(
                continued_from=loop.continued_from, staleness=loop.staleness, final_state_sha256=final_state_sha
            ),
            "policy_drift": drift,
            "early_stop": loop.early_stop,
            "trainer": trainer_version(),
            "lora_targets": adapted_targets(loop.model, TRAIN_ADAPTER),
            **({"checkpoint": loop.checkpoint} if loop.checkpoint is not None else {}),
            **({"engine_mismatch": mismatch} if mismatch is not None else {}),
        },
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    write_receipt(output_dir, receipt)
    return TrainedAdapter(
        adapter_dir=adapter_dir,
        receipt=receipt,
        steps=steps_taken,
        final_action_logprob_sums=sums,
        final_state=final_state,
        final_state_sha256=final_state_sha,
        kl=last_epoch_mean(loop.history, "kl") if plan.settings.kl_on and loop.history else None,
        kl_to_previous=drift["kl_to_previous"],
        kl_to_base=drift["kl_to_base"],
        early_stop_step=loop.early_stop["step"] if loop.early_stop else None,
    )
