"""One GRPO optimizer step: micro-batches with gradient accumulation over the rows of its groups.

Old log-probs (the behaviour policy's): with ``recorded`` the sampler's recorded log-probs; with
``no_importance_correction`` the trainer's own log-probs of every row under the policy training
starts from, scored in one no-grad pass before step 1 (:func:`score_old_logprobs`: every row sees
the same pre-update policy, as the sampler did, so the ratio measures all of the drift since
sampling and the clip acts on it), kept in :class:`LogprobCache` (and in checkpoints) and never
refreshed. A row missing from the cache (a checkpoint written before the pass existed) is scored at
its first visit. A stale batch (``stale_is_max_weight`` set: the data was sampled by an older policy
than the one training starts from) keeps those pre-update log-probs as the proximal policy of the PPO ratio and
multiplies each action token's term by the truncated importance weight
``min(π_prox / π_behaviour, stale_is_max_weight)`` (no gradient), where ``π_behaviour`` is each
row's ``behavior`` log-probs: those of the policy that sampled it (:mod:`kiln.core.train.staleness`).
Data sampled by another engine than the trainer's kernels (vllm; ``engine_is_max_weight`` set)
gets the same truncated weight with ``π_behaviour`` the engine's recorded log-probs, which
corrects the gap between the engine's numbers and the trainer's (:mod:`kiln.core.train.mismatch`).
Reference log-probs (KL) come from the same model with the adapter disabled, computed once per row
and cached (the base never changes). Every loss term is divided by totals of the whole step (action
tokens, sequences with observations), so accumulating micro-batches gives the gradient of the
step in one batch up to float rounding, whatever ``max_tokens_per_microbatch`` is. The policy
term's divisor follows ``loss_normaliser``: the step's action tokens (``tokens``), each row's action
tokens times the step's sequences (``sequences``: a mean of per-sequence token means) or the step's
sequences times the sampler's ``max_action_tokens`` (``constant``, Dr. GRPO). With
``entropy_coeff`` > 0 the loss also gets ``− entropy_coeff · mean entropy`` over the step's action
tokens, from the same chunked log-prob pass, and the step records ``entropy``. With ``packing`` the
micro-batches are bins of rows sharing sequences (:mod:`kiln.core.train.packing`) and their
log-probs come back in the padded layout, so every term below reads the same tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.core.errors import TrainingFailed
from kiln.core.train.batches import GroupBatch, Row, collate, pack_microbatches
from kiln.core.train.packing import packed_logprobs, packed_microbatches
from kiln.core.train.losses import (
    echo_loss,
    kl_k1_penalty,
    kl_k3,
    policy_loss,
    sequence_logprobs,
    truncated_is_weights,
)


@dataclass(frozen=True)
class StepSettings:
    """What one optimizer step needs from the config."""

    clip_epsilon: float
    kl_coeff: float
    echo_lambda: float  # 0 disables the ECHO term
    max_grad_norm: float
    recorded: bool
    clip_eps_high: float | None = None
    is_level: str = "token"
    cispo_max_weight: float = 5.0
    kl_estimator: str = "k1"  # k1 | k3 | none
    temperature: float = 1.0
    max_tokens_per_microbatch: int = 16384
    # Stale data (sampled by an older policy): truncated behaviour IS weight cap; None = on-policy.
    stale_is_max_weight: float | None = None
    # Ends the training at the first step whose approximate KL(π_old ‖ π) exceeds it (None: never).
    target_kl: float | None = None
    # Data sampled by another engine (vllm): truncated IS weight cap of min(π_trainer / π_engine, c)
    # on its recorded log-probs; None = no engine correction (hf, or see kiln.core.train.plan).
    engine_is_max_weight: float | None = None
    # What the policy term is divided by: tokens (the step's action tokens), sequences (each row's
    # action tokens × the step's sequences) or constant (the step's sequences × loss_constant_tokens).
    loss_normaliser: str = "tokens"
    loss_constant_tokens: float | None = None
    # Entropy bonus: − entropy_coeff · mean entropy over the step's action tokens (0: off, not computed).
    entropy_coeff: float = 0.0
    # Sequence packing: several rows per sequence, position ids restarting per row (kiln.core.train.packing).
    packing: bool = False

    @property
    def kl_on(self) -> bool:
        return self.kl_coeff > 0 and self.kl_estimator != "none"


@dataclass
class LogprobCache:
    """Per-row old (behaviour) and reference log-probs, keyed by (group, completion)."""

    old: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    ref: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"old.{g}.{c}": t for (g, c), t in self.old.items()}
        out.update({f"ref.{g}.{c}": t for (g, c), t in self.ref.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "LogprobCache":
        cache = cls()
        for name, tensor in tensors.items():
            kind, g, c = name.split(".")
            getattr(cache, kind)[(int(g), int(c))] = tensor
        return cache


def batch_logprobs(model: Any, batch: GroupBatch, temperature: float, **options: Any) -> Any:
    """:func:`sequence_logprobs` of a collated batch (``options``: its ``hidden``, ``with_entropy``)."""
    return sequence_logprobs(
        model, batch.input_ids, batch.attention_mask, batch.labels, temperature=temperature, **options
    )


Micro = tuple[list[Row], list[list[Row]] | None]  # a micro-batch's rows, and its bins when packed


def microbatches(rows: list[Row], settings: StepSettings) -> list[Micro]:
    """The micro-batches of ``rows``: padded (rows × longest row ≤ the token budget) or, with
    ``packing``, bins of packed rows (:func:`kiln.core.train.packing.packed_microbatches`)."""
    if settings.packing:
        return [
            ([r for b in bins for r in b], bins)
            for bins in packed_microbatches(rows, settings.max_tokens_per_microbatch)
        ]
    return [(part, None) for part in pack_microbatches(rows, settings.max_tokens_per_microbatch)]


def micro_logprobs(
    model: Any,
    batch: GroupBatch,
    bins: list[list[Row]] | None,
    settings: StepSettings,
    device: torch.device,
    with_entropy: bool = False,
) -> Any:
    """:func:`sequence_logprobs` of ``batch`` (``(B, T-1)``), from one packed forward over ``bins``
    when they are given (the same values, zeros at padding)."""
    if bins is not None:
        width = int(batch.input_ids.shape[1])
        return packed_logprobs(model, bins, width, settings.temperature, device, with_entropy)
    return batch_logprobs(model, batch, settings.temperature, with_entropy=with_entropy)


def _stack(rows: list[Row], store: dict, width: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32, device=device)
    for b, row in enumerate(rows):
        values = store[row.key]
        out[b, : values.shape[0]] = values.to(device)
    return out


@torch.no_grad()
def score_rows(
    model: Any, rows: list[Row], settings: StepSettings, device: torch.device
) -> dict[tuple[int, int], torch.Tensor]:
    """Per-row log-probs ``(length − 1,)`` on CPU under the model's current adapter state, in
    micro-batches of at most ``max_tokens_per_microbatch`` padded tokens (memory stays bounded by
    one micro-batch whatever the number of rows), without gradients."""
    scored: dict[tuple[int, int], torch.Tensor] = {}
    for micro, bins in microbatches(rows, settings):
        logprobs = micro_logprobs(model, collate(micro).to(device), bins, settings, device)
        for b, row in enumerate(micro):
            scored[row.key] = logprobs[b, : row.length - 1].detach().cpu()
    return scored


def score_reference(
    model: Any, rows: list[Row], settings: StepSettings, device: torch.device
) -> dict[tuple[int, int], torch.Tensor]:
    """:func:`score_rows` under the base model (every adapter disabled)."""
    with model.disable_adapter():
        return score_rows(model, rows, settings, device)


def score_old_logprobs(
    model: Any, rows: list[Row], cache: LogprobCache, settings: StepSettings, device: torch.device
) -> None:
    """Fill ``cache.old`` with every row's log-probs under the current (pre-update) policy: called
    once before step 1 (with ``recorded`` the ratio uses the recorded log-probs; the pass still
    records the starting policy for :mod:`kiln.core.train.drift`)."""
    cache.old.update(score_rows(model, [r for r in rows if r.key not in cache.old], settings, device))


def _fill_reference(
    model: Any, rows: list[Row], cache: LogprobCache, settings: StepSettings, device: torch.device
) -> None:
    missing = [r for r in rows if r.key not in cache.ref]
    if missing:
        cache.ref.update(score_reference(model, missing, settings, device))


def _recorded(batch: GroupBatch) -> torch.Tensor:
    """The batch's recorded log-probs, for a setting that needs them (``training_rows`` refuses
    such data without them first)."""
    if batch.behavior_logprobs is None:
        raise TrainingFailed(
            "the training settings need the recorded logprobs on every action piece", code="invalid_training_data"
        )
    return batch.behavior_logprobs


def _old_logprobs(
    rows: list[Row], batch: GroupBatch, logprobs: torch.Tensor, cache: LogprobCache, settings: StepSettings
) -> torch.Tensor:
    if settings.recorded:
        return _recorded(batch)
    for b, row in enumerate(rows):
        if row.key not in cache.old:  # not pre-scored (an older checkpoint): score at first visit
            cache.old[row.key] = logprobs[b, : row.length - 1].detach().cpu()
    return _stack(rows, cache.old, logprobs.shape[1], logprobs.device)


def _micro_step(
    model: Any,
    micro: Micro,
    settings: StepSettings,
    cache: LogprobCache,
    totals: tuple[float, float, float],
    device: torch.device,
) -> dict[str, float]:
    """Forward + backward of one micro-batch; returns its additive contributions."""
    action_total, obs_total, sequence_total = totals
    rows, bins = micro
    batch = collate(rows).to(device)
    entropy = None
    if settings.entropy_coeff > 0:
        logprobs, entropy = micro_logprobs(model, batch, bins, settings, device, with_entropy=True)
    else:
        logprobs = micro_logprobs(model, batch, bins, settings, device)
    old = _old_logprobs(rows, batch, logprobs, cache, settings)
    advantages = batch.advantages.unsqueeze(-1).expand_as(logprobs)
    kl = torch.zeros((), device=device)
    if settings.kl_on:
        ref = _stack(rows, cache.ref, logprobs.shape[1], device)
        if settings.kl_estimator == "k1":
            advantages = advantages - settings.kl_coeff * kl_k1_penalty(old, ref, batch.action_mask)
            kl = ((logprobs.detach() - ref) * batch.action_mask).sum() / action_total
        else:
            kl = kl_k3(logprobs, ref, batch.action_mask, denominator=action_total)
    weights: torch.Tensor | None = None
    is_stats: dict[str, float] = {}
    cap = settings.stale_is_max_weight if not settings.recorded else None
    cap = settings.engine_is_max_weight if cap is None else cap
    if cap is not None:
        weights, is_stats = truncated_is_weights(old, _recorded(batch), batch.action_mask, cap)
    p_loss, stats = policy_loss(
        logprobs,
        old,
        advantages,
        batch.action_mask,
        clip_epsilon=settings.clip_epsilon,
        clip_eps_high=settings.clip_eps_high,
        is_level=settings.is_level,
        cispo_max_weight=settings.cispo_max_weight,
        denominator=_policy_denominator(batch, settings, action_total, sequence_total),
        is_weights=weights,
        sequence_denominator=sequence_total,
    )
    env = echo_loss(logprobs, batch.env_mask, batch.obs_lengths, denominator=obs_total)
    total = p_loss
    extra = {}
    if entropy is not None:
        mean_entropy = (entropy * batch.action_mask).sum() / action_total
        total = total - settings.entropy_coeff * mean_entropy
        extra["entropy"] = float(mean_entropy.detach().item())
    if settings.kl_on and settings.kl_estimator == "k3":
        total = total + settings.kl_coeff * kl
    if settings.echo_lambda > 0:
        total = total + settings.echo_lambda * env
    total.backward()
    with torch.no_grad():  # k3 estimate of KL(π_old ‖ π) on this step's action tokens (target_kl)
        log_ratio = (logprobs.detach() - old) * batch.action_mask
        approx_kl = float(((torch.exp(log_ratio) - 1.0 - log_ratio) * batch.action_mask).sum().item()) / action_total
    return {
        "approx_kl": approx_kl,
        "loss": float(total.detach().item()),
        "policy_loss": float(p_loss.detach().item()),
        "env_ce": float(env.detach().item()),
        "kl": float(kl.detach().item()),
        "clipped_tokens": stats["clipped_tokens"],
        "max_ratio_deviation": stats["max_ratio_deviation"],
        "tokens": float(batch.tokens),
        **is_stats,
        **extra,
    }


def _policy_denominator(
    batch: GroupBatch, settings: StepSettings, action_total: float, sequence_total: float
) -> float | torch.Tensor:
    """The policy term's normaliser (``loss_normaliser``): a scalar, or per row ``(B, 1)``."""
    if settings.loss_normaliser == "sequences":
        return batch.action_mask.sum(dim=-1, keepdim=True).clamp(min=1.0) * sequence_total
    if settings.loss_normaliser == "constant":
        return sequence_total * float(settings.loss_constant_tokens or 1.0)
    return action_total


