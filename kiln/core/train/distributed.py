"""One training rank's side of a trainer that spans several devices (torch.distributed + FSDP2).

A :class:`RankGroup` is what the trainer's code sees of the other ranks. Every rank holds the
same rows, the same LoRA and the same optimizer state; what differs is the base model's weights
and the step's work:

- **the base model is sharded** with FSDP2 (``torch.distributed.fsdp.fully_shard``, one unit per
  decoder layer plus the root), so a rank keeps ``1/N`` of the base weights resident and gathers
  one unit at a time while it computes;
- **the LoRA is replicated**: its parameters are FSDP2's ``ignored_params`` (plain tensors on
  every rank), their gradients are summed across ranks with one all-reduce before clipping, and
  every rank takes the same optimizer step. The LoRA is a few MB even on a 27B model; replicated,
  the optimizer (Muon included), checkpoints and the adapter file are exactly the single-rank
  ones, and rank 0 alone writes them;
- **each rank trains its shard of the same global step**: rows ``rank::N`` of the step, in
  micro-batches of at most ``max_tokens_per_microbatch`` tokens. The loss terms keep the step's
  global denominators (action tokens, sequences), so the summed gradient is one rank's up to float
  rounding. FSDP2's gathers are collectives, so every rank runs the same number of forward and
  backward passes: a rank with fewer micro-batches runs zero-weight passes (:meth:`pad_passes`);
  the no-grad scoring passes (old, reference, final log-probs) score every row on every rank.

The step's figures (sums such as the loss, peaks such as the largest ratio) are reduced across
ranks (:meth:`reduce_figures`), so every rank reports and decides (``target_kl``) the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# figures of a step that add up across ranks, and those whose maximum is the step's
SUMMED = ("loss", "policy_loss", "env_ce", "kl", "clipped_tokens", "tokens", "approx_kl", "is_truncated_tokens")
PEAKED = ("max_ratio_deviation", "is_ratio_max", "is_weight_max")


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the group of training ranks (the process group is initialised)."""

    rank: int
    world_size: int
    backend: str  # gloo | nccl

    @property
    def is_main(self) -> bool:
        """Rank 0 relays progress and writes checkpoints, the adapter and the receipt."""
        return self.rank == 0

    def local_rows(self, rows: list[Any]) -> list[Any]:
        """This rank's shard of a step's rows (every N-th, from its rank)."""
        return rows[self.rank :: self.world_size]

    def most_microbatches(self, count: int) -> int:
        """The largest micro-batch count of any rank this step."""
        value = torch.tensor([count], dtype=torch.int64, device=self._device())
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return int(value.item())

    def pad_passes(self, model: Any, row: Any, passes: int, temperature: float, device: torch.device) -> None:
        """``passes`` forward+backward passes of weight zero over ``row``: the collectives of a
        micro-batch this rank does not have (its gradient contribution is exactly zero)."""
        from kiln.core.train.batches import collate
        from kiln.core.train.step import batch_logprobs

        for _ in range(passes):
            logprobs = batch_logprobs(model, collate([row]).to(device), temperature)
            (logprobs.sum() * 0.0).backward()

    def finish_step(
        self,
        model: Any,
        rows: list[Any],
        microbatches: int,
        sums: dict[str, float],
        peaks: dict[str, float],
        params: list[torch.nn.Parameter],
        temperature: float,
        device: torch.device,
    ) -> tuple[dict, dict]:
        """After this rank's ``microbatches`` micro-steps over :meth:`local_rows` of ``rows``: the
        padding passes, then the step's figures and the LoRA gradients summed over the ranks (the
        same collectives in the same order on every rank)."""
        self.pad_passes(model, rows[0], self.most_microbatches(microbatches) - microbatches, temperature, device)
        sums, peaks = self.reduce_figures(sums, peaks)
        self.reduce_gradients(params)
        return sums, peaks

    def reduce_figures(self, sums: dict[str, float], peaks: dict[str, float]) -> tuple[dict, dict]:
        """The step's figures over every rank: ``SUMMED`` added, ``PEAKED`` maxed; a figure only
        some ranks produced (a rank without micro-batches has no IS figures) is kept."""
        known = [k for k in SUMMED] + [k for k in PEAKED]
        present = torch.tensor(
            [1.0 if (k in sums or k in peaks) else 0.0 for k in known], dtype=torch.float64, device=self._device()
        )
        added = torch.tensor([float(sums.get(k, 0.0)) for k in SUMMED], dtype=torch.float64, device=present.device)
        maxed = torch.tensor(
            [float(peaks.get(k, float("-inf"))) for k in PEAKED], dtype=torch.float64, device=present.device
        )
        op = torch.distributed.ReduceOp
        torch.distributed.all_reduce(present, op=op.MAX)
        torch.distributed.all_reduce(added, op=op.SUM)
        torch.distributed.all_reduce(maxed, op=op.MAX)
        have = {k for k, flag in zip(known, present.tolist()) if flag > 0}
        extra = {k: v for k, v in sums.items() if k not in SUMMED}
        out_sums = {**extra, **{k: v for k, v in zip(SUMMED, added.tolist()) if k in have}}
        out_peaks = {k: v for k, v in zip(PEAKED, maxed.tolist()) if k in have}
        return out_sums, out_peaks

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the replicated LoRA's gradients over the ranks (one flat all-reduce)."""
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        offset = 0
        for param, grad in zip(params, grads):
            n = grad.numel()
            param.grad = flat[offset : offset + n].view_as(grad).to(grad.dtype)
            offset += n

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's repeated blocks (the classes transformers names in ``_no_split_modules``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    return [m for m in base.modules() if type(m).__name__ in names]


