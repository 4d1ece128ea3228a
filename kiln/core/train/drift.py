"""How far a training moved the policy: the exact KL to the policy it started from and to the base.

Measured once after the last step, on the training's own rows (every kept completion), at every
action token's position, per position over the **whole vocabulary** and averaged over all of them:

- ``kl_to_previous`` = mean over action positions of KL(π_new ‖ π_start) =
  ``Σ_v π_new(v)·(log π_new(v) − log π_start(v))``. In an online run π_start is the previous
  iteration's adapter, so this is KL(π_k ‖ π_{k−1}).
- ``kl_to_base`` = the same with π_base (the base model, every adapter disabled).

Both are exact per position (no sampling estimate), at the sampling temperature, with no gradient.
They are computed inside the trainer's post-update scoring pass (:func:`final_pass`, which also gives
the final evaluation's log-probs): per micro-batch, one backbone forward under the trained adapter,
one under π_start and (when π_start is not the base) one with every adapter disabled; the hidden
states of the action positions go through the output head in chunks of positions
(:func:`kiln.core.train.losses.exact_kls`), so no full-vocabulary tensor of a batch is ever built.
π_start is the base model itself for a training from the base (a fresh LoRA's B is zero, so it
adds exactly nothing), else ``base_adapter_dir`` loaded next to the trained adapter, frozen, and
removed afterwards. A full training (``adapter: full``, :func:`final_pass_full`) scores π_start
and π_base with frozen copies of those weights, each through its own output head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kiln.core.errors import TrainingFailed
from kiln.core.policy.loading import TORCH_GLOBAL_STATE
from kiln.core.train.batches import Row, collate, pack_microbatches
from kiln.core.train.losses import exact_kls, output_head, sequence_hidden
from kiln.core.train.model import TRAIN_ADAPTER
from kiln.core.train.step import StepSettings, batch_logprobs

DRIFT_ESTIMATOR = "exact_full_vocabulary"
START_ADAPTER = "kiln-start"


@contextmanager
def frozen_adapter(model: Any, adapter_dir: Path, name: str, label: str) -> Iterator[None]:
    """``adapter_dir`` loaded next to the trained adapter as the frozen adapter ``name`` for the
    block (``label`` names it in the error when it cannot load); afterwards the trained adapter is
    active again and ``name`` is deleted."""
    try:
        with TORCH_GLOBAL_STATE, torch.random.fork_rng(devices=[]):
            model.load_adapter(str(adapter_dir), adapter_name=name, is_trainable=False)
    except (OSError, ValueError) as exc:
        raise TrainingFailed(f"cannot load {label} {adapter_dir}: {exc}", code="adapter_load_failed") from exc
    try:
        yield
    finally:
        model.set_adapter(TRAIN_ADAPTER)
        model.delete_adapter(name)


def _hidden_under(model: Any, adapter: str | None, batch: Any) -> torch.Tensor:
    """Hidden states of ``batch`` under ``adapter`` (None: every adapter disabled)."""
    if adapter is None:
        with model.disable_adapter():
            return sequence_hidden(model, batch.input_ids, batch.attention_mask)
    model.set_adapter(adapter)
    try:
        return sequence_hidden(model, batch.input_ids, batch.attention_mask)
    finally:
        model.set_adapter(TRAIN_ADAPTER)


Ref = tuple[Callable[[Any], torch.Tensor], Any]  # (batch -> hidden states, output head) of one π


def _score(
    model: Any, rows: list[Row], settings: StepSettings, device: torch.device, refs: list[Ref]
) -> tuple[dict[tuple[int, int], torch.Tensor], dict[str, Any]]:
    """Every row's log-probs under ``model`` and the KL to each reference policy of ``refs``
    (``refs[0]``: π_start, ``refs[-1]``: π_base; one entry when they are the same)."""
    head = output_head(model)
    scored: dict[tuple[int, int], torch.Tensor] = {}
    to_previous: list[float] = []
    to_base: list[float] = []
    tokens = 0
    for micro in pack_microbatches(rows, settings.max_tokens_per_microbatch):
        batch = collate(micro).to(device)
        hidden_new = sequence_hidden(model, batch.input_ids, batch.attention_mask)
        logprobs = batch_logprobs(model, batch, settings.temperature, hidden=hidden_new)
        for b, row in enumerate(micro):
            scored[row.key] = logprobs[b, : row.length - 1].detach().cpu()
        on = batch.action_mask > 0
        hiddens = [hidden_of(batch)[on] for hidden_of, _ in refs]
        kls = exact_kls(head, hidden_new[on], hiddens, temperature=settings.temperature, heads_q=[h for _, h in refs])
        to_previous.append(float(kls[0].double().sum().item()))
        to_base.append(float(kls[-1].double().sum().item()))
        tokens += int(on.sum().item())
    figures = {
        "kl_to_previous": math.fsum(to_previous) / tokens if tokens else None,
        "kl_to_base": math.fsum(to_base) / tokens if tokens else None,
        "action_tokens": tokens,
        "estimator": DRIFT_ESTIMATOR,
    }
    return scored, figures


def _adapter_ref(model: Any, adapter: str | None) -> Ref:
    head = output_head(model)
    return (lambda batch: _hidden_under(model, adapter, batch)), head


def _model_ref(other: Any) -> Ref:
    return (lambda batch: sequence_hidden(other, batch.input_ids, batch.attention_mask)), output_head(other)


@torch.no_grad()
def final_pass_full(
    model: Any, rows: list[Row], settings: StepSettings, device: torch.device, *, start: Any, base: Any | None
) -> tuple[dict[tuple[int, int], torch.Tensor], dict[str, Any]]:
    """:func:`final_pass` of a full training: π_start is the frozen model ``start`` (the weights
    training began from), π_base the frozen ``base`` (None: ``start`` is the base model)."""
    refs = [_model_ref(start)] + ([_model_ref(base)] if base is not None else [])
    return _score(model, rows, settings, device, refs)


@torch.no_grad()
def final_pass(
    model: Any, rows: list[Row], settings: StepSettings, device: torch.device, *, start_adapter_dir: Path | None
) -> tuple[dict[tuple[int, int], torch.Tensor], dict[str, Any]]:
    """The post-update pass: every row's log-probs under the trained adapter (as
    :func:`kiln.core.train.step.score_rows`) and the receipt's ``policy_drift`` block
    ``{kl_to_previous, kl_to_base, action_tokens, estimator}`` (see the module docstring).
    ``start_adapter_dir``: the adapter training started from (None: the base model). Leaves the
    model with only its trained adapter, active, and the torch RNG untouched."""
    if start_adapter_dir is None:  # scoring draws nothing; the adapter load forks the generator
        return _score(model, rows, settings, device, [_adapter_ref(model, None)])
    with frozen_adapter(model, start_adapter_dir, START_ADAPTER, "the starting adapter"):
        refs = [_adapter_ref(model, START_ADAPTER), _adapter_ref(model, None)]
        return _score(model, rows, settings, device, refs)
