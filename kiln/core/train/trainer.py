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

Layout: :mod:`kiln.core.train.prepare` (before the first step), :mod:`kiln.core.train.loop` (the
steps), :mod:`kiln.core.train.finish` (adapter and receipt); :func:`train_grpo` runs the three.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.core.train.finish import TrainedAdapter, finish
from kiln.core.train.loop import run_steps
from kiln.core.train.prepare import prepare_training


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
    return finish(
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