_PEAKS = ("max_ratio_deviation", "is_ratio_max", "is_weight_max")


def train_step(
    model: Any,
    rows: list[Row],
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    settings: StepSettings,
    cache: LogprobCache,
    device: torch.device,
    ranks: Any = None,
) -> dict[str, float]:
    """One optimizer step over ``rows`` (every completion of the step's groups).

    ``ranks`` (a :class:`kiln.core.train.distributed.RankGroup`): this rank trains its shard of ``rows``
    and the figures and LoRA gradients are summed over the ranks before the clip and the update.

    ``approx_kl`` is the k3 estimate ``mean(r − 1 − log r)`` of KL(π_old ‖ π) over the step's
    action tokens, measured before the update; with ``settings.target_kl`` set and exceeded the
    update is not taken and the values carry ``stopped: True``."""
    action_total = max(1.0, float(sum(float(r.action.sum()) for r in rows)))
    obs_total = max(1.0, float(sum(1 for r in rows if r.obs_length > 0)))
    sequence_total = max(1.0, float(sum(1 for r in rows if float(r.action.sum()) > 0)))
    if settings.kl_on:
        _fill_reference(model, rows, cache, settings, device)
    optimizer.zero_grad(set_to_none=True)
    sums = {
        "loss": 0.0,
        "policy_loss": 0.0,
        "env_ce": 0.0,
        "kl": 0.0,
        "clipped_tokens": 0.0,
        "tokens": 0.0,
        "approx_kl": 0.0,
    }
    peaks = {"max_ratio_deviation": 0.0}
    micro = microbatches(rows if ranks is None else ranks.local_rows(rows), settings)
    for part in micro:
        for key, value in _micro_step(
            model, part, settings, cache, (action_total, obs_total, sequence_total), device
        ).items():
            if key in _PEAKS:
                peaks[key] = max(peaks.get(key, 0.0), value)
            else:
                sums[key] = sums.get(key, 0.0) + value
    if ranks is not None:
        sums, peaks = ranks.finish_step(model, rows, len(micro), sums, peaks, params, settings.temperature, device)
    stop = settings.target_kl is not None and sums["approx_kl"] > settings.target_kl
    grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
    if stop:  # the policy moved past target_kl: this step's update is not taken
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    values = {
        "loss": sums["loss"],
        "policy_loss": sums["policy_loss"],
        "env_ce": sums["env_ce"],
        "kl": sums["kl"],
        "grad_norm": float(grad_norm.item()),
        "clip_fraction": sums["clipped_tokens"] / action_total,
        "max_ratio_deviation": peaks["max_ratio_deviation"],
        "microbatches": len(micro),
        "approx_kl": sums["approx_kl"],
    }
    for key, value in values.items():
        if not math.isfinite(value):
            raise TrainingFailed(f"non-finite {key} ({value})", code="non_finite_loss")
    if "entropy" in sums:
        values["entropy"] = sums["entropy"]
    if "is_weight_max" in peaks:  # stale or other-engine data: its truncated importance weights
        values.update(
            is_ratio_max=peaks["is_ratio_max"],
            is_weight_max=peaks["is_weight_max"],
            is_truncated_fraction=sums["is_truncated_tokens"] / action_total,
        )
    values["tokens"] = int(sums["tokens"])
    if stop:
        values["stopped"] = True
    return values
