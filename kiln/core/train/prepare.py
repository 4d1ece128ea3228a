"""Everything a training does before its first step: admission, the model, the rows, the
optimizer and the starting state (fresh, an online run's continuation state, or a retried
attempt's own checkpoint).

:func:`prepare_training` returns the :class:`kiln.core.train.loop.Loop` the step loop advances and
the :class:`kiln.core.train.plan.Plan` it follows; with ``ranks`` (a trainer across devices) each
rank loads only its shards of the base model (:mod:`kiln.core.train.shard_load`,
:mod:`kiln.core.train.distributed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.core.errors import FullTrainingUnsupported, TrainingFailed
from kiln.core.train.batches import Row, group_rows
from kiln.core.train.checkpoints import restore_checkpoint, restore_optimizer_state
from kiln.core.train.continuation import read_init_state, reset_first_moments
from kiln.core.train.full import is_full, load_full_model, weights_source
from kiln.core.train.loop import Loop
from kiln.core.train.memory import MemoryMarks
from kiln.core.train.model import adapter_content_sha256, attach_lora, load_base_model, trainable_parameters
from kiln.core.train.optim import build_optimizer
from kiln.core.train.packing import require_packable
from kiln.core.train.plan import Plan, plan_training
from kiln.core.train.receipt import evaluation_of
from kiln.core.train.resume import try_resume
from kiln.core.train.staleness import score_behavior, stale_origin
from kiln.core.train.step import LogprobCache, score_old_logprobs


def load_model(
    model_path: Path,
    config: Any,
    base_adapter_dir: Path | None,
    dev: torch.device,
    dtype: str,
    shared_base: Any,
    ranks: Any = None,
) -> Any:
    """The LoRA-wrapped model: on the policy runtime's own base model when ``shared_base`` lends
    it (one copy per worker), else on a freshly loaded one; with ``ranks`` built without its
    weights, sharded across the ranks' devices (:mod:`kiln.core.train.distributed`), and each
    rank's shards read from the checkpoint (:mod:`kiln.core.train.shard_load`)."""
    if is_full(config):
        return _load_full(model_path, config, base_adapter_dir, dev, dtype, ranks)
    shard_only = ranks is not None and shared_base is None  # each rank reads its own shards
    if shared_base is not None:
        base = shared_base.model
    elif shard_only:
        from kiln.core.train.shard_load import weightless_model

        base = weightless_model(Path(model_path), dtype, dev)
    else:
        base = load_base_model(Path(model_path), torch.device("cpu") if ranks is not None else dev, dtype)
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
        from kiln.core.train.shard_load import fill_shards, materialise, to_meta

        if shard_only:
            to_meta(model)
        shard_base_model(model, ranks, dev)
        if shard_only:
            materialise(model, dev)
            fill_shards(model, Path(model_path))
    return model


def _load_full(
    model_path: Path, config: Any, base_adapter_dir: Path | None, dev: torch.device, dtype: str, ranks: Any
) -> Any:
    """``adapter: full``: its own trainable copy (never the runtime's shared base, which sampling
    keeps using), from the base model or the previous iteration's full weights."""
    if ranks is not None:
        raise FullTrainingUnsupported(
            "training_config.adapter full trains on one device: several train devices shard LoRA training only",
            hint="set KILN_TRAIN_DEVICES to 1 for full training, or train adapter lora",
        )
    model = load_full_model(weights_source(model_path, base_adapter_dir), dev, dtype, trainable=True)
    if config.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # transformers checkpoints only in training mode; the model has no dropout
    return model


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
    memory = MemoryMarks.before_load()
    model = load_model(model_path, config, base_adapter_dir, dev, dtype, shared_base, ranks)
    memory.loaded()
    if plan.settings.packing:
        require_packable(model)
    rows = training_rows(model, plan)
    engine_logprobs = None if plan.engine == "hf" else {r.key: r.behavior for group in rows for r in group}
    if plan.settings.stale_is_max_weight is not None and not plan.settings.recorded:
        rows = score_behavior(model, rows, behavior_adapter_dir, plan.settings, dev)
        stale = {**(stale or {}), "is_max_weight": plan.settings.stale_is_max_weight}
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
        memory=memory,
    )
    _place_schedule(loop, plan, lr_horizon_steps, iteration, iterations_total)
    if (resume_from is not None or resume_refused is not None) and _resume(loop, plan, resume_from, resume_refused):
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


def training_rows(model: Any, plan: Plan) -> list[list[Row]]:
    """The kept groups' rows (tokens, masks, advantages), refused when the data lacks the
    recorded log-probs its behaviour policy or its engine needs."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    rows = [
        group_rows(
            g,
            group_index=i,
            warning_filter=plan.echo["warning_filter"],
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
    return rows


def _place_schedule(
    loop: Loop, plan: Plan, lr_horizon_steps: int | None, iteration: int | None, iterations_total: int | None
) -> None:
    """Where this training sits on the run's learning-rate schedule: the optimizer steps before it
    (a continuation) and the schedule's horizon."""
    loop.steps_before = loop.continued_from["optimizer_steps_before"] if loop.continued_from else 0
    if lr_horizon_steps is not None:
        loop.horizon_steps = lr_horizon_steps
    elif iterations_total is not None and iteration is not None:
        loop.horizon_steps = loop.steps_before + len(plan.schedule) * max(1, iterations_total - iteration + 1)
    loop.optimizer_info["schedule_horizon_steps"] = loop.horizon_steps or loop.steps_before + len(plan.schedule)


def _resume(loop: Loop, plan: Plan, resume_from: Path | None, resume_refused: str | None) -> bool:
    """A retried attempt's own checkpoint restored into ``loop`` (True), or why it could not be
    (False: the training starts over; the receipt's ``checkpoint`` block says why)."""
    restored: dict[str, torch.Tensor] = {}

    def restore(folder: Path) -> None:
        restored.update(restore_checkpoint(folder, params=loop.named, optimizer=loop.optimizer))

    state, loop.checkpoint = try_resume(
        resume_from,
        identity=plan.identity,
        effective_config=plan.effective_config,
        restore=restore,
        params=loop.named,
        optimizer=loop.optimizer,
    )
    if resume_refused is not None:
        loop.checkpoint["reason"] = resume_refused
    if state is None:
        return False
    loop.cache = LogprobCache.from_tensors(restored)
    loop.start_step = loop.resumed_from = int(state["step"])
    loop.history, loop.initial_eval = list(state["history"]), state["initial_eval"]
    return True


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
