"""Everything a training does after its last step: the final scoring, the adapter, the
continuation state and the receipt (:class:`TrainedAdapter` is what it leaves on disk).

Every rank scores the rows (the passes are collectives across ranks); rank 0 alone writes.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.core.train.continuation import write_final_state
from kiln.core.train.distributed import resident_base_bytes
from kiln.core.train.drift import final_pass, final_pass_full
from kiln.core.train.full import folder_bytes, is_full, load_full_model, save_full, weights_delta_norms, weights_source
from kiln.core.train.loop import Loop
from kiln.core.train.memory import process_memory
from kiln.core.train.mismatch import DEFAULT_IS_CAP, mismatch_figures
from kiln.core.train.model import (
    TRAIN_ADAPTER,
    adapted_targets,
    lora_delta_norms,
    model_content_sha256,
    save_adapter,
)
from kiln.core.train.plan import Plan
from kiln.core.train.receipt import (
    build_receipt,
    evaluation_of,
    grpo_block,
    last_epoch_mean,
    online_blocks,
    runtime_block,
    write_receipt,
)
from kiln.core.train.resume import trainer_version


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


def finish(
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
    if is_full(config):
        final, drift, deltas = _full_final_pass(loop, plan, model_path, flat, dev, dtype)
    else:
        final, drift = final_pass(loop.model, flat, plan.settings, dev, start_adapter_dir=loop.start_adapter_dir)
        deltas = lora_delta_norms(loop.model)
    final_eval = evaluation_of(loop.rows, final)
    sums = final_eval.pop("action_logprob_sums")
    mismatch = engine_mismatch(loop, plan)
    if loop.memory is not None:
        loop.memory.ended()
    base_bytes = resident_base_bytes(loop.model, loop.ranks)
    memory = process_memory(loop.memory, loop.ranks)
    if loop.ranks is not None and not loop.ranks.is_main:
        return None
    adapter_dir = output_dir / "adapter"
    if adapter_dir.exists():
        shutil.rmtree(adapter_dir)
    adapter_sha = save_full(loop.model, adapter_dir) if is_full(config) else save_adapter(loop.model, adapter_dir)
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
    receipt = _receipt(
        loop,
        plan,
        config,
        model_path=model_path,
        dev=dev,
        dtype=dtype,
        adapter_name=adapter_name,
        behavior=behavior,
        timings=timings,
        figures={
            "final_eval": final_eval,
            "drift": drift,
            "mismatch": mismatch,
            "base_bytes": base_bytes,
            "memory": memory,
            "adapter_sha": adapter_sha,
            "final_state_sha": final_state_sha,
            "deltas": deltas,
            "adapter_bytes": folder_bytes(adapter_dir),
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


def _full_final_pass(
    loop: Loop, plan: Plan, model_path: Path, flat: list[Any], dev: torch.device, dtype: str
) -> tuple[dict[tuple[int, int], torch.Tensor], dict[str, Any], tuple[float, dict[str, float]]]:
    """A full training's final pass (:func:`kiln.core.train.drift.final_pass_full`) against frozen
    copies of the starting weights (and of the base, when training started from earlier full
    weights), and the per-parameter ``W_new − W_start`` norms; the copies are freed afterwards."""
    start = load_full_model(weights_source(model_path, loop.start_adapter_dir), dev, dtype, trainable=False)
    base = None
    if loop.start_adapter_dir is not None:
        base = load_full_model(Path(model_path), dev, dtype, trainable=False)
    try:
        final, drift = final_pass_full(loop.model, flat, plan.settings, dev, start=start, base=base)
        return final, drift, weights_delta_norms(loop.model, start)
    finally:
        del start, base


def _receipt(
    loop: Loop,
    plan: Plan,
    config: Any,
    *,
    model_path: Path,
    dev: torch.device,
    dtype: str,
    adapter_name: str | None,
    behavior: dict | None,
    timings: tuple[float, float, float],
    figures: dict[str, Any],
) -> dict[str, Any]:
    """The receipt of a finished training (:func:`kiln.core.train.receipt.build_receipt`) from the
    loop and what :func:`finish` measured and wrote (``figures``)."""
    final_eval, drift, mismatch = figures["final_eval"], figures["drift"], figures["mismatch"]
    delta_total, delta_norms = figures["deltas"]
    full = is_full(config)
    t_start, t_loaded, t_trained = timings
    echo = {**plan.echo, "initial_env_ce": loop.initial_eval["env_ce"], "final_env_ce": final_eval["env_ce"]}
    return build_receipt(
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
        adapter_sha256=figures["adapter_sha"],
        lora_delta_norm=None if full else delta_total,
        lora_delta_norms={} if full else delta_norms,
        behavior_policy=behavior,
        runtime=runtime_block(
            dev,
            dtype,
            world_size=loop.ranks.world_size if loop.ranks else 1,
            base_weight_bytes=figures["base_bytes"],
            process_memory=figures["memory"],
        ),
        phase_timings={
            "setup_s": t_loaded - t_start,
            "train_s": t_trained - t_loaded,
            "save_s": time.perf_counter() - t_trained,
        },
        resumed_from_step=loop.resumed_from,
        extra={
            **online_blocks(
                continued_from=loop.continued_from,
                staleness=loop.staleness,
                final_state_sha256=figures["final_state_sha"],
            ),
            "policy_drift": drift,
            "early_stop": loop.early_stop,
            "trainer": trainer_version(),
            **(
                {
                    "adapter": {"kind": "full", "sha256": figures["adapter_sha"], "bytes": figures["adapter_bytes"]},
                    "weights_delta_norm": delta_total,
                    "weights_delta_norms": delta_norms,
                }
                if full
                else {"lora_targets": adapted_targets(loop.model, TRAIN_ADAPTER)}
            ),
            **({"checkpoint": loop.checkpoint} if loop.checkpoint is not None else {}),
            **({"engine_mismatch": mismatch} if mismatch is not None else {}),
        },
    )
