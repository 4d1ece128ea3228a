"""The live state of one training (:class:`Loop`) and its step loop: optimizer steps, progress,
checkpoints.

:func:`run_steps` advances a prepared :class:`Loop` (:mod:`kiln.core.train.prepare`) over the plan's
schedule, one :func:`kiln.core.train.step.train_step` per optimizer step, and writes a checkpoint
every ``checkpoint_interval`` steps (rank 0 alone, across ranks); :mod:`kiln.core.train.finish`
turns the finished loop into the adapter and the receipt.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.core.errors import RunCancelled
from kiln.core.train.batches import Row
from kiln.core.train.checkpoints import save_checkpoint
from kiln.core.train.optim import learning_rate_at, set_learning_rate
from kiln.core.train.plan import Plan
from kiln.core.train.resume import checkpoint_extras
from kiln.core.train.step import LogprobCache, train_step


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
    memory: Any = None  # kiln.core.train.memory.MemoryMarks: this process's memory readings


def write_checkpoint(
    loop: Loop, plan: Plan, step: int, output_dir: Path, sink: Callable[[int, Path], None] | None
) -> None:
    """``output_dir/checkpoints/step-NNNNNN/``: weights, optimizer, RNG, cached log-probs and the
    identity a resume checks; then ``sink(step, folder)`` (the activity uploads and heartbeats it)."""
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
            write_checkpoint(loop, plan, step, output_dir, checkpoint_sink)