def shard_base_model(model: Any, group: RankGroup, device: torch.device) -> None:
    """FSDP2 over the LoRA-wrapped model: each decoder layer a unit; the input embeddings, the
    final norm and the output head one grouped unit (tied embeddings share a weight, and the
    trainer calls the head apart from the backbone, :func:`kiln.core.train.losses.sequence_logprobs`);
    the backbone the root. The trainable LoRA parameters are ignored (replicated) and moved to
    ``device``; the base shards move with FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (group.world_size,))
    lora = {p for p in model.parameters() if p.requires_grad}
    layers = decoder_layers(model)
    if not layers:
        from kiln.core.errors import TrainingFailed

        raise TrainingFailed(
            "the model names no repeated layers (_no_split_modules) to shard across ranks",
            code="training_unshardable",
            retryable=False,
            hint="train this model on one device (KILN_TRAIN_DEVICES=1)",
        )
    lm = model.get_base_model()
    decoder = lm.get_decoder()
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=lora)
    ends = [lm.get_input_embeddings(), lm.get_output_embeddings()]
    if isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        ends.append(decoder.norm)
    fully_shard([m for m in ends if m is not None], mesh=mesh, ignored_params=lora)
    fully_shard(decoder, mesh=mesh, ignored_params=lora)
    with torch.no_grad():
        for param in lora:
            param.data = param.data.to(device)


def local_base_bytes(model: Any) -> int:
    """Bytes of the base (frozen) weights this rank holds resident: the local shard of each
    FSDP2-managed parameter, the whole tensor of an unsharded one."""
    total = 0
    for param in model.parameters():
        if param.requires_grad:
            continue
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def resident_base_bytes(model: Any, ranks: RankGroup | None) -> int:
    """:func:`local_base_bytes` of the rank holding the most, every unit resharded (every rank
    calls it). A pass gathers one unit at a time on top of this (the embeddings and head unit for
    the whole pass): the transient peak, which ``bench/distributed.py`` reports beside it."""
    if ranks is None:
        return local_base_bytes(model)
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # a unit a no-grad pass left gathered (the head's) frees its copy
        if isinstance(module, FSDPModule):
            module.reshard()
    local = local_base_bytes(model)
    value = torch.tensor([local], dtype=torch.int64, device=ranks._device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return int(value.item())
